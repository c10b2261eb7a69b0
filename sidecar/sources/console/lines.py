"""Bytes of one output stream -> text for `/logs` (docs/ingest.md#logs).

Works on blocks, not lines: a block of ordinary output is decoded, cut at its last newline and
passed on as one piece of text; an over-long line takes a per-line path, and the rare block that
moves the cursor (a carriage return, a backspace, an escape sequence other than colours) goes to
a small terminal (terminal.py) until it holds nothing. Secrets are masked in the raw bytes, before
any of that: a token the terminal would overwrite in part (a progress bar drawn over it) is gone
before it is drawn, and what the terminal shows is masked again, for a token its redraws put
together. The end of a block that could begin a secret waits for the next block. The terminal's
work per call can be bounded (`screen_slice_chars`): what it has not drawn yet waits, in order,
for `resume`. Pure: the caller supplies the clock.
"""

from __future__ import annotations

import codecs
import re
import sys
from collections import deque
from typing import Protocol

from sidecar.sources.console.terminal import Screen, skip_redraws

MAX_LINE_CHARS = 64 * 1024  # a longer line is split (docs/ingest.md#logs)
QUIET_FLUSH_S = 1.0  # a partial line goes out after this much quiet
PROGRESS_INTERVAL_S = 3.0  # a progress bar's latest state at most this often
THIN_CHARS = 32 << 10  # of what waits for the terminal, thinned at once (see _thin)
# drawn in one call where the work per call is bounded: a flood of escape sequences costs the
# terminal up to a few microseconds a character
SCREEN_SLICE_CHARS = 1 << 10

_BARE_CR = re.compile(r"\r(?=[^\n])")  # a final one may be half of a CRLF: the next block says
_NOT_SGR = re.compile(r"\x1b(?!\[[0-9;:]*m)")  # an escape that is not a complete colour sequence
_SGR = re.compile(r"\x1b\[[0-9;:]*m")


class Masker(Protocol):
    """The secrets to mask (sidecar.masking.Secrets)."""

    longest: int  # characters of the longest secret

    def mask(self, text: str) -> str:
        """`text` with every secret replaced."""

    def unfinished(self, text: str) -> int:
        """How many characters at the end of `text` could be the start of a secret."""

    def mask_raw(self, data: bytes | memoryview,
                 final: bool = False) -> tuple[bytes | memoryview, int]:
        """Raw output with every secret replaced but its last bytes that could begin one (none
        when `final`), and how many those are."""


class _NoSecrets:
    longest = 0

    def mask(self, text: str) -> str:
        return text

    def unfinished(self, text: str) -> int:
        return 0

    def mask_raw(self, data: bytes | memoryview,
                 final: bool = False) -> tuple[bytes | memoryview, int]:
        return data, 0


NO_SECRETS: Masker = _NoSecrets()


class LineAssembler:
    """Turns a stream's byte blocks into text: whole lines, quiet partials, what a terminal
    shows of output that moves the cursor."""

    def __init__(self, secrets: Masker = NO_SECRETS, prefix: str = "", keep_sgr: bool = False,
                 max_line_chars: int = MAX_LINE_CHARS, quiet_flush_s: float = QUIET_FLUSH_S,
                 progress_interval_s: float = PROGRESS_INTERVAL_S,
                 screen_slice_chars: int | None = None) -> None:
        """`screen_slice_chars`: at most this much is drawn on the terminal in one call, the
        rest waits for `resume` (None: all of it at once)."""
        self.secrets = secrets
        self.prefix = prefix
        self.keep_sgr = keep_sgr  # --log-ansi keep: colour sequences are forwarded
        self.max_line_chars = max_line_chars
        self.quiet_flush_s = quiet_flush_s
        self.progress_interval_s = progress_interval_s
        self._held = b""  # the end of the last block, which could begin a secret
        self._undecoded = b""  # the start of a character cut by the end of the last block
        self._pending = ""  # the current line's text not yet sent
        self._open_chars = 0  # how much of the current line was already sent (a quiet partial)
        self._last_feed = 0.0
        self._screen: Screen | None = None  # while output that moves the cursor is being drawn
        self.screen_slice_chars = screen_slice_chars
        # what the terminal has still to draw, in order: text, or a gap (that many bytes were
        # dropped)
        self._backlog: deque[str | int] = deque()
        self._thinned = ""  # its head, the redraws a later one covers taken out
        self.backlog = 0  # characters of text in both

    def feed(self, block: bytes | memoryview, now: float) -> str:
        """Take the next block of the stream; returns the text ready to send (often all of it)."""
        self._last_feed = now
        text = self._pending + self._decode(self._mask(block))
        if self._waiting or (self._screen is not None and not self._screen.idle) \
                or _moves_cursor(text):
            self._pending = ""
            self._queue(text)
            return self._draw(now, self.screen_slice_chars)
        self._screen = None
        if "\x1b" in text and not self.keep_sgr:
            text = _SGR.sub("", text)  # colours alone need no terminal
        cut = text.rfind("\n") + 1
        self._pending = text[cut:]
        out = self._lines(text[:cut]) if cut else ""
        return out + self._hold(now)

    @property
    def drawing(self) -> bool:
        """Whether output goes to the terminal model (it then may fall behind)."""
        return self._screen is not None or self._waiting

    @property
    def _waiting(self) -> bool:
        return bool(self._backlog or self._thinned)

    def resume(self, now: float) -> str:
        """Draw the next slice of what waits for the terminal (see `backlog`)."""
        return self._draw(now, self.screen_slice_chars) if self._waiting else ""

    def tick(self, now: float) -> str:
        """Called periodically: a partial line after a quiet second, a progress bar's state."""
        if self._screen is not None or self._waiting:
            out = self.resume(now)
            if self._screen is not None:
                out += self._lines(self.secrets.mask(self._screen.tick(now, more=self._waiting)))
            return out
        if now - self._last_feed < self.quiet_flush_s:
            return ""
        return self._partial()

    def commit(self, now: float) -> str:
        """Another stream of the command wrote: on a terminal both share, its text lands after
        everything this one showed, so what this one holds goes first: what waits for the
        terminal (the caller bounds it: MAX_BACKLOG_CHARS) and the lines the cursor left (not
        the line a bar is still being redrawn on). A partial line waits for its end as ever:
        a read may have cut it, and sending it would split one line in two."""
        out = self._draw(now, None) if self._waiting else ""
        if self._screen is not None:
            out += self._lines(self.secrets.mask(self._screen.commit(now)))
        return out

    def _partial(self) -> str:
        """The unfinished line as it stands (masked already: what could begin a secret is kept
        back with the raw bytes)."""
        if not self._pending:
            return ""
        partial, self._pending = self._pending, ""
        return self._emit(partial)

    def finish(self) -> str:
        """The stream ended: everything left, a progress bar's final state included (all that
        waits for the terminal too: a caller bounding the work per call resumes until
        `backlog` is 0 first)."""
        text = self._rest()
        out = self._draw(self._last_feed, None) if self._waiting else ""
        if self._screen is not None:
            screen, self._screen = self._screen, None
            return out + self._lines(self.secrets.mask(screen.finish(text)))
        return out + self._lines(text) if text else out

    def end_line(self) -> str:
        """A line of the sidecar's own follows: the newline that ends the line sent in part (a
        quiet partial, a bar), if one is open; the rest of it, when it comes, is prefixed."""
        if not self._open_chars:
            return ""
        self._open_chars = 0
        return "\n"

    def own_line(self, line: str) -> str:
        """A line of the sidecar's own (masked, without its newline) between the stream's
        lines: on a line of its own, prefixed like theirs."""
        return self.end_line() + f"{self.prefix}{line}\n"

    def gap(self, dropped_bytes: int) -> str:
        """Some of the stream was dropped: close the line and say so in the log itself (once
        the terminal has drawn what came before)."""
        if self._waiting:
            self._queue(self._rest())
            self._backlog.append(dropped_bytes)
            return ""
        return self._gap(self.finish(), dropped_bytes)

    def _gap(self, out: str, dropped_bytes: int) -> str:
        if self._open_chars:
            out += "\n"
            self._open_chars = 0
        return out + f"{self.prefix}[sidecar] {dropped_bytes} bytes of output were dropped here\n"

    def _rest(self) -> str:
        """The text not yet sent nor drawn, the end kept back for a secret included."""
        held, self._held = self._held, b""
        text = self._pending + self._decode(self.secrets.mask_raw(held, final=True)[0],
                                            final=True)
        self._pending = ""
        return text

    def _queue(self, text: str) -> None:
        if text:
            self._backlog.append(text)
            self.backlog += len(text)

    def _mask(self, block: bytes | memoryview) -> bytes | memoryview:
        """The block with every secret masked, the end of the one before it in front; its own
        end kept back where it could begin a secret."""
        if self._held:
            block = self._held + block
        # while the terminal draws, nothing is kept back: what it shows is masked again, so a
        # run a read cut is masked there whole, and a state of the line lacks none of its text
        masked, keep = self.secrets.mask_raw(block, final=self.drawing)
        self._held = bytes(block[len(block) - keep:]) if keep else b""
        return masked

    def _decode(self, block: bytes | memoryview, final: bool = False) -> str:
        """UTF-8 with replacement, straight from the caller's buffer (a view of a read is not
        copied first); a character cut by the block's end waits for the next block."""
        if self._undecoded:
            block = self._undecoded + block
        text, used = codecs.utf_8_decode(block, "replace", final)
        self._undecoded = bytes(block[used:])
        return text

    def _hold(self, now: float) -> str:
        """Keep the unfinished line, sending what it must not keep: over-long text (masked
        already: a cut cannot split a secret)."""
        room = self.max_line_chars - self._open_chars
        pending = self._pending
        if len(pending) <= room:
            return ""
        cut = room + (len(pending) - room - 1) // self.max_line_chars * self.max_line_chars
        self._pending = pending[cut:]
        return self._emit(_split_long(pending[:cut] + "\n", self.max_line_chars,
                                      self._open_chars))

    def _lines(self, text: str) -> str:
        """Whole lines (masked; the last may be unterminated at the stream's end) ready to send."""
        first_line_end = text.find("\n") % (len(text) + 1)
        if (_may_hold_long_line(text, self.max_line_chars)
                or self._open_chars + first_line_end > self.max_line_chars):
            text = _split_long(text, self.max_line_chars, self._open_chars)
        return self._emit(text)

    def _draw(self, now: float, limit: int | None) -> str:
        """Output that moves the cursor: drawn on the terminal, which says what to send; at
        most `limit` characters of what waits (None: all), in order, gaps included."""
        out = []
        left = limit if limit is not None else sys.maxsize
        while self._waiting and left > 0:
            if not self._thinned:
                head = self._backlog.popleft()
                if isinstance(head, int):  # a gap: the terminal's lines end before its notice
                    screen, self._screen = self._screen, None
                    ended = self._lines(self.secrets.mask(screen.finish())) if screen else ""
                    out.append(self._gap(ended, head))
                    continue
                self._thinned = self._thin(head)
            item, self._thinned = self._thinned[:left], self._thinned[left:]
            self.backlog -= len(item)
            left -= len(item)
            if self._screen is None:
                self._screen = Screen(self.max_line_chars, self.keep_sgr,
                                      self.progress_interval_s, self.quiet_flush_s)
                if self._open_chars:  # the terminal draws the line whole: end the part sent
                    out.append(self._emit("\n"))
            drawn = self._screen.feed(item, now, more=self._waiting)
            out.append(self._lines(self.secrets.mask(drawn)))
        return "".join(out)

    def _thin(self, text: str) -> str:
        """The next THIN_CHARS of `text` (the rest goes back first in the backlog) without the
        redraws a later one covers: a slice alone holds too few of a bar's redraws to thin, and
        thinning costs a flood of escape sequences as much as drawing a tenth of it."""
        if self.screen_slice_chars is None:
            return text  # the terminal thins what it is given whole
        if len(text) > THIN_CHARS:
            text, rest = text[:THIN_CHARS], text[THIN_CHARS:]
            self._backlog.appendleft(rest)
        thinned = skip_redraws(text, self.max_line_chars)
        self.backlog -= len(text) - len(thinned)
        return thinned

    def _emit(self, text: str) -> str:
        """Prefix every line start (of text already masked); track whether the line is open."""
        if not text:
            return ""
        last_newline = text.rfind("\n")
        open_before = self._open_chars
        self._open_chars = (open_before if last_newline < 0 else 0) + len(text) - last_newline - 1
        if self.prefix:
            first = "" if open_before else self.prefix
            text = first + text[:-1].replace("\n", "\n" + self.prefix) + text[-1]
            if self.secrets.unfinished(self.prefix):
                # the prefix ends as a secret may begin: with the line after it, a run of one
                text = self.secrets.mask(text)
        return text


def _moves_cursor(text: str) -> bool:
    """Whether `text` needs the terminal: an escape other than a colour, a backspace, a bare
    carriage return."""
    return (("\x1b" in text and _NOT_SGR.search(text) is not None) or "\b" in text
            or ("\r" in text and _BARE_CR.search(text) is not None))


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
