"""`--log` files -> /logs text: plain text, or Kubernetes CRI container logs (docs/ingest.md#logs).

A CRI line is `<RFC3339Nano> <stdout|stderr> <P|F> <text>`: `P` pieces are joined up to the
`F` that ends the line, and only the text is forwarded; pieces still waiting for their `F` are
part of the parser's state, saved with the offset past them, so a restart between `P` and
`F` loses nothing (past MAX_LINE_CHARS they are forwarded as a split line, which bounds that
state). `auto` decides on the first whole line.
Either way the text then takes the same path as a wrapped command's output (LineAssembler).
"""

from __future__ import annotations

import re
from typing import Any

from sidecar.sources.base import Parsed
from sidecar.sources.console.lines import MAX_LINE_CHARS, NO_SECRETS, LineAssembler, Masker

FIND_LINE_BYTES = 512  # lines at least this long on average are counted newline to newline

_CRI_LINE = re.compile(
    rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) (stdout|stderr) ([PF])"
    rb"(?: (.*))?$")


class LogFileParser:
    """Parses one log file; `log_format` is plain, cri or auto."""

    def __init__(self, log_format: str = "auto", secrets: Masker = NO_SECRETS, prefix: str = "",
                 keep_sgr: bool = False) -> None:
        self.log_format = log_format
        self._assembler = LineAssembler(secrets, prefix, keep_sgr=keep_sgr)
        self._partial: dict[bytes, list[bytes]] = {}  # CRI P pieces by stream

    @classmethod
    def resume(cls, state: dict[str, Any], **kwargs: Any) -> LogFileParser:
        parser = cls(**kwargs)
        if state.get("format") in ("plain", "cri"):
            parser.log_format = state["format"]
        partial = state.get("partial")
        if isinstance(partial, dict):
            parser._partial = {stream.encode("latin-1"): [text.encode("latin-1")]
                               for stream, text in partial.items()
                               if isinstance(stream, str) and isinstance(text, str)}
        return parser

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"format": self.log_format}
        if self._partial:  # bytes kept as latin-1 text: one character a byte, JSON-safe
            # masked: the line is masked again whole when its end comes
            state["partial"] = {stream.decode("latin-1"): bytes(self._assembler.secrets.mask_raw(
                b"".join(pieces), final=True)[0]).decode("latin-1")
                for stream, pieces in self._partial.items()}
        return state

    def parse(self, data: bytes, now: float) -> Parsed:
        end = data.rfind(b"\n") + 1
        if self.log_format == "auto" and end:
            first = data[: data.find(b"\n")]
            self.log_format = "cri" if _CRI_LINE.match(first) else "plain"
        if self.log_format == "cri":
            return self._cri(data[:end], now)
        if not end and len(data) > MAX_LINE_CHARS:  # a newline-less flood: pass it in pieces
            end = len(data)
        if not end:
            return Parsed(consumed=0)
        text = self._assembler.feed(memoryview(data)[:end], now)  # a view: no copy of the block
        return Parsed(consumed=end, text=text, records=count_lines(data, end))

    def quiet(self, data: bytes, now: float, final: bool = False) -> Parsed:
        if self.log_format == "cri" or not (data or final):  # CRI pieces wait in the state
            return Parsed(consumed=0)
        text = self._assembler.feed(data, now) + (  # the end of a secret may still come: held
            self._assembler.finish() if final else self._assembler.tick(float("inf")))
        return Parsed(consumed=len(data), text=text)

    def end_line(self) -> str:
        """A line of the sidecar's own follows in the log: the newline that ends this file's
        line sent in part (after a quiet second), if one is open; its rest is prefixed."""
        return self._assembler.end_line()

    def _cri(self, data: bytes, now: float) -> Parsed:
        out = Parsed(consumed=len(data))
        pieces: list[bytes] = []
        for line in data.split(b"\n")[:-1]:
            match = _CRI_LINE.match(line)
            if match is None:
                out.skipped += 1
                continue
            _, stream, tag, text = match.groups(b"")
            waiting = self._partial.setdefault(stream, [])
            waiting.append(text)
            if tag == b"P" and sum(map(len, waiting)) <= MAX_LINE_CHARS:
                continue
            pieces.extend(self._partial.pop(stream))
            pieces.append(b"\n")
            out.records += 1
        if pieces:
            out.text = self._assembler.feed(b"".join(pieces), now)
        return out


def count_lines(data: bytes, end: int) -> int:
    """The newlines in data[:end]. bytes.count looks at every byte, near a nanosecond each (a
    sixth of the sidecar's time on a file of 1 KiB lines); find() jumps to the next newline at
    memchr speed for a fixed cost a call, which is cheaper while lines are long. So it jumps
    while the lines found average FIND_LINE_BYTES or more, and counts the rest byte by byte as
    soon as they do not: short lines cost a call or two more than bytes.count alone."""
    count, at = 0, data.find(b"\n", 0, end)
    while at >= 0:
        count += 1
        if count * FIND_LINE_BYTES > at:
            return count + data.count(b"\n", at + 1, end)
        at = data.find(b"\n", at + 1, end)
    return count
