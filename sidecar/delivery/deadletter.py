"""Dead letters: a payload the ingest refused for good is kept in the run's folder, one JSON
line each, for a person to look at (docs/ingest.md#answers-and-what-the-sidecar-does-about-them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sidecar.log import state_write_failed
from sidecar.statefile import open_checked

FILE_NAME = "dead-letter.jsonl"


def dead_letter(run_dir: Path, route: str, status: int | None, body: bytes) -> Path | None:
    """Keep `body`, refused for good on `route` with HTTP `status`; returns the file it is kept
    in, or None when the state dir refused the write (said, once a minute for all such writes):
    a dead letter that cannot be kept never ends the sender that met it. Blocking."""
    path = run_dir / FILE_NAME
    line = json.dumps({"route": route, "status": status,
                       "body": body.decode("utf-8", "replace")}).encode() + b"\n"
    try:
        with open(open_checked(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as fh:
            fh.write(line)
    except OSError as exc:
        state_write_failed(path, exc)
        return None
    return path
