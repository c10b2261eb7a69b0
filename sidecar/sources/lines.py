"""Bytes of one output stream -> text for `/logs` (CONTRACT 5, Logs).

Works on blocks, not lines: a block of ordinary output is decoded, cut at its last newline and
passed on as one piece of text; only the rare block that holds a carriage-return progress bar
or an over-long line takes the per-line path. Pure: the caller supplies the clock.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_LINE_CHARS = 64 * 1024  # CONTRACT 5: a longer line is split
QUIET_FLUSH_S = 1.0  # a partial line goes out after this much quiet
PROGRESS_INTERVAL_S = 3.0  # a progress bar's latest state at most this often

_BARE_CR = re.compile(r"\r(?!\n)")


def _no_mask(text: str) -> str:
    return text


@dataclass
class LineAssembler:
    """Turns a stream's byte blocks into text: whole lines, quiet partials, collapsed bars."""

    mask: Callable[[str], str] = _no_mask
    prefix: str = ""
    max_line_chars: int = MAX_LINE_CHARS
    quiet_flush_s: float = QUIET_FLUSH_S
    progress_interval_s: float = PROGRESS_INTERVAL_S
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _pending: str = ""  # the current line's text not yet sent
    _open_chars: int = 0  # how much of the current line was already sent (a quiet partial)
    _last_feed: float = 0.0
    _bar_sent: str | None = None  # the progress state last sent for the current line
    _bar_sent_at: float = float("-inf")

    def feed(self, block: bytes, now: float) -> str:
        """Take the next block of the stream; returns the text ready to send (often all of it)."""
        self._last_feed = now
        text = self._pending + self._decoder.decode(block)
        cut = text.rfind("\n") + 1
        self._pending = text[cut:]
        out = self._lines(text[:cut]) if cut else ""
        return out + self._hold(now)

    def tick(self, now: float) -> str:
        """Called periodically: a partial line after a quiet second, a progress bar's state."""
        if not self._pending:
            return ""
        if _has_bar(self._pending):
            return self._bar_update(now, quiet=now - self._last_feed >= self.quiet_flush_s)
        if now - self._last_feed < self.quiet_flush_s:
            return ""
        partial, self._pending = self._pending, ""
        return self._emit(partial)

    def finish(self) -> str:
        """The stream ended: everything left, a progress bar's final state included."""
        text = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if not text:
            return ""
        return self._lines(text)

    def gap(self, dropped_bytes: int) -> str:
        """Some of the stream was dropped: close the line and say so in the log itself."""
        out = self.finish()
        self._decoder.reset()
        if self._open_chars:
            out += "\n"
            self._open_chars = 0
        return out + f"{self.prefix}[sidecar] {dropped_bytes} bytes of output were dropped here\n"

    def _hold(self, now: float) -> str:
        """Keep the unfinished line, sending what it must not keep: bar states, over-long text."""
        if not self._pending:
            return ""
        out = self._bar_update(now, quiet=False) if _has_bar(self._pending) else ""
        room = self.max_line_chars - self._open_chars
        if len(self._pending) <= room:
            return out
        # Over-long, even as a bar's latest state: send it in whole lines, keep the remainder.
        pending = self._pending.lstrip("\r")
        cut = room + (len(pending) - room - 1) // self.max_line_chars * self.max_line_chars
        self._pending = pending[cut:]
        head = _split_long(pending[:cut] + "\n", self.max_line_chars, self._open_chars)
        return out + self._emit(head)

    def _bar_update(self, now: float, quiet: bool) -> str:
        """Send the bar's latest state if it changed and enough time passed (or it went quiet)."""
        head, _, current = self._pending.rpartition("\r")
        state = _latest_state(self._pending)
        self._pending = "\r" + current if current else "\r" + _latest_state(head)
        if not state or state == self._bar_sent:
            return ""
        if not quiet and now - self._bar_sent_at < self.progress_interval_s:
            return ""
        self._bar_sent, self._bar_sent_at = state, now
        return self._emit(state + "\n")

    def _lines(self, text: str) -> str:
        """Whole lines (the last may be unterminated at the stream's end) ready to send."""
        if "\r" in text and _BARE_CR.search(text):
            text = self._collapse_bars(text)
        first_line_end = text.find("\n") % (len(text) + 1)
        if (_may_hold_long_line(text, self.max_line_chars)
                or self._open_chars + first_line_end > self.max_line_chars):
            text = _split_long(text, self.max_line_chars, self._open_chars)
        return self._emit(text)

    def _collapse_bars(self, text: str) -> str:
        """Each line with carriage returns becomes its final state (progress bars)."""
        lines = _split_lines(text)
        for i, line in enumerate(lines):
            if _BARE_CR.search(line):
                ending = "\r\n" if line.endswith("\r\n") else "\n" if line.endswith("\n") else ""
                lines[i] = _latest_state(line[: len(line) - len(ending)]) + ending
        if self._bar_sent is not None and lines[0].rstrip("\r\n") == self._bar_sent:
            lines[0] = ""  # the bar's final state already went out when it went quiet
        self._bar_sent, self._bar_sent_at = None, float("-inf")
        return "".join(lines)

    def _emit(self, text: str) -> str:
        """Prefix every line start, mask secrets; track whether the current line is open."""
        if not text:
            return ""
        last_newline = text.rfind("\n")
        open_before = self._open_chars
        self._open_chars = (open_before if last_newline < 0 else 0) + len(text) - last_newline - 1
        if self.prefix:
            first = "" if open_before else self.prefix
            text = first + text[:-1].replace("\n", "\n" + self.prefix) + text[-1]
        return self.mask(text)


def _has_bar(pending: str) -> bool:
    """Whether an unfinished line holds a carriage return that is not half of a split CRLF."""
    body = pending[:-1] if pending.endswith("\r") else pending
    return "\r" in body and _BARE_CR.search(body) is not None


def _may_hold_long_line(text: str, limit: int) -> bool:
    """False when no line of `text` can exceed `limit`, checked in a few C-speed scans.

    A run of more than `limit` non-newline characters covers a whole aligned window of
    (limit + 1) // 2 characters, so a newline in every such window rules it out.
    """
    if len(text) <= limit:
        return False
    window = (limit + 1) // 2
    return any(text.find("\n", start, start + window) < 0
               for start in range(0, len(text) - window + 1, window))


def _split_lines(text: str) -> list[str]:
    """`text` cut after each newline (str.splitlines would also cut at carriage returns)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _latest_state(line: str) -> str:
    """The last non-blank carriage-return segment of a line: what a terminal would show."""
    for segment in reversed(line.split("\r")):
        if segment.strip():
            return segment.rstrip(" ")
    return ""


def _split_long(text: str, limit: int, already_sent: int = 0) -> str:
    """Break every line longer than `limit` characters into lines of at most `limit`; the
    first line continues one of which `already_sent` characters went out before."""
    out = []
    for line in _split_lines(text):
        body = line.rstrip("\r\n")
        ending = line[len(body):]
        first = limit - already_sent
        already_sent = 0
        if len(body) <= first:
            out.append(line)
            continue
        pieces = [body[:first]] + [body[i:i + limit] for i in range(first, len(body), limit)]
        out.append("\n".join(pieces) + ending)
    return "".join(out)
