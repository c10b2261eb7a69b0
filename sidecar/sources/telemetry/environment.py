"""The environment snapshot, once per run: /environment from rank 0, /environment/nodes from
every node of a multi-node run (docs/ingest.md#nodes-and-ranks).

What it holds: host name, node and rank, OS and kernel, CPU model and count, memory, NICs and
InfiniBand devices, the NVIDIA driver and the CUDA version it supports, GPU models, UUIDs and
memory, the Kubernetes pod (downward API) and Slurm job when there is one, and the trainer's
Python with its installed packages.

The trainer's packages are read, never imported: the interpreter the child would run (--python,
else the command's program or its #! line, else the child's VIRTUAL_ENV, CONDA_PREFIX and PATH,
never the sidecar's own environment: which_python) is asked for its sys.path once, in a
subprocess with the child's environment and a timeout, and each `*.dist-info/METADATA` (or
`*.egg-info`) found there gives a Name and a Version. If that interpreter cannot be run, its
prefix's lib/python3*/site-packages is read.

Kubernetes: POD_NAME, POD_NAMESPACE, POD_UID and NODE_NAME, as a pod spec maps them from the
downward API (`fieldRef: metadata.name`, `metadata.namespace`, `metadata.uid`,
`spec.nodeName`); without POD_NAME in a pod, the hostname, which is the pod's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import platform
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from sidecar import __version__
from sidecar.log import log
from sidecar.node import Node
from sidecar.records import iso_ts
from sidecar.sources.telemetry import procfs
from sidecar.threads import off_loop

Emit = Callable[[str, dict[str, Any]], None]

PYTHON_PROBE_TIMEOUT_S = 10.0  # a trainer image's interpreter starting cold, .pth files and all
READ_TIMEOUT_S = 20.0  # host facts and package metadata, read on a thread
NVML_LIBRARY = "libnvidia-ml.so.1"  # bindings.LIBRARY, tried first: nvml/ loads only where it does
IPV6_SCOPE_LINK = 0x20  # /proc/net/if_inet6's scope of a link-local address
NVML_TIMEOUT_S = 5.0  # bindings.NVML_TIMEOUT_S: the driver's description, as long as one GPU's read
MAX_HEADER_LINES = 200  # Name and Version come first in METADATA; never read a long description
_PROBE = ("import sys, json, platform; print(json.dumps({'path': sys.path, "
          "'version': platform.python_version(), "
          "'implementation': platform.python_implementation(), "
          "'executable': sys.executable, 'prefix': sys.prefix}))")
_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
_KUBERNETES = (("pod", "POD_NAME"), ("namespace", "POD_NAMESPACE"), ("pod_uid", "POD_UID"),
               ("node", "NODE_NAME"))
_SLURM = (("job_id", "SLURM_JOB_ID"), ("job_name", "SLURM_JOB_NAME"),
          ("nodelist", "SLURM_JOB_NODELIST"), ("partition", "SLURM_JOB_PARTITION"))


async def post_environment(*, emit: Emit, run_id: str, node: Node, python: Path | None,
                           child_env: Mapping[str, str], environ: Mapping[str, str],
                           command: Sequence[str] = (), find_trainer_python: bool = True) -> None:
    """Take the snapshot and emit it: /environment on rank 0, and this node's
    /environment/nodes entry on every node of a multi-node run (rank 0 included)."""
    snapshot = await environment_snapshot(run_id=run_id, node=node, python=python,
                                          child_env=child_env, environ=environ, command=command,
                                          find_trainer_python=find_trainer_python)
    if node.reports_environment:
        emit("environment", snapshot)
    if node.multi_node:
        entry = {k: v for k, v in snapshot.items() if k != "run_id"}
        emit("environment/nodes", {"run_id": run_id, "nodes": [entry]})


async def environment_snapshot(*, run_id: str, node: Node, python: Path | None,
                               child_env: Mapping[str, str], environ: Mapping[str, str],
                               command: Sequence[str] = (), find_trainer_python: bool = True,
                               sysfs_root: Path = Path("/sys")) -> dict[str, Any]:
    """This node's snapshot as one JSON object carrying `run_id`; what cannot be read is absent.

    `find_trainer_python` False (`watch`: the trainer runs elsewhere, its PATH is not ours)
    takes the trainer's interpreter from `python` alone.
    """
    snapshot: dict[str, Any] = {"run_id": run_id, "node": node.name, "rank": node.rank}
    if node.nodes is not None:
        snapshot["nodes"] = node.nodes
    snapshot["captured_at"] = iso_ts(time.time())
    snapshot["sidecar_version"] = __version__
    snapshot.update(await _off_loop(lambda: host_facts(sysfs_root), "host facts") or {})
    nvidia = await _off_loop(_nvidia_info, "NVIDIA driver", NVML_TIMEOUT_S)
    if nvidia:
        snapshot["nvidia"] = {k: v for k, v in nvidia.items() if k != "gpus"}
        snapshot["gpus"] = nvidia.get("gpus", [])
    interpreter = find_python(python, command, child_env) if find_trainer_python else python
    if interpreter is None:
        log.info("environment snapshot: the trainer's Python is unknown, its packages are not "
                 "listed; --python names it")
    else:
        info = await python_info(interpreter, child_env)
        snapshot["packages"] = await _off_loop(lambda: read_packages(info.paths),
                                               "packages") or {}
        snapshot["python"] = info.describe()
    for key, value in (("kubernetes", kubernetes_info(environ)), ("slurm", slurm_info(environ))):
        if value:
            snapshot[key] = value
    return snapshot


async def _off_loop(fn: Callable[[], Any], what: str,
                    timeout_s: float = READ_TIMEOUT_S) -> Any:
    """fn() on a thread; None (and one line saying why) when it fails or hangs."""
    try:
        return await off_loop(fn, timeout_s, f"environment-{what}")
    except TimeoutError:
        log.warning("environment snapshot: %s did not answer within %g s; left out",
                    what, timeout_s)
    except Exception as exc:
        log.warning("environment snapshot: %s could not be read: %s", what, exc)
    return None


def _nvidia_info() -> dict[str, Any] | None:
    """The driver and its GPUs as NVML describes them; None on a node whose NVML library does
    not load, found without loading nvml/ (a thousand lines a node without GPUs never runs)."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None
    from sidecar.sources.telemetry.nvml import bindings, info

    try:
        return info.nvidia_info()
    except bindings.NvmlError as exc:  # the sampler says so at INFO; once is enough
        log.debug("environment snapshot: no NVIDIA driver information: %s", exc.reason())
        return None


@contextlib.contextmanager
def _noted(what: str) -> Iterator[None]:
    """A block whose failure is logged at DEBUG and leaves its value out."""
    try:
        yield
    except Exception as exc:
        log.debug("environment snapshot: %s unavailable: %s", what, exc)


# ---- the trainer's Python -------------------------------------------------------------------


def find_python(explicit: Path | None, command: Sequence[str],
                child_env: Mapping[str, str]) -> Path | None:
    """The interpreter the child runs (see which_python)."""
    return which_python(explicit, command, child_env)[0]


def which_python(explicit: Path | None, command: Sequence[str], child_env: Mapping[str, str],
                 own: Sequence[str] | None = None) -> tuple[Path | None, str]:
    """The interpreter the child runs, and how it was found: --python; the command's program
    when it is a Python; the interpreter its `#!` line names (a script, torchrun's,
    accelerate's, deepspeed's); the venv or conda env the child's variables activate; python3
    or python on the child's PATH. The guesses (the last two) never take the sidecar's own
    environment, `own` (its sys.prefix and the VIRTUAL_ENV it was started with), which the
    child inherits when the sidecar's virtualenv is active."""
    if explicit is not None:
        return explicit, "--python"
    import shutil  # here: shutil (with bz2 and lzma) is 3 % of a start-up `watch` never needs

    own = _own_prefixes() if own is None else own
    path = child_env.get("PATH", os.defpath)
    program = _program(command)
    found = shutil.which(program, path=path) if program else None
    if found and _PYTHON_NAME.match(Path(program).name):
        return Path(found), f"the command's program, {program}"
    interpreter = _shebang_python(Path(found), path) if found else None
    if interpreter is not None:
        return interpreter, f"the #! line of {found}"
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        prefix = child_env.get(var)
        if prefix and not _inside(Path(prefix), own):
            candidate = Path(prefix) / "bin" / "python"
            if os.access(candidate, os.X_OK):
                return candidate, f"the child's {var}"
    for folder in path.split(os.pathsep):
        if not folder or _inside(Path(folder), own):
            continue
        for name in ("python3", "python"):
            found = shutil.which(name, path=folder)
            if found:
                return Path(found), f"{name} on the child's PATH"
    return None, "none found"


def _own_prefixes() -> list[str]:
    import sys

    return [p for p in (sys.prefix, os.environ.get("VIRTUAL_ENV", "")) if p]


def _inside(path: Path, prefixes: Sequence[str]) -> bool:
    return any(path == Path(p) or Path(p) in path.parents for p in prefixes)


def _program(command: Sequence[str]) -> str:
    """The program `command` runs, through `env [-i] [NAME=VALUE]...` when it starts so."""
    args = _past_env(command)
    return args[0] if args else ""


def _past_env(words: Sequence[str]) -> list[str]:
    """`words` without a leading `env` and its options and assignments."""
    args = list(words)
    if args and Path(args[0]).name == "env":
        args = args[1:]
        while args and (args[0].startswith("-") or "=" in args[0]):
            args = args[1:]
    return args


_PIP_LAUNCHER = "'''exec' "  # pip's second line where a #! line would be too long


def _shebang_python(program: Path, path: str) -> Path | None:
    """The Python the `#!` line of `program` names: `#!/venv/bin/python3`, `#!/usr/bin/env
    python3` (found on `path`), or pip's launcher for a long path (`#!/bin/sh`, then
    _PIP_LAUNCHER and the interpreter); None for a binary or another interpreter."""
    import shlex
    import shutil

    try:
        with open(program, "rb") as fh:
            head = fh.read(1024)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    lines = head.decode("utf-8", "replace").splitlines()
    words = lines[0][2:].split()
    if len(lines) > 1 and lines[1].startswith(_PIP_LAUNCHER):
        with contextlib.suppress(ValueError):
            words = shlex.split(lines[1].removeprefix(_PIP_LAUNCHER))[:1]
    if words and Path(words[0]).name == "env":  # `#!/usr/bin/env [-S] python3`: on `path`
        words = _past_env(words)
        found = shutil.which(words[0], path=path) if words else None
        words = [found] if found else []
    if words and _PYTHON_NAME.match(Path(words[0]).name) and os.access(words[0], os.X_OK):
        return Path(words[0])
    return None


class PythonInfo(NamedTuple):
    """The trainer's interpreter as it describes itself (or as its folders suggest)."""

    executable: Path
    paths: tuple[Path, ...]
    version: str | None = None
    implementation: str | None = None
    prefix: str | None = None

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"executable": str(self.executable)}
        for key in ("version", "implementation", "prefix"):
            if getattr(self, key) is not None:
                info[key] = getattr(self, key)
        return info


async def python_info(python: Path, child_env: Mapping[str, str],
                      timeout_s: float = PYTHON_PROBE_TIMEOUT_S) -> PythonInfo:
    """Ask `python` for its sys.path with the child's environment; else guess from its prefix."""
    try:
        proc = await asyncio.create_subprocess_exec(
            str(python), "-c", _PROBE, env=dict(child_env), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except OSError as exc:
        log.info("environment snapshot: cannot run %s (%s); reading its folders instead",
                 python, exc.strerror or exc)
        return _guess_python(python)
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: see sidecar.aio
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.info("environment snapshot: %s did not answer within %g s; reading its folders "
                 "instead", python, timeout_s)
        return _guess_python(python)
    try:
        lines = out.decode(errors="replace").strip().splitlines()
        described = json.loads(lines[-1])
        return PythonInfo(
            executable=Path(described["executable"] or python),
            paths=tuple(Path(p) for p in described["path"] if p),
            version=described.get("version"), implementation=described.get("implementation"),
            prefix=described.get("prefix"))
    except (ValueError, KeyError, IndexError, TypeError):
        log.info("environment snapshot: %s exited %s without describing itself; reading its "
                 "folders instead", python, proc.returncode)
        return _guess_python(python)


def _guess_python(python: Path) -> PythonInfo:
    """site-packages under the interpreter's prefix (bin/..), the version from its folder."""
    prefix = python.parent.parent
    found = sorted(p for pattern in ("lib/python3*/site-packages", "lib64/python3*/site-packages")
                   for p in prefix.glob(pattern))
    version = found[0].parent.name.removeprefix("python") if found else None
    return PythonInfo(executable=python, paths=tuple(found), version=version,
                      prefix=str(prefix))


def read_packages(paths: Iterable[Path]) -> dict[str, str]:
    """Installed distributions as {Name: Version}; the first on the path wins, as at import."""
    found: dict[str, tuple[str, str]] = {}
    for folder in paths:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            meta = _metadata_of(Path(entry.path))
            if meta is not None:
                found.setdefault(_normalise(meta[0]), meta)
    return dict(sorted(found.values(), key=lambda nv: nv[0].lower()))


def _metadata_of(path: Path) -> tuple[str, str] | None:
    if path.name.endswith(".dist-info"):
        headers = path / "METADATA"
    elif path.name.endswith(".egg-info"):
        headers = path / "PKG-INFO" if path.is_dir() else path
    else:
        return None
    fields = _headers(headers)
    name, version = fields.get("name"), fields.get("version")
    if name and version:
        return name, version
    stem = path.name.rsplit(".", 1)[0]  # name-version.dist-info, when METADATA is unreadable
    parts = stem.split("-")
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def _headers(path: Path) -> dict[str, str]:
    """The Name and Version headers of a METADATA/PKG-INFO file (RFC 822 style)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for _, line in zip(range(MAX_HEADER_LINES), fh, strict=False):
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                if sep and key.lower() in ("name", "version"):
                    fields.setdefault(key.lower(), value.strip())
                if len(fields) == 2:
                    break
    except OSError:
        pass
    return fields


def _normalise(name: str) -> str:
    """PEP 503: case and runs of -_. do not make two distributions different."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- the host -------------------------------------------------------------------------------


def host_facts(sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> dict[str, Any]:
    """Host name, OS, CPU, memory, network interfaces and InfiniBand devices.

    Read from sysfs and /proc as psutil would read them, and from psutil itself only where they
    cannot say: its import alone was a twentieth of the start-up."""
    facts: dict[str, Any] = {"hostname": socket.gethostname()}
    system = {"system": platform.system(), "kernel": platform.release(),
              "kernel_version": platform.version(), "machine": platform.machine()}
    with _noted("OS release"):
        system["distribution"] = platform.freedesktop_os_release()["PRETTY_NAME"]
    facts["os"] = system
    cpu: dict[str, Any] = {"logical_cores": os.cpu_count(),
                           "physical_cores": _physical_cores(sysfs_root)}
    model = _cpu_model()
    if model:
        cpu["model"] = model
    facts["cpu"] = {k: v for k, v in cpu.items() if v is not None}
    try:
        facts["memory_total_bytes"] = procfs.memory_total(str(proc_root))
    except OSError:
        facts["memory_total_bytes"] = procfs.psutil_module().virtual_memory().total
    with _noted("network interfaces"):
        facts["network"] = _interfaces(sysfs_root, proc_root)
    facts["infiniband"] = infiniband_devices(sysfs_root)
    return facts


def _physical_cores(sysfs_root: Path) -> int | None:
    """Distinct sibling sets among the CPUs' topologies, psutil's count on Linux."""
    cpus = sysfs_root / "devices" / "system" / "cpu"
    for name in ("core_cpus_list", "thread_siblings_list"):
        siblings = {_read_text(path) for path in cpus.glob(f"cpu[0-9]*/topology/{name}")}
        siblings.discard(None)
        if siblings:
            return len(siblings)
    return procfs.psutil_module().cpu_count(logical=False)  # type: ignore[no-any-return]


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return value.strip()
    return platform.processor() or None


def _interfaces(sysfs_root: Path, proc_root: Path) -> list[dict[str, Any]]:
    """Each network interface but loopback: up (running, as psutil says), MTU, speed and its IP
    addresses (IPv4 by procfs's ioctl, IPv6 from /proc/net/if_inet6)."""
    net = sysfs_root / "class" / "net"
    names = sorted(entry.name for entry in net.iterdir()) if net.is_dir() else []
    if not names:
        return _psutil_interfaces()
    ipv6 = _ipv6_addresses(proc_root)
    interfaces = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                flags = procfs.interface_flags(sock.fileno(), name)
            except OSError:  # gone since it was listed
                flags = 0
            if name == "lo" or flags & procfs.IFF_LOOPBACK:
                continue
            ipv4 = procfs.interface_ipv4(sock.fileno(), name)
            speed = _read_int(net / name / "speed")
            interfaces.append({
                "name": name, "up": bool(flags & procfs.IFF_RUNNING),
                "mtu": _read_int(net / name / "mtu") or 0,
                "speed_mbps": speed if speed is not None and speed > 0 else None,
                "addresses": ([ipv4] if ipv4 else []) + ipv6.get(name, []),
            })
    return interfaces


def _read_int(path: Path) -> int | None:
    """An integer file of sysfs; None where it is absent or unreadable (a virtual link's
    speed answers EINVAL)."""
    text = _read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _ipv6_addresses(proc_root: Path) -> dict[str, list[str]]:
    """/proc/net/if_inet6 by interface: link-local ones with their zone (`fe80::1%eth0`)."""
    found: dict[str, list[str]] = {}
    text = _read_text(proc_root / "net" / "if_inet6") or ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 6 or len(fields[0]) != 32:
            continue
        try:
            address = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
        except ValueError:
            continue
        if int(fields[3], 16) == IPV6_SCOPE_LINK:
            address += "%" + fields[5]
        found.setdefault(fields[5], []).append(address)
    return {name: sorted(addresses, key=lambda a: "%" in a)
            for name, addresses in found.items()}


def _psutil_interfaces() -> list[dict[str, Any]]:
    """The same as psutil sees them, where sysfs lists none."""
    psutil = procfs.psutil_module()
    stats = psutil.net_if_stats()
    addresses = psutil.net_if_addrs()
    interfaces = []
    for name in sorted(stats):
        if name == "lo" or "loopback" in getattr(stats[name], "flags", "").split(","):
            continue
        interfaces.append({
            "name": name, "up": stats[name].isup, "mtu": stats[name].mtu,
            "speed_mbps": stats[name].speed or None,
            "addresses": [a.address for a in addresses.get(name, [])
                          if a.family in (socket.AF_INET, socket.AF_INET6)],
        })
    return interfaces


def infiniband_devices(sysfs_root: Path) -> list[dict[str, Any]]:
    """Each <sysfs>/class/infiniband device: firmware, GUID and its ports' state and rate."""
    devices = []
    for device in sorted((sysfs_root / "class" / "infiniband").glob("*")):
        entry: dict[str, Any] = {"device": device.name}
        for key, filename in (("firmware", "fw_ver"), ("node_guid", "node_guid"),
                              ("board_id", "board_id")):
            value = _read_text(device / filename)
            if value:
                entry[key] = value
        entry["ports"] = [
            {"port": port.name, **{key: value for key, filename in (
                ("state", "state"), ("rate", "rate"), ("link_layer", "link_layer"))
                if (value := _read_text(port / filename))}}
            for port in sorted((device / "ports").glob("*"))]
        devices.append(entry)
    return devices


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip() or None
    except OSError:
        return None


def kubernetes_info(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The pod from the downward API variables; None outside Kubernetes."""
    info = {key: environ[var] for key, var in _KUBERNETES if environ.get(var)}
    if "pod" not in info and environ.get("KUBERNETES_SERVICE_HOST"):
        info["pod"] = environ.get("HOSTNAME") or socket.gethostname()
    return info if "pod" in info or "namespace" in info else None


def slurm_info(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The Slurm job, when the sidecar runs inside one."""
    info = {key: environ[var] for key, var in _SLURM if environ.get(var)}
    return info or None
