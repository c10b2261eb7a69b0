"""The environment snapshot: the trainer's packages read (never imported) from its interpreter's
folders, the host facts, and which node posts what (docs/ingest.md#nodes-and-ranks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from sidecar.node import Node, node_count, resolve_node
from sidecar.sources.telemetry import environment
from sidecar.sources.telemetry.environment import (
    environment_snapshot,
    find_python,
    host_facts,
    infiniband_devices,
    kubernetes_info,
    post_environment,
    python_info,
    read_packages,
    which_python,
)
from sidecar.sources.telemetry.nvml import bindings
from tests.conftest import platform_env, sidecar
from tests.ingest_server import RunningIngest


def dist_info(site: Path, name: str, version: str, metadata: bool = True) -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    if metadata:
        (folder / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n\n"
            "Version: 0.0.0 in the long description is not a header\n")


def _psutil_network() -> dict[str, tuple[bool, int, int | None, set[str]]]:
    """The interfaces as psutil sees them: the oracle for what sysfs and /proc give."""
    stats, addresses = psutil.net_if_stats(), psutil.net_if_addrs()
    return {name: (stat.isup, stat.mtu, stat.speed or None,
                   {a.address for a in addresses.get(name, [])
                    if a.family in (socket.AF_INET, socket.AF_INET6)})
            for name, stat in stats.items() if "loopback" not in stat.flags.split(",")}


def _network(facts: dict[str, Any]) -> dict[str, tuple[bool, int, int | None, set[str]]]:
    return {i["name"]: (i["up"], i["mtu"], i["speed_mbps"], set(i["addresses"]))
            for i in facts["network"]}


def test_host_facts_read_from_sysfs_and_proc_are_psutils() -> None:
    facts = host_facts()
    assert facts["cpu"]["logical_cores"] == psutil.cpu_count()
    assert facts["cpu"]["physical_cores"] == psutil.cpu_count(logical=False)
    assert facts["memory_total_bytes"] == psutil.virtual_memory().total
    assert _network(facts) == _psutil_network()


def test_host_facts_fall_back_to_psutil_where_sysfs_and_proc_say_nothing(tmp_path: Path) -> None:
    facts = host_facts(sysfs_root=tmp_path, proc_root=tmp_path)
    assert facts["cpu"]["physical_cores"] == psutil.cpu_count(logical=False)
    assert facts["memory_total_bytes"] == psutil.virtual_memory().total
    assert _network(facts) == _psutil_network()


def test_host_facts_do_not_load_psutil() -> None:
    """psutil's import was a twentieth of `sidecar watch`'s start-up, for three numbers."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from sidecar.sources.telemetry import environment; "
         "environment.host_facts(); print('psutil' in sys.modules)"],
        capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_the_snapshot_tries_the_library_nvml_loads_and_waits_as_long() -> None:
    """The snapshot tries NVML's library itself, so that nvml/ loads only where it is there:
    both must name the same library and the same timeout."""
    assert (environment.NVML_LIBRARY, environment.NVML_TIMEOUT_S) == (
        bindings.LIBRARY, bindings.NVML_TIMEOUT_S)


def test_packages_read_from_dist_info_first_on_path_wins(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    dist_info(first, "torch", "2.3.1")
    dist_info(first, "nvidia-nccl-cu12", "2.20.5")
    dist_info(first, "broken", "1.0", metadata=False)  # no METADATA: the folder name tells
    dist_info(second, "Torch", "1.0.0")  # shadowed by the first path's, as at import
    dist_info(second, "numpy", "1.26.4")
    (second / "legacy.egg-info").mkdir()
    (second / "legacy.egg-info" / "PKG-INFO").write_text("Name: legacy\nVersion: 0.9\n")
    (second / "single-0.1.egg-info").write_text("Metadata-Version: 1.0\nName: single\n"
                                                "Version: 0.1\n")
    (second / "not_a_package").mkdir()
    packages = read_packages([first, tmp_path / "missing", second])
    assert packages == {"broken": "1.0", "legacy": "0.9", "numpy": "1.26.4",
                        "nvidia-nccl-cu12": "2.20.5", "single": "0.1", "torch": "2.3.1"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real virtualenv (no pip) with two fake distributions installed in it."""
    root = tmp_path_factory.mktemp("trainer") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (site,) = root.glob("lib/python3*/site-packages")
    dist_info(site, "trainer-lib", "4.2.0")
    dist_info(site, "flash-attn", "2.5.8")
    return root


def test_find_python_order(tmp_path: Path, venv: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "python3.11"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    path_env = {"PATH": str(bin_dir)}
    explicit = Path("/opt/custom/python")
    assert find_python(explicit, [], {"VIRTUAL_ENV": str(venv)}) == explicit
    assert find_python(None, [], {"VIRTUAL_ENV": str(venv), **path_env}) == venv / "bin" / "python"
    assert find_python(None, ["python3.11", "train.py"], path_env) == bin_dir / "python3.11"
    assert find_python(None, ["./train.sh"], path_env) == bin_dir / "python3"
    assert find_python(None, [], {"PATH": str(tmp_path / "empty")}) is None


async def test_snapshot_lists_the_trainers_venv_packages(venv: Path, tmp_path: Path) -> None:
    child_env = {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{os.defpath}"}
    environ = {"POD_NAME": "train-0", "POD_NAMESPACE": "ml", "NODE_NAME": "gpu-node-7"}
    snapshot = await environment_snapshot(
        run_id="run-1", node=Node("gpu-node-7", 0, nodes=2), python=None, child_env=child_env,
        environ=environ, sysfs_root=tmp_path / "sys")
    assert snapshot["packages"] == {"flash-attn": "2.5.8", "trainer-lib": "4.2.0"}
    assert snapshot["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert snapshot["python"]["prefix"] == str(venv)
    assert "pytest" not in snapshot["packages"]  # the sidecar's own packages are not the trainer's
    assert (snapshot["run_id"], snapshot["node"], snapshot["rank"], snapshot["nodes"]) == (
        "run-1", "gpu-node-7", 0, 2)
    assert snapshot["kubernetes"] == {"pod": "train-0", "namespace": "ml", "node": "gpu-node-7"}
    assert snapshot["memory_total_bytes"] > 0 and snapshot["cpu"]["logical_cores"] >= 1
    assert snapshot["os"]["kernel"] == os.uname().release


async def test_watch_mode_lists_packages_only_of_the_named_python(venv: Path) -> None:
    environ = {"PATH": f"{venv / 'bin'}:{os.defpath}"}  # the sidecar's own, not the trainer's
    for python in (None, venv / "bin" / "python"):
        snapshot = await environment_snapshot(run_id="run-1", node=Node("n", 0), python=python,
                                              child_env=environ, environ=environ,
                                              find_trainer_python=False)
        if python is None:
            assert "packages" not in snapshot and "python" not in snapshot
        else:
            assert snapshot["packages"] == {"flash-attn": "2.5.8", "trainer-lib": "4.2.0"}


async def test_an_interpreter_that_will_not_answer_is_read_from_its_folders(
        tmp_path: Path) -> None:
    prefix = tmp_path / "env"
    site = prefix / "lib" / "python3.10" / "site-packages"
    dist_info(site, "jax", "0.4.30")
    python = prefix / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexec sleep 30\n")
    python.chmod(0o755)
    info = await python_info(python, {"PATH": os.defpath}, timeout_s=0.3)
    assert info.version == "3.10" and info.paths == (site,)
    assert read_packages(info.paths) == {"jax": "0.4.30"}
    python.write_text("#!/bin/sh\nexit 3\n")
    assert (await python_info(python, {}, timeout_s=5)).paths == (site,)


def test_infiniband_devices_from_sysfs(tmp_path: Path) -> None:
    device = tmp_path / "class" / "infiniband" / "mlx5_0"
    port = device / "ports" / "1"
    port.mkdir(parents=True)
    (device / "fw_ver").write_text("28.39.1002\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    assert infiniband_devices(tmp_path) == [{
        "device": "mlx5_0", "firmware": "28.39.1002",
        "ports": [{"port": "1", "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)",
                   "link_layer": "InfiniBand"}]}]


def test_kubernetes_from_the_downward_api() -> None:
    assert kubernetes_info({}) is None
    assert kubernetes_info({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "job-abc"}) == {
        "pod": "job-abc"}
    assert kubernetes_info({"POD_NAME": "p", "POD_UID": "u-1"}) == {"pod": "p", "pod_uid": "u-1"}


# ---- node roles -----------------------------------------------------------------------------


@pytest.mark.parametrize(("environ", "nodes", "rank", "multi"), [
    ({}, None, 0, False),
    ({"NNODES": "4"}, None, 0, True),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "1"}, None, 1, True),
    ({"SLURM_NNODES": "1"}, None, 0, False),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, None, 0, True),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, None, 0, False),
    ({"WORLD_SIZE": "16"}, None, 0, False),  # without LOCAL_WORLD_SIZE it says nothing
    ({"JOB_COMPLETION_INDEX": "3"}, None, 3, True),  # a rank above 0 is multi-node
    ({"NODE_RANK": "x", "GROUP_RANK": "2"}, None, 2, True),
    ({"NNODES": "4"}, 1, 0, False),  # --nodes wins
])
def test_node_roles(environ: dict[str, str], nodes: int | None, rank: int, multi: bool) -> None:
    node = resolve_node("n", environ, nodes)
    assert (node.rank, node.multi_node) == (rank, multi)
    assert node.reports_lifecycle == node.reports_environment == (rank == 0)


def test_node_count_sources() -> None:
    assert node_count({"NNODES": "2", "SLURM_NNODES": "8"}) == 2
    assert node_count({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert node_count({"NNODES": "0"}) is None


@pytest.mark.parametrize(("node", "routes"), [
    (Node("a", 0), ["environment"]),
    (Node("a", 0, nodes=2), ["environment", "environment/nodes"]),
    (Node("b", 1, nodes=2), ["environment/nodes"]),
    (Node("c", 2), ["environment/nodes"]),
])
async def test_who_posts_the_environment(node: Node, routes: list[str], tmp_path: Path) -> None:
    emitted: list[tuple[str, dict[str, Any]]] = []
    await post_environment(emit=lambda r, p: emitted.append((r, p)), run_id="run-1", node=node,
                           python=Path(sys.executable), child_env={}, environ={})
    assert [route for route, _ in emitted] == routes
    for route, payload in emitted:
        assert payload["run_id"] == "run-1"
        if route == "environment/nodes":
            (entry,) = payload["nodes"]
            assert (entry["node"], entry["rank"]) == (node.name, node.rank)
            assert "run_id" not in entry and "packages" in entry


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("how", ["shebang", "env-shebang", "program", "path"])
def test_the_snapshot_describes_the_trainers_python_with_the_sidecars_venv_active(
        ingest: RunningIngest, tmp_path: Path, venv: Path, how: str) -> None:
    """The real `sidecar run`, its own virtualenv active as the README's set-up leaves it
    (VIRTUAL_ENV and PATH name it, the child inherits both): the trainer's interpreter is
    the one the command runs, never the sidecar's (its packages were listed)."""
    trainer = venv / "bin" / "python"
    own_bin = Path(sys.prefix) / "bin"
    path = f"{own_bin}:{venv / 'bin'}:{os.defpath}"
    commands = {
        "shebang": [str(_script(tmp_path / "train.py", f"#!{trainer}\nprint('hi')\n"))],
        "env-shebang": [str(_script(tmp_path / "env_train.py", "#!/usr/bin/env python3\n"
                                    "print('hi')\n"))],
        "program": [str(trainer), "-c", "print('hi')"],
        "path": [str(_script(tmp_path / "train.sh", "#!/bin/sh\necho hi\n"))],
    }
    # `#!/usr/bin/env python3` finds the sidecar's own first on this PATH: the trainer's is
    # first where the command's own PATH puts it
    env_path = f"{venv / 'bin'}:{own_bin}:{os.defpath}" if how == "env-shebang" else path
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0",
                       VIRTUAL_ENV=sys.prefix, PATH=env_path)
    done = sidecar(["run", "--", *commands[how]], env, tmp_path / "run")
    assert done.status == 0, done.stderr.decode()[-3000:]
    [snapshot] = ingest.records("environment")
    assert Path(snapshot["python"]["executable"]).parent == venv / "bin", snapshot["python"]
    assert snapshot["packages"] == {"flash-attn": "2.5.8", "trainer-lib": "4.2.0"}


def test_which_python_never_guesses_the_sidecars_own_environment(tmp_path: Path) -> None:
    own = tmp_path / "sidecar-venv"
    (own / "bin").mkdir(parents=True)
    _script(own / "bin" / "python", "#!/bin/sh\n")
    other = tmp_path / "usr" / "bin"
    other.mkdir(parents=True)
    _script(other / "python3", "#!/bin/sh\n")
    env = {"VIRTUAL_ENV": str(own), "PATH": f"{own / 'bin'}:{other}"}
    assert which_python(None, ["./train.sh"], env, own=[str(own)]) == (
        other / "python3", "python3 on the child's PATH")
    launcher = _script(tmp_path / "torchrun", f"#!/bin/sh\n'''exec' {other / 'python3'} "
                       '"$0" "$@"\n' "' '''\n")
    assert which_python(None, [str(launcher)], env, own=[str(own)]) == (
        other / "python3", f"the #! line of {launcher}")
    assert which_python(None, ["env", "A=1", str(own / "bin" / "python"), "x.py"], env,
                        own=[str(own)])[0] == own / "bin" / "python"  # the command's own wins
