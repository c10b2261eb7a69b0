"""Everything `run` and `watch` need is validated before the command is spawned or anything is
posted (docs/commands.md#checked-before-anything-starts; issue 13, cause 2): a fault exits 2
with one line naming the option or variable and the fix, never the token, and the command never
runs."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

from tests.conftest import RUN_ID, TOKEN, Sidecar, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest, wait_until

PASSWORD = "pw-hunter2-0123456789"


def marker_child(tmp_path: Path) -> list[str]:
    """A command that leaves a file behind if it ever runs."""
    return python_child(f"open({str(tmp_path / 'child-ran')!r}, 'w').close()")


def refused(tmp_path: Path, env: dict[str, str], *options: str, command: str = "run") -> str:
    """Run the sidecar; it must exit 2 with one line, the command never run. The line."""
    args = [command, *options] + (["--", *marker_child(tmp_path)] if command == "run" else [])
    done = sidecar(args, env, tmp_path / "out", timeout=30)
    err = done.stderr.decode()
    assert done.status == 2, err
    assert not (tmp_path / "child-ran").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert TOKEN not in err and PASSWORD not in err
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# Each case: (id, how it is set up, what the message must name)
Setup = Callable[[Path, RunningIngest], tuple[dict[str, str], list[str]]]


def _env(ingest: RunningIngest, tmp_path: Path, **extra: str) -> dict[str, str]:
    return platform_env(ingest, tmp_path / "state", **extra)


CASES: list[tuple[str, Setup, tuple[str, ...]]] = [
    ("token file with a second line", lambda t, i: (_env(i, t), [
        "--token-file", str(write(t / "token", TOKEN + "\nsecond line\n"))]),
     ("--token-file", "more than one line")),
    ("token variable a header cannot carry", lambda t, i: (
        _env(i, t, STARFORGE_TOKEN=TOKEN + "\u00e9"), []), ("STARFORGE_TOKEN", "non-ASCII")),
    ("endpoint path not ending in /api/ingest", lambda t, i: (
        _env(i, t, STARFORGE_ENDPOINT=i.base_url.removesuffix("/api/ingest") + "/api/v1"), []),
     ("STARFORGE_ENDPOINT", "/api/ingest")),
    ("endpoint port not a number", lambda t, i: (
        _env(i, t, STARFORGE_ENDPOINT="http://127.0.0.1:notaport/api/ingest"), []),
     ("STARFORGE_ENDPOINT", "port")),
    ("endpoint port over 65535", lambda t, i: (
        _env(i, t, STARFORGE_ENDPOINT="http://127.0.0.1:70000/api/ingest"), []),
     ("STARFORGE_ENDPOINT", "port")),
    ("endpoint with user:password@", lambda t, i: (
        _env(i, t, STARFORGE_ENDPOINT=i.base_url.replace("//", f"//trainer:{PASSWORD}@")), []),
     ("STARFORGE_ENDPOINT", "credentials")),
    ("missing --ca-file", lambda t, i: (_env(i, t), ["--ca-file", str(t / "absent.pem")]),
     ("--ca-file", "no such file")),
    ("--ca-file not PEM", lambda t, i: (_env(i, t), [
        "--ca-file", str(write(t / "ca.pem", "not a certificate\n"))]),
     ("--ca-file", "PEM")),
    ("--state-dir a file", lambda t, i: (_env(i, t, SIDECAR_STATE_DIR=str(write(
        t / "file", ""))), []), ("--state-dir", "cannot be created or written")),
    ("--state-dir that cannot be created", lambda t, i: (
        _env(i, t, SIDECAR_STATE_DIR="/proc/sidecar-state"), []), ("--state-dir",)),
    ("default state dir under an unusable HOME", lambda t, i: (
        {k: v for k, v in _env(i, t, HOME="/proc/nonexistent").items()
         if k not in ("SIDECAR_STATE_DIR", "XDG_STATE_HOME")}, []),
     ("default --state-dir", "/proc/nonexistent")),
    ("--log-prefix with an unknown field", lambda t, i: (_env(i, t), ["--log-prefix", "{nod} "]),
     ("--log-prefix", "{nod}", "{node}")),
    ("--log-prefix with an open brace", lambda t, i: (_env(i, t), ["--log-prefix", "x{"]),
     ("--log-prefix", "{node}")),
    ("--hardware-interval below the floor", lambda t, i: (_env(i, t), [
        "--hardware-interval", "0.001"]), ("--hardware-interval", "1 s")),
    ("negative --drain-timeout", lambda t, i: (_env(i, t), ["--drain-timeout=-1"]),
     ("--drain-timeout",)),
    ("token pasted into another variable", lambda t, i: (
        _env(i, t, SIDECAR_LOG_PREFIX=TOKEN + "{"), []), ("SIDECAR_LOG_PREFIX", "***")),
    ("token file's token pasted into another variable", lambda t, i: (
        _env(i, t, SIDECAR_NODES="x" + TOKEN), [
            "--token-file", str(write(t / "token", TOKEN + "\n"))]),
     ("SIDECAR_NODES", "***")),
]


@pytest.mark.parametrize(("setup", "names"), [(s, n) for _, s, n in CASES],
                         ids=[c[0] for c in CASES])
def test_a_configuration_fault_exits_2_before_the_command_runs(
        ingest: RunningIngest, tmp_path: Path, setup: Setup, names: tuple[str, ...]) -> None:
    env, options = setup(tmp_path, ingest)
    line = refused(tmp_path, env, *options)
    assert line.startswith("sidecar run: configuration error: ")
    for name in names:
        assert name in line
    assert not ingest.records("lifecycle")  # nothing was posted: no run stuck in `starting`


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:notaport/api/ingest",
                                      "http://127.0.0.1:70000/api/ingest",
                                      f"http://trainer:{PASSWORD}@127.0.0.1:1/api/ingest"])
def test_check_explains_a_bad_url_without_crashing_or_echoing_the_password(
        tmp_path: Path, endpoint: str) -> None:
    done = sidecar(["check"], platform_env(endpoint, tmp_path / "state"), tmp_path / "out",
                   timeout=30)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.status == 2, out
    assert "Traceback" not in out and PASSWORD not in out
    assert "STARFORGE_ENDPOINT" in out


def test_watch_validates_too(ingest: RunningIngest, tmp_path: Path) -> None:
    line = refused(tmp_path, _env(ingest, tmp_path), "--log-prefix", "{nod}", "--hardware-interval",
                   "1", command="watch")
    assert line.startswith("sidecar watch: configuration error: --log-prefix")


def test_offline_run_says_once_that_reporting_is_off(tmp_path: Path) -> None:
    """STARFORGE_ENABLED=0 printed `lifecycle: starting/running/succeeded` as if reporting."""
    env = platform_env("http://unused.invalid/api/ingest", tmp_path / "state",
                       STARFORGE_ENABLED="0")
    done = sidecar(["run", "--", *python_child("print('hello')")], env, tmp_path / "out")
    err = done.stderr.decode()
    assert done.status == 0 and done.stdout == b"hello\n"
    assert err.count("reporting is off") == 1, err
    assert "lifecycle" not in err, err


def test_a_second_sidecar_on_the_same_run_folder_exits_2_naming_it_and_the_holder(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Two wrappers on one state folder posted `starting` 3 times, then `succeeded` and
    `failed`."""
    env = _env(ingest, tmp_path)
    hold = tmp_path / "release"
    first = Sidecar(["run", "--", *python_child(
        "import os, time\n"
        f"while not os.path.exists({str(hold)!r}): time.sleep(0.02)")], env, tmp_path / "first")
    try:
        ingest.wait_for(lambda: len(ingest.records("lifecycle")) >= 2, 20, "the first runs")
        line = refused(tmp_path, env)
        run_dir = tmp_path / "state" / RUN_ID
        assert str(run_dir) in line and f"PID {first.proc.pid}" in line, line
    finally:
        hold.touch()
        done = first.wait(30)
    assert done.status == 0
    assert [r["event"] for r in ingest.records("lifecycle")] == ["starting", "running",
                                                                 "succeeded"]


def test_the_lock_goes_with_a_killed_sidecar(ingest: RunningIngest, tmp_path: Path) -> None:
    env = _env(ingest, tmp_path)
    first = Sidecar(["run", "--", *python_child("import time; time.sleep(30)")], env,
                    tmp_path / "first")
    ingest.wait_for(lambda: len(ingest.records("lifecycle")) >= 2, 20, "the first runs")
    children = psutil.Process(first.proc.pid).children(recursive=True)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.wait(10)
    for child in children:
        with suppress(psutil.NoSuchProcess):
            child.kill()
    began = time.monotonic()
    done = sidecar(["run", "--", *python_child("pass")], env, tmp_path / "second")
    assert done.status == 0, done.stderr.decode()
    assert time.monotonic() - began < 20
    wait_until(lambda: "succeeded" in [r["event"] for r in ingest.records("lifecycle")], 10,
               "the second run ended")


@pytest.mark.parametrize("command", ["lifecycle running", "replay"])
def test_a_negative_timeout_is_refused(ingest: RunningIngest, tmp_path: Path,
                                       command: str) -> None:
    done = sidecar([*command.split(), "--timeout", "-1"], _env(ingest, tmp_path),
                   tmp_path / "out", timeout=30)
    assert done.status == 2 and b"--timeout" in done.stderr, done.stderr
    assert not ingest.records("lifecycle")
