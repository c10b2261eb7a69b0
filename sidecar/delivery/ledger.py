"""An append-only ledger of JSON records in the state folder, each fsynced before it counts:
what checkpoint uploads (delivery/upload.py) write as each file is held, stored, registered.

Records appended while one is being written go together, under one fsync: a checkpoint of many
small files, four of them sent at once, wrote one fsync a file.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from sidecar.log import state_write_failed
from sidecar.statefile import open_checked, read_state


class JsonLedger:
    """The ledger at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._unwritten: list[bytes] = []
        self._writing = asyncio.Lock()

    async def append(self, record: dict[str, Any]) -> None:
        """Append `record`, fsynced, before returning. Whoever holds the lock writes every
        record waiting, so one fsync commits what the tasks appending meanwhile gave."""
        self._unwritten.append(_line(record))
        async with self._writing:
            if not self._unwritten:
                return  # an earlier holder wrote it
            lines, self._unwritten = self._unwritten, []
            await asyncio.to_thread(self._write, b"".join(lines))

    def append_blocking(self, record: dict[str, Any]) -> None:
        """`append` from a thread."""
        self._write(_line(record))

    def read(self) -> list[dict[str, Any]]:
        """Blocking: the records, checked as a state file is; a line torn by a crash, or not
        JSON, is left out."""
        try:
            data = read_state(self.path) or b""
        except OSError:
            return []
        records = []
        for line in data.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def _write(self, lines: bytes) -> None:
        try:
            fd = open_checked(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                view = memoryview(lines)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk: the caller goes on, a restart may repeat it
            state_write_failed(self.path, exc)


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=True).encode() + b"\n"
