"""The container image's HEALTHCHECK: does the sidecar's status endpoint answer /healthz?

It probes the address the daemon bound, as written to <state-dir>/<run>/status-addr (an
ephemeral port when the default one was busy, a --status-addr given on the command line), then
the configured one (SIDECAR_STATUS_ADDR, else 127.0.0.1:9620), a wildcard host as loopback, never
through a proxy. With the endpoint turned off (SIDECAR_STATUS_ADDR=off, or --status-addr off in
the daemon's command line) there is nothing to probe: healthy, as long as the container runs.
Exit 0 healthy, 1 not; one line says what was found. Standard library only: it starts in a few
tens of milliseconds, every 30 s.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_ADDR = "127.0.0.1:9620"
ADDR_FILE = "status-addr"
TIMEOUT_S = 4.0  # under the HEALTHCHECK's --timeout=5s
DAEMON_CMDLINE = Path("/proc/1/cmdline")  # in the container, PID 1 is the sidecar
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def status_addr_flag(argv: Sequence[str]) -> str | None:
    """The value of the last --status-addr in a command line, or None."""
    found = None
    for index, arg in enumerate(argv):
        if arg == "--status-addr" and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith("--status-addr="):
            found = arg.split("=", 1)[1]
    return found


def configured_addr(environ: Mapping[str, str], cmdline: Path = DAEMON_CMDLINE) -> str:
    """The daemon's --status-addr: its command line's, else the environment's, else the
    default."""
    try:
        argv = cmdline.read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    return status_addr_flag(argv) or environ.get("SIDECAR_STATUS_ADDR") or DEFAULT_ADDR


def candidates(environ: Mapping[str, str], configured: str) -> list[str]:
    """Bound addresses from the state dir, newest first, then the configured one."""
    state = Path(environ.get("SIDECAR_STATE_DIR", "/var/lib/sidecar"))
    files = [*state.glob(f"*/{ADDR_FILE}"), *state.glob(f"*/*/{ADDR_FILE}")]
    files.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0.0, reverse=True)
    found = []
    for path in files:
        try:
            found.append(path.read_text().strip())
        except OSError:
            continue
    return list(dict.fromkeys(a for a in (*found, configured) if a and a != "off"))


def url(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    host = _LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}/healthz" if ":" in host else f"http://{host}:{port}/healthz"


def main(environ: Mapping[str, str] = os.environ) -> int:
    configured = configured_addr(environ)
    if configured == "off":
        print("sidecar status endpoint is off: nothing to probe")
        return 0
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    tried = []
    for addr in candidates(environ, configured):
        try:
            with direct.open(url(addr), timeout=TIMEOUT_S) as answer:
                if answer.status == 200:
                    print(f"sidecar answers at {addr}")
                    return 0
                tried.append(f"{addr} (HTTP {answer.status})")
        except (OSError, ValueError) as exc:
            tried.append(f"{addr} ({getattr(exc, 'reason', exc)})")
    print("sidecar status endpoint does not answer: " + "; ".join(tried))
    return 1


if __name__ == "__main__":
    sys.exit(main())
