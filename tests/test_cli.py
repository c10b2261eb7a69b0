"""What every command does alike: unknown SIDECAR_* variables are named, and a reader that
leaves early (`| head -1`) ends nothing in a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sidecar.config import CONFIG_OPTION, OPTIONS, WRAPPER_SOCKET_VARIABLE, unknown_variables
from tests.conftest import SIDECAR, clean_environ


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
