"""Shared fixtures: a contract-enforcing ingest on loopback and the real `sidecar` process."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from sidecar import process
from tests.ingest_server import RunningIngest, running_ingest

# The suite shares two cores with the sidecars it starts: no timing-based health checks.
settings.register_profile("sidecar", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("sidecar")

RUN_ID = "run-4f2a91"
TOKEN = "tok-SECRET-0123456789abcdef"
SIDECAR = (sys.executable, "-m", "sidecar")
# `sidecar` with the --hardware-interval floor (1 s) lowered, for a test that needs many samples
# quickly: the `fast_sampling` fixture makes every Sidecar of the test start this way.
FAST_SAMPLING = (sys.executable, "-c", "import sys; import sidecar.options as c; "
                 "c.MIN_HARDWARE_INTERVAL_S = 0.01; from sidecar.cli import main; sys.exit(main())")


@pytest.fixture(autouse=True)
def _a_fresh_process_for_each_test() -> Iterator[None]:
    """The process's own state (the secrets, the supervisor's counts, the NVML bindings...) as a
    new process has it, after every test: a token one test used was masked in a later test's
    output (its tmp_path `test_wrong_token_…` became `test_***_token_…`), so a test passed or
    failed by the order the suite ran in."""
    yield
    process.fresh()


@pytest.fixture
def fast_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", FAST_SAMPLING)


@pytest.fixture
def ingest(tmp_path: Path) -> Iterator[RunningIngest]:
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID, faults=True) as srv:
        yield srv


# The variables by which the job's environment chooses its GPUs (gpus.py). A sidecar a test
# starts passes its environment on as the command's: the runner's own (CUDA_VISIBLE_DEVICES=""
# keeping a CPU job off the GPUs, a GPU runner's indexes or UUIDs) would choose among the
# stand-in NVML's GPUs.
GPU_CHOICE = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


def clean_environ() -> dict[str, str]:
    """This process's environment without any platform or sidecar variable (the tests' own
    fault injection, _SIDECAR_TEST_FAULTS, too), nor one that chooses the job's GPUs
    (GPU_CHOICE): a test that wants one sets it."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("STARFORGE_", "TUNEPLANE_", "SIDECAR_", "_SIDECAR_"))
            and k not in GPU_CHOICE}


def platform_env(ingest: RunningIngest | str, state_dir: Path, **extra: str) -> dict[str, str]:
    """Variables as the platform injects them (StarForge family), pointing at `ingest`."""
    endpoint = ingest if isinstance(ingest, str) else ingest.base_url
    env = clean_environ()
    env.update(STARFORGE_ENABLED="1", STARFORGE_ENDPOINT=endpoint, STARFORGE_RUN_ID=RUN_ID,
               STARFORGE_TOKEN=TOKEN, SIDECAR_STATE_DIR=str(state_dir),
               SIDECAR_STATUS_ADDR="off")
    env.update(extra)
    return env


@dataclass
class Finished:
    """A finished `sidecar` process: its exit status and everything it printed."""

    status: int
    stdout: bytes
    stderr: bytes


class Sidecar:
    """A real `sidecar` process started by a test, its output kept in files."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], workdir: Path,
                 stdin: int | None = subprocess.DEVNULL,
                 preexec_fn: Callable[[], object] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self._out = open(workdir / "stdout", "w+b")  # noqa: SIM115 (closed in wait)
        self._err = open(workdir / "stderr", "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen([*SIDECAR, *args], env=dict(env), stdout=self._out,
                                     stderr=self._err, stdin=stdin, preexec_fn=preexec_fn)

    def wait(self, timeout: float = 60.0) -> Finished:
        status = self.proc.wait(timeout)
        result = []
        for fh in (self._out, self._err):
            fh.seek(0)
            result.append(fh.read())
            fh.close()
        return Finished(status, result[0], result[1])


def sidecar(args: Sequence[str], env: Mapping[str, str], workdir: Path,
            timeout: float = 60.0) -> Finished:
    """Run `sidecar ARGS` to completion."""
    return Sidecar(args, env, workdir).wait(timeout)


def python_child(code: str) -> list[str]:
    """A command that runs `code` in this interpreter: the wrapped 'trainer' of a test."""
    return [sys.executable, "-c", code]


def cut_at(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    """`data` cut at the given offsets (any order, duplicates allowed): blocks as a reader that
    gets them in pieces sees them."""
    points = sorted({min(max(c, 0), len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]
