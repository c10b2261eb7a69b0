"""Every configuration mistake at once (issue 35, item 4): `run` and `watch` exit 2 with one line
naming each one, worst first, and `check` goes on past the first and lists them all. With
nothing set it took four starts to learn that ENABLED, ENDPOINT, RUN_ID and TOKEN were needed;
a value of the `--config` file is named by the file and its key."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import TOKEN, clean_environ, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest


def refused(tmp_path: Path, env: dict[str, str], *args: str) -> str:
    """`sidecar ARGS` must exit 2 with one line, the command never run; the line."""
    marker = tmp_path / "child-ran"
    command = ["--", *python_child(f"open({str(marker)!r}, 'w').close()")]
    done = sidecar([*args, *(command if args[0] == "run" else [])], env, tmp_path / "out",
                   timeout=30)
    err = done.stderr.decode()
    assert done.status == 2, err
    assert not marker.exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert TOKEN not in err
    return lines[0]


def test_nothing_set_names_every_variable_reporting_needs_in_one_message(
        tmp_path: Path) -> None:
    env = {**clean_environ(), "HOME": str(tmp_path)}
    line = refused(tmp_path, env, "run")
    assert line.startswith("sidecar run: configuration error: STARFORGE_ENABLED or "
                           "TUNEPLANE_JOB_ENABLED is not set"), line
    for name in ("0 to run offline", "STARFORGE_ENDPOINT", "STARFORGE_RUN_ID", "STARFORGE_TOKEN"):
        assert name in line, line


def test_run_names_every_mistake_at_once_worst_first(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('drain-timeout = "x"\nlog_levle = "debug"\n')
    env = {**clean_environ(), "HOME": str(tmp_path), "STARFORGE_ENABLED": "1",
           "SIDECAR_LOG_PREFIX": "{nod}"}
    line = refused(tmp_path, env, "run", "--config", str(config), "--hardware-interval", "0.01")
    assert line.startswith("sidecar run: 5 configuration errors, all found at once: (1) "
                           "STARFORGE_ENDPOINT, STARFORGE_RUN_ID and STARFORGE_TOKEN are not "
                           "set"), line
    # the file's own mistakes name the file, the key and the value, not `--config='x'`
    assert f"--config {config}: unknown option 'log_levle'; did you mean log-level?" in line
    assert f"--config {config}: drain-timeout='x' is not a number" in line
    assert "--hardware-interval=0.01" in line and "SIDECAR_LOG_PREFIX='{nod}'" in line
    assert "(5) " in line and "(6) " not in line


def test_watch_and_json_messages_carry_them_all(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state", STARFORGE_RUN_ID="",
                       SIDECAR_MESSAGE_FORMAT="json")
    done = sidecar(["watch", "--log-prefix", "{nod}", "--drain-timeout=-1"], env,
                   tmp_path / "out", timeout=30)
    assert done.status == 2, done.stderr
    (message,) = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert message["level"] == "error" and message["command"] == "watch"
    assert str(message["msg"]).startswith("3 configuration errors, all found at once: (1) "
                                          "STARFORGE_RUN_ID is not set")
    assert "--log-prefix" in str(message["msg"]) and "--drain-timeout" in str(message["msg"])
    assert not ingest.records("lifecycle")


def test_check_goes_on_past_the_first_mistake_and_lists_them_all(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """It stopped at the first, saying nothing of the endpoint or the files."""
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text('{"step": 1, "loss": 0.5}\n')
    env = platform_env(ingest, tmp_path / "state", STARFORGE_TOKEN="",
                       SIDECAR_DRAIN_TIMEOUT="soon")
    done = sidecar(["check", "--jsonl", str(jsonl)], env, tmp_path / "out", timeout=30)
    out = done.stdout.decode()
    assert done.status == 2, out + done.stderr.decode()
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL  configuration")]
    assert len(failed) == 2, out
    assert "STARFORGE_TOKEN is not set" in failed[0]  # the platform's first: nothing without it
    assert "SIDECAR_DRAIN_TIMEOUT='soon' is not a number" in failed[1]
    # past them: the files and the endpoint, all but the authenticated probe
    assert any(line.startswith("ok    jsonl") for line in lines), out
    assert any(line.startswith("ok    tcp") for line in lines), out
    assert any(line.startswith("skip  probe") for line in lines), out
    assert lines[-1] == "sidecar check: configuration error (failed: configuration (2))", out


def test_config_json_lists_each_mistake(tmp_path: Path) -> None:
    env = {**clean_environ(), "HOME": str(tmp_path), "STARFORGE_ENABLED": "1",
           "SIDECAR_NODES": "0"}
    done = sidecar(["config", "--json"], env, tmp_path / "out", timeout=30)
    assert done.status == 2, done.stderr
    doc = json.loads(done.stdout)
    assert doc["ok"] is False and len(doc["errors"]) == 2, doc
    assert doc["errors"][0].startswith("STARFORGE_ENDPOINT, STARFORGE_RUN_ID and STARFORGE_TOKEN")
    assert doc["errors"][1].startswith("SIDECAR_NODES=0 must be at least 1")


def test_a_token_given_for_an_option_with_choices_is_masked_and_every_mistake_named(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """The token pasted as a value: argparse quoted it whole and stopped at its first error;
    the configuration names both mistakes, masked."""
    env = platform_env(ingest, tmp_path / "state")
    line = refused(tmp_path, env, "run", "--checkpoint-upload", TOKEN, "--log-ansi", TOKEN)
    assert line == ("sidecar run: 2 configuration errors, all found at once: (1) "
                    "--checkpoint-upload='***' must be one of auto, always, never; (2) "
                    "--log-ansi='***' must be one of strip, keep"), line
    event = sidecar(["lifecycle", TOKEN], env, tmp_path / "event", timeout=30)
    assert event.status == 2
    assert TOKEN not in event.stderr.decode() and "invalid choice: '***'" in \
        event.stderr.decode()


def test_a_file_given_as_the_checkpoints_folder_is_refused(ingest: RunningIngest,
                                                           tmp_path: Path) -> None:
    """It was said to be awaited ('does not exist yet; watching ... for it'), for ever."""
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    line = refused(tmp_path, platform_env(ingest, tmp_path / "state"), "run", "--checkpoints",
                   str(file))
    assert line == (f"sidecar run: configuration error: --checkpoints {file} is a file: give "
                    f"the folder the checkpoints are saved under (here {tmp_path}, or the "
                    "trainer's output_dir)"), line
