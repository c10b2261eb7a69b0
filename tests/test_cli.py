"""What every command does alike: unknown SIDECAR_* variables are named, and a reader that
leaves early (`| head -1`) ends nothing in a traceback."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import unknown_variables
from sidecar.delivery.handoff import WRAPPER_SOCKET_VARIABLE
from sidecar.options import CONFIG_OPTION, OPTIONS
from tests.conftest import RUN_ID, SIDECAR, TOKEN, clean_environ
from tests.ingest_server import RunningIngest


def test_a_misspelt_variable_is_named_with_the_closest_known_one() -> None:
    warnings = unknown_variables({"SIDECAR_HARDWARE_INTERVALL": "5", "SIDECAR_LOG": "x.log",
                                  "PATH": "/usr/bin"})
    assert warnings == ["SIDECAR_HARDWARE_INTERVALL is set but no sidecar option reads it, so it "
                        "is ignored; did you mean SIDECAR_HARDWARE_INTERVAL?"]


def test_a_name_like_none_gets_no_guess() -> None:
    [warning] = unknown_variables({"SIDECAR_FOO": "1"})
    assert "did you mean" not in warning and "sidecar run --help" in warning


def test_every_variable_the_sidecar_reads_is_known() -> None:
    known = {opt.env: "1" for opt in (*OPTIONS, CONFIG_OPTION)}
    assert unknown_variables({**known, WRAPPER_SOCKET_VARIABLE: "@x"}) == []


def test_the_real_run_warns_once_per_unknown_variable(tmp_path: Path) -> None:
    env = {**clean_environ(), "STARFORGE_ENABLED": "0", "SIDECAR_STATUS_ADDR": "off",
           "SIDECAR_STATE_DIR": str(tmp_path), "SIDECAR_HARDWARE_INTERVALL": "5",
           "SIDECAR_DRAIN_TIMEOUTT": "3"}
    done = subprocess.run([*SIDECAR, "run", "--", "true"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 2, done.stderr
    assert "SIDECAR_DRAIN_TIMEOUTT" in warnings[0] and "SIDECAR_DRAIN_TIMEOUT?" in warnings[0]
    assert "did you mean SIDECAR_HARDWARE_INTERVAL?" in warnings[1]


def test_demo_runs_the_bundled_trainer_to_success(tmp_path: Path) -> None:
    done = subprocess.run([*SIDECAR, "demo"], env={**clean_environ(), "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== sidecar run exited with 0" in done.stdout
    events = [line.split()[-1] for line in done.stdout.split("lifecycle:\n", 1)[1].splitlines()
              if line.startswith("  ") and line.split()[-1] in ("starting", "running",
                                                                  "succeeded", "failed")]
    assert events == ["starting", "running", "succeeded"]
    assert "can't open file" not in done.stdout + done.stderr
    # its checkpoint, uploaded to the receiver's own object folder and registered
    uploaded = done.stdout.split("artifacts (uploaded", 1)[1]
    assert "checkpoint step 40, 65612 bytes: file://" in uploaded
    assert uploaded.strip().endswith("/objects/demo-run/checkpoints/step_40.safetensors")


# -- flags: typos named, no abbreviation, -V ------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**clean_environ(), "STARFORGE_ENABLED": "0", "SIDECAR_STATUS_ADDR": "off"}
    return subprocess.run([*SIDECAR, *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize(("args", "usage", "said"), [
    (["run", "--jsnol", "a.jsonl", "--", "true"], "usage: sidecar run",
     "sidecar run: error: unknown option --jsnol; did you mean --jsonl?"),
    (["watch", "--log", "a.log", "--hardware-intervall=5"], "usage: sidecar watch",
     "did you mean --hardware-interval?"),
    (["status", "--onc"], "usage: sidecar status",
     "sidecar status: error: unknown option --onc; did you mean --once?"),
    (["check", "--jso"], "usage: sidecar check", "did you mean --json?"),
    (["stauts"], "usage: sidecar ", "unknown command 'stauts'; did you mean status?"),
])
def test_a_typo_gets_the_command_s_usage_and_the_closest_flag(args: list[str], usage: str,
                                                               said: str) -> None:
    done = cli(*args)
    assert done.returncode == 2
    assert done.stderr.startswith(usage), done.stderr
    assert said in done.stderr
    assert done.stdout == ""


def test_watch_with_a_command_says_watch_runs_none_and_what_does() -> None:
    """`sidecar watch -- python x.py` said `unknown option --`, as if `--` were a typo
    (issue 35)."""
    done = cli("watch", "--jsonl", "m.jsonl", "--", "python", "x.py")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: sidecar watch"), done.stderr
    assert ("sidecar watch: error: `watch` follows files and runs no command; to run one, use "
            "`sidecar run [OPTIONS] -- python x.py`") in done.stderr
    assert "unknown option" not in done.stderr


def test_an_abbreviation_is_refused_not_taken_for_the_whole_flag() -> None:
    done = cli("status", "--onc", "--status-addr", "127.0.0.1:1")
    assert done.returncode == 2  # not 1: the abbreviation was not taken for --once
    assert "nothing answers" not in done.stderr


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_dash_v_is_the_version(flag: str) -> None:
    done = cli(flag)
    assert done.returncode == 0
    assert done.stdout.startswith("sidecar ")


# -- shell completion ---------------------------------------------------------------------------


def _bash_completes(*words: str) -> list[str]:
    script = cli("completion", "bash").stdout
    line = ("source /dev/stdin; COMP_WORDS=(" + " ".join(shlex.quote(w) for w in words)
            + f"); COMP_CWORD={len(words) - 1}; _sidecar; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    done = subprocess.run(["bash", "-c", line], input=script, capture_output=True, text=True,
                          timeout=30, check=True)
    return done.stdout.split()


def test_bash_completion_names_commands_flags_and_choices() -> None:
    assert _bash_completes("sidecar", "con") == ["config"]
    assert _bash_completes("sidecar", "run", "--jso") == ["--jsonl"]
    assert _bash_completes("sidecar", "watch", "--log-ansi", "") == ["strip", "keep"]
    assert _bash_completes("sidecar", "lifecycle", "su") == ["succeeded"]
    assert _bash_completes("sidecar", "completion", "") == ["bash", "zsh"]
    assert "--tty" not in _bash_completes("sidecar", "watch", "--t")  # run's alone


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_is_a_valid_completion_function_for_sidecar(tmp_path: Path) -> None:
    script = cli("completion", "zsh")
    assert script.returncode == 0 and script.stdout.startswith("#compdef sidecar\n")
    (tmp_path / "_sidecar").write_text(script.stdout)
    line = (f"fpath=({tmp_path} $fpath); autoload -Uz compinit; "
            f"compinit -u -d {tmp_path}/dump; print -r -- $_comps[sidecar]")
    done = subprocess.run(["zsh", "-f", "-c", line], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.stdout.strip() == "_sidecar", done.stderr
    assert subprocess.run(["zsh", "-n", str(tmp_path / "_sidecar")], check=False).returncode == 0
    for flag in ("--jsonl", "--running-when", "--once"):
        assert flag in script.stdout


# -- an explicit --status-addr that is busy -----------------------------------------------------


@pytest.mark.parametrize("command", [["watch", "--log", "x.log"],
                                     ["run", "--", sys.executable, "-c", "open('ran', 'w')"]])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_busy_status_addr_given_explicitly_is_a_configuration_error(
        tmp_path: Path, command: list[str], host: str) -> None:
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind((host, 0))
        busy.listen()
        taken = f"{host}:{busy.getsockname()[1]}"
        env = {**clean_environ(), "STARFORGE_ENABLED": "1",
               "STARFORGE_ENDPOINT": "http://127.0.0.1:9/api/ingest",
               "STARFORGE_RUN_ID": "run-1", "STARFORGE_TOKEN": "tok-0123456789",
               "SIDECAR_STATE_DIR": str(tmp_path / "state"), "SIDECAR_HARDWARE_INTERVAL": "0"}
        done = subprocess.run([*SIDECAR, command[0], "--status-addr", taken, *command[1:]],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"sidecar {command[0]}: configuration error: --status-addr "
                                  f"{taken} (SIDECAR_STATUS_ADDR): cannot listen there")
    assert not (tmp_path / "ran").exists()  # the command was never started
    assert not (tmp_path / "state").exists()


# -- the default state folder unwritable --------------------------------------------------------


def _platform(ingest: RunningIngest, **extra: str) -> dict[str, str]:
    env = {**clean_environ(), "STARFORGE_ENABLED": "1", "STARFORGE_ENDPOINT": ingest.base_url,
           "STARFORGE_RUN_ID": RUN_ID, "STARFORGE_TOKEN": TOKEN, "SIDECAR_STATUS_ADDR": "off",
           "SIDECAR_HARDWARE_INTERVAL": "0"}
    env.update(extra)
    return env


def test_an_unwritable_default_state_folder_falls_back_to_a_private_one(
        ingest: RunningIngest, tmp_path: Path) -> None:
    blocker = tmp_path / "home-is-a-file"  # as a read-only home: nothing can be made there
    blocker.write_text("")
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = _platform(ingest, XDG_STATE_HOME=str(blocker / "state"), TMPDIR=str(private_tmp),
                    NODE_NAME="gpu-1")
    done = subprocess.run([*SIDECAR, "run", "--", sys.executable, "-c", "print('trained')"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, done.stderr
    private = private_tmp / f"sidecar-{os.getuid()}"
    assert f"is kept in {private} instead" in warnings[0]
    assert private.stat().st_mode & 0o777 == 0o700
    assert (private / RUN_ID / "gpu-1" / "lifecycle.journal").exists()
    assert [r["event"] for r in ingest.records("lifecycle")] == [
        "starting", "running", "succeeded"]


def test_an_unwritable_state_dir_given_explicitly_stays_an_error(
        ingest: RunningIngest, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = _platform(ingest, SIDECAR_STATE_DIR=str(blocker / "state"), TMPDIR=str(tmp_path))
    done = subprocess.run([*SIDECAR, "run", "--", sys.executable, "-c", "open('ran', 'w')"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert "--state-dir (SIDECAR_STATE_DIR)" in done.stderr
    assert not (tmp_path / "ran").exists()
    assert not list(tmp_path.glob("sidecar-*"))


# -- usage errors: said before anything is posted or the journal is opened -----------------------


def test_a_glob_the_shell_expanded_is_a_usage_error_and_leaves_the_run_unused(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """`--jsonl gl/*.jsonl` unquoted, two files matching: the second was taken for the command,
    `starting` and `failed` were posted (exit 127), and the corrected start posted nothing."""
    (tmp_path / "gl").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "gl" / name).write_text("")
    env = _platform(ingest, SIDECAR_STATE_DIR=str(tmp_path / "state"))
    trainer = [sys.executable, "-c", "open('ran', 'w')"]
    expanded = ["run", "--jsonl", "gl/a.jsonl", "gl/b.jsonl", "--", *trainer]
    done = subprocess.run([*SIDECAR, *expanded], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: sidecar run"), done.stderr
    assert ("sidecar run: error: 'gl/b.jsonl' stands before --" in done.stderr
            and "quote it (--jsonl 'gl/*.jsonl')" in done.stderr), done.stderr
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "state").exists()  # no journal, no folder
    assert ingest.records("lifecycle") == []
    quoted = subprocess.run([*SIDECAR, "run", "--jsonl", "gl/*.jsonl", "--", *trainer], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            check=False)
    assert quoted.returncode == 0, quoted.stderr
    assert [r["event"] for r in ingest.records("lifecycle")] == [
        "starting", "running", "succeeded"]


@pytest.mark.parametrize("given", [["--drain-timeout", "5", "--drain-timeout", "9"],
                                   ["--drain-timeout=5", "--drain-timeout", "9"],
                                   ["--hparams", "a.yaml", "--hparams", "b.yaml"]])
def test_an_option_that_takes_one_value_given_twice_is_a_usage_error(
        ingest: RunningIngest, tmp_path: Path, given: list[str]) -> None:
    env = _platform(ingest, SIDECAR_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run([*SIDECAR, "run", *given, "--", sys.executable, "-c",
                           "open('ran', 'w')"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    flag = given[0].partition("=")[0]
    assert (f"sidecar run: error: {flag} is given twice ({given[0].partition('=')[2] or given[1]!r}"
            f", then {given[-1]!r}) and takes one value: give it once") in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "state").exists()
    assert ingest.records("lifecycle") == []


def test_a_command_without_its_separator_is_a_usage_error() -> None:
    done = cli("run", "python", "train.py")
    assert done.returncode == 2
    assert ("sidecar run: error: 'python' stands where -- belongs: the command goes after --"
            in done.stderr), done.stderr
