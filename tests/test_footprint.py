"""What a daemon imports: the idle-memory target (issue 8, under 45 MB RSS) is met by not loading
code a running `sidecar watch` or `sidecar run` never uses. The figures themselves are measured
by tests/bench/bench_idle.py; these tests keep the heavy modules from creeping back in."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.observe.address import STATUS_ADDR_FILE
from tests.conftest import platform_env, python_child
from tests.ingest_server import RunningIngest, wait_until
from tests.test_hardware import TWO_GPUS, stub_dir  # noqa: F401 (stub_dir: a fixture)

# Loaded only by the commands or the moments that need them.
NOT_FOR_A_DAEMON = (
    "sidecar.commands.check",  # `sidecar check`
    "sidecar.commands.status",  # `sidecar status`
    "sidecar.commands.receive",  # `sidecar receive`
    "sidecar.observe.prometheus",  # the first /metrics scrape
    "prometheus_client",
    "importlib.metadata",
    "pynvml",  # only where libnvidia-ml.so.1 loads
    "tenacity",  # the first failed attempt
    "psutil",  # where /proc cannot answer
)

DAEMON_IMPORTS = """
import json, sys
from sidecar import cli, pipeline, runtime, watch
from sidecar.observe import endpoint as status
from sidecar.sources.telemetry import environment, sampler
from sidecar.sources.telemetry.nvml import bindings
cli.build_parser()
try:
    bindings.init()
except bindings.NvmlError as exc:
    reason = exc.reason()
else:
    reason = ""
print(json.dumps({"modules": sorted(sys.modules), "reason": reason}))
"""


def _has_real_nvml() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_a_daemon_without_gpus_loads_no_command_or_scrape_code() -> None:
    if _has_real_nvml():
        pytest.skip("libnvidia-ml.so.1 loads here: pynvml is rightly imported")
    done = subprocess.run([sys.executable, "-c", DAEMON_IMPORTS], capture_output=True,
                          text=True, timeout=60, check=True)
    found = json.loads(done.stdout)
    loaded = set(found["modules"])
    assert not loaded & set(NOT_FOR_A_DAEMON), sorted(loaded & set(NOT_FOR_A_DAEMON))
    assert found["reason"] == "the NVIDIA driver library libnvidia-ml.so.1 is not installed"


DAEMON_THEN_LIST_MODULES = """
import atexit, dataclasses, json, sys
from sidecar.cli import main

def loaded():
    modules = sorted(sys.modules)
    made = [f"{name}.{value.__qualname__}" for name in modules if name.startswith("sidecar")
            for value in vars(sys.modules[name]).values()
            if isinstance(value, type) and value.__module__ == name
            and dataclasses.is_dataclass(value)]
    return {"modules": modules, "dataclasses": made}

atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(loaded())))
sys.exit(main(sys.argv[2:]))
"""


def _watch_modules(ingest: RunningIngest, tmp_path: Path, status_addr: str) -> set[str]:
    """The modules of a running `sidecar watch --log` once its line was delivered and, with the
    status endpoint on, /healthz answered."""
    return set(_watch_loaded(ingest, tmp_path, SIDECAR_HARDWARE_INTERVAL="0",
                             SIDECAR_STATUS_ADDR=status_addr)["modules"])


def _watch_loaded(ingest: RunningIngest, tmp_path: Path, **extra: str) -> dict[str, list[str]]:
    """What `_watch_modules` says, and the dataclasses its sidecar modules define, for a watch
    with the variables `extra`; with hardware sampling on, once a sample was delivered."""
    log = tmp_path / "train.log"
    log.write_text("one line\n")
    state = tmp_path / "state"
    env = platform_env(ingest, state, **extra)

    def running() -> None:
        ingest.wait_for(lambda: ingest.records("logs"), 30)
        if extra.get("SIDECAR_HARDWARE_INTERVAL") != "0":
            ingest.wait_for(lambda: ingest.records("hardware"), 30, "a hardware sample")
        if env["SIDECAR_STATUS_ADDR"] != "off":
            wait_until(lambda: any(state.rglob(STATUS_ADDR_FILE)), 30, "the status address")
            address = next(state.rglob(STATUS_ADDR_FILE)).read_text().strip()
            direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with direct.open(f"http://{address}/healthz", timeout=10) as response:
                assert response.status == 200

    return _daemon_loaded(tmp_path, ["watch", "--log", str(log)], env, running, stop=True)


def _daemon_loaded(tmp_path: Path, args: list[str], env: dict[str, str],
                   running: Callable[[], None], *, stop: bool) -> dict[str, list[str]]:
    """The modules `sidecar ARGS` had loaded at its exit, and the dataclasses its sidecar
    modules define: `running` is called while it runs, then it is stopped (`stop`, a watch) or
    waited for (a run)."""
    modules = tmp_path / "modules.json"
    proc = subprocess.Popen([sys.executable, "-c", DAEMON_THEN_LIST_MODULES, str(modules),
                             *args], env=env, cwd=tmp_path, stderr=subprocess.PIPE)
    try:
        running()
    finally:
        if stop:
            proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode(errors="replace")
    loaded: dict[str, list[str]] = json.loads(modules.read_text())
    assert "sidecar.delivery.transport" in loaded["modules"]  # the running daemon's modules
    return loaded


def test_a_watch_generates_no_dataclass_methods(ingest: RunningIngest, tmp_path: Path) -> None:
    """A dataclass's __init__, __repr__ and __eq__ are generated, compiled and run at every
    import: the daemon's classes were a tenth of a watch's start-up instructions (issue 17).
    Its classes are plain, with their methods in the .pyc, and Config a NamedTuple; here with
    the status endpoint and hardware sampling off (as measured)."""
    made = _watch_loaded(ingest, tmp_path, SIDECAR_HARDWARE_INTERVAL="0",
                         SIDECAR_STATUS_ADDR="off")["dataclasses"]
    assert made == [], f"dataclasses on a watch's start path: {made}"


def _nvml_stub(tmp_path: Path, library_dir: Path) -> dict[str, str]:
    """The variables that put the stand-in libnvidia-ml.so.1 (two GPUs) in a daemon's way."""
    script = tmp_path / "nvml-script.txt"
    script.write_text("".join(f"{k} {v}\n" for k, v in TWO_GPUS.items()))
    return {"NVML_STUB_SCRIPT": str(script), "LD_LIBRARY_PATH": str(library_dir)}


def test_a_default_watch_generates_no_dataclass_methods(
        ingest: RunningIngest, tmp_path: Path, stub_dir: Path) -> None:  # noqa: F811
    """As users run it: the status endpoint on (its snapshots), hardware sampling at its
    default interval, with GPUs (the sampler's, NVML's and the XID watcher's records)."""
    loaded = _watch_loaded(ingest, tmp_path, SIDECAR_STATUS_ADDR="127.0.0.1:0",
                           **_nvml_stub(tmp_path, stub_dir))
    assert {"sidecar.observe.endpoint", "sidecar.sources.telemetry.sampler",
            "sidecar.sources.telemetry.nvml"} <= set(loaded["modules"])
    made = loaded["dataclasses"]
    assert made == [], f"dataclasses on a watch's start path: {made}"


WAITS_FOR_A_FILE = """
import os, sys, time
print("one line", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def test_a_run_generates_no_dataclass_methods(ingest: RunningIngest, tmp_path: Path,
                                              stub_dir: Path) -> None:  # noqa: F811
    """`run` adds the wrapper's classes: the child, its pumps, the failure signatures, the
    cgroup's OOM kills, the diagnosis; defaults as in the watch above."""
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_STATUS_ADDR="127.0.0.1:0",
                       **_nvml_stub(tmp_path, stub_dir))

    def running() -> None:
        ingest.wait_for(lambda: ingest.records("logs"), 30, "the child's line")
        ingest.wait_for(lambda: ingest.records("hardware"), 30, "a hardware sample")
        go.touch()

    loaded = _daemon_loaded(tmp_path, ["run", "--", *python_child(WAITS_FOR_A_FILE), str(go)],
                            env, running, stop=False)
    assert {"sidecar.wrapper", "sidecar.sources.console.child",
            "sidecar.sources.console.signatures", "sidecar.diagnose",
            "sidecar.sources.telemetry.cgroup",
            "sidecar.sources.telemetry.nvml"} <= set(loaded["modules"])
    made = loaded["dataclasses"]
    assert made == [], f"dataclasses on a run's start path: {made}"


def _aiohttp(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m.split(".")[0] == "aiohttp"}


def test_watch_without_a_status_endpoint_loads_no_http_server(ingest: RunningIngest,
                                                              tmp_path: Path) -> None:
    """--status-addr off: no HTTP server code is imported, and no aiohttp at all."""
    loaded = _watch_modules(ingest, tmp_path, "off")
    assert "sidecar.observe.endpoint" not in loaded
    # nor does it carry the wrapper's code: the child, its failure signatures, the diagnosis
    assert not {"sidecar.wrapper", "sidecar.sources.console.child",
                "sidecar.sources.console.signatures", "sidecar.diagnose",
                "sidecar.sources.telemetry.cgroup"} & loaded
    # --hardware-interval 0: no sampler code
    assert "sidecar.sources.telemetry.sampler" not in loaded
    # argparse's terminal width, `run`'s trainer-python search, a typo's suggestion, a test's
    # injected fault: each is had without a module that costs a start-up more than it answers
    unasked = {"shutil", "difflib", "random"} & loaded
    assert not unasked, sorted(unasked)
    if not _has_real_nvml():  # nor NVML's, where its library does not load
        assert "sidecar.sources.telemetry.nvml" not in loaded
    # The ingest client is h11 on asyncio streams: aiohttp (13 MB, a third of the start-up)
    # is for `sidecar receive` alone.
    assert not _aiohttp(loaded)


def test_watch_with_a_status_endpoint_loads_no_aiohttp(ingest: RunningIngest,
                                                       tmp_path: Path) -> None:
    """The endpoint is h11 over asyncio streams too: aiohttp's server side (2 MB and a share
    of the start-up, issue 17) is not imported, even once the endpoint answered."""
    loaded = _watch_modules(ingest, tmp_path, "127.0.0.1:0")
    assert {"sidecar.observe.endpoint", "h11"} <= loaded
    assert not _aiohttp(loaded)


def test_no_module_a_daemon_may_load_defines_a_dataclass() -> None:
    """The start paths above, and every other module a `run` or `watch` can come to load (a
    TensorBoard source, `sidecar check`'s and `receive`'s own commands aside): a new dataclass
    there would cost every start again."""
    import dataclasses
    import importlib
    import inspect
    import pkgutil

    import sidecar

    found = []
    for module_info in pkgutil.walk_packages(sidecar.__path__, "sidecar."):
        if module_info.name.startswith(("sidecar.commands.", "sidecar.examples")) or \
                module_info.name == "sidecar.__main__":  # which would run a command
            continue
        module = importlib.import_module(module_info.name)
        found += [f"{module.__name__}.{name}" for name, value in vars(module).items()
                  if inspect.isclass(value) and value.__module__ == module.__name__
                  and dataclasses.is_dataclass(value)]
    assert found == [], f"dataclasses a daemon may load: {found}"
