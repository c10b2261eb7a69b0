"""Where the status endpoint listens: the default address, the file in the run's state folder that
holds the one actually bound (read by `sidecar status` and `sidecar stacks`), and HOST:PORT read
from an option or that file."""

from __future__ import annotations

from sidecar.exits import ConfigError

DEFAULT_STATUS_ADDR = "127.0.0.1:9620"
STATUS_ADDR_FILE = "status-addr"  # in the run's state folder: the status address actually bound


def parse_host_port(addr: str, option: str) -> tuple[str, int]:
    """Split HOST:PORT, raising ConfigError naming `option` when it is malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{option}={addr!r} is not HOST:PORT (for example 127.0.0.1:9620) "
                          "or off")
    return host.strip("[]"), int(port)
