"""A small terminal for the rare block of output that moves the cursor (docs/ingest.md#logs).

Progress bars redraw lines in place: `\\r`, `\\b`, cursor up and down, column moves and erase
in line. `Screen` applies them to a model of the terminal's last lines, as a terminal would, and
sends what the terminal ends up showing: a line once it is final (the cursor left it downwards
and did not come back for `hold_s`, or the stream ended), a line still being redrawn as its
latest state at most every `interval_s`. Other escape sequences are dropped, or kept when they
are SGR colours and `keep_sgr` is set. Memory and work per byte are bounded whatever the input:
at most MAX_ROWS lines of at most `width` characters are held, and every count is clamped.
"""

from __future__ import annotations

import re
from collections import deque

MAX_ROWS = 24  # a terminal's height: the cursor cannot go further up than what it shows
HOLD_S = 3.0  # a line the cursor left downwards is final once it did not come back this long
MAX_CARRY_CHARS = 256  # an escape sequence cut by the block's end is kept for the next block

_TOKEN = re.compile(
    r"(\r+)"  # 1: carriage returns
    r"|(\n)"  # 2: line feed (at a terminal, onlcr makes it a new line)
    r"|(\x08+)"  # 3: backspaces
    r"|\x1b\[([0-?]{0,32})[ -/]{0,4}([@-~])"  # 4, 5: CSI parameters and final byte
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC (window title, hyperlink): dropped
    r"|\x1b[ -/]*[0-~]?")  # any other escape, a stray ESC included: dropped
_UNFINISHED = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*|[ -/]*)")
_CR, _LF, _BS, _CSI = 1, 2, 3, 5
_REPEATED_MOVE = re.compile(r"(\x1b\[([0-9]{0,4})([ABCD]))\1+")
_DOUBLED_MOVES = ("A\x1b[", "B\x1b[", "C\x1b[", "D\x1b[")  # a move, then another: maybe a run
_CYCLE_DEPTHS = (1, 2, 3)  # a bar at tqdm's position n redraws as n x \n, \r, text, n x ESC[A


class _Row:
    """One line of the screen: its cells (a colour sequence rides on the cell it precedes)."""

    __slots__ = ("cells", "drawn", "left_at", "sent", "sent_seq", "wraps")

    def __init__(self, cells: list[str] | None = None, sent: str | None = None,
                 sent_seq: int = -1) -> None:
        self.cells: list[str] = cells if cells is not None else []
        self.drawn = bool(cells)  # something was ever written (a cleared bar is not a blank line)
        self.left_at = 0.0  # when the cursor last moved from it (or above it) to below it
        self.sent = sent  # the state last sent
        self.sent_seq = sent_seq  # when, in the order of everything sent
        self.wraps = False  # it is full and continues on the next row: one line, split

    def text(self) -> str:
        joined = "".join(self.cells)
        return joined if self.wraps else joined.rstrip(" ")


class Screen:
    """The last lines of a terminal, fed text; returns the text ready to send, line by line."""

    def __init__(self, width: int, keep_sgr: bool = False, interval_s: float = 3.0,
                 quiet_s: float = 1.0, hold_s: float = HOLD_S) -> None:
        self.width = width  # a longer line wraps, as at a terminal (docs/ingest.md#logs)
        self.keep_sgr = keep_sgr
        self.interval_s = interval_s
        self.quiet_s = quiet_s
        self.hold_s = hold_s
        self._rows = [_Row()]
        self._y = 0  # the cursor's row in _rows
        self._x = 0  # its column; == width: the next character wraps
        self._sgr = ""  # colour sequences waiting for the next character
        self._carry = ""
        self._went_up = False  # until the cursor first goes up, a line left is final at once
        self._sent: deque[_Row] = deque(maxlen=MAX_ROWS)  # final lines, for a cursor going up
        self._seq = 0  # everything sent is numbered
        self._final_seq = -1  # the number of the state that stands for the last final line
        self._now = 0.0
        self._last_feed = 0.0
        self._snapshot_at = float("-inf")
        self._out: list[str] = []

    @property
    def idle(self) -> bool:
        """Nothing held: the cursor at the start of an empty line with nothing around it."""
        return len(self._rows) == 1 and not self._rows[0].cells and not self._x and not self._carry

    def feed(self, text: str, now: float, more: bool = False) -> str:
        """Apply the next piece of the stream; returns the lines it made final, and the states of
        lines being redrawn when one is due (not while `more` of what was written waits to be
        drawn: a line cut by a slice is not being redrawn, its rest is there)."""
        self._now = self._last_feed = now
        text = self._carry + text
        self._carry = ""
        cut = text.rfind("\x1b")
        if cut >= 0 and len(text) - cut <= MAX_CARRY_CHARS and _UNFINISHED.fullmatch(text, cut):
            text, self._carry = text[:cut], text[cut:]
        self._apply(skip_redraws(text, self.width))
        self._settle()
        if not more and now - self._snapshot_at >= self.interval_s:
            self._snapshot()
        return self._take()

    def tick(self, now: float, more: bool = False) -> str:
        """Called periodically: lines that became final, states due (at once after a quiet
        spell, as a stalled bar's latest state; none while `more` waits to be drawn)."""
        self._now = now
        self._settle()
        if not more and (now - self._last_feed >= self.quiet_s
                         or now - self._snapshot_at >= self.interval_s):
            self._snapshot()
        return self._take()

    def commit(self, now: float) -> str:
        """Another stream wrote to the terminal this one shares: its text went below the
        cursor, so the lines the cursor left are final now, however recently it left them."""
        self._now = now
        self._settle(hold=0.0)
        return self._take()

    def finish(self, text: str = "") -> str:
        """The stream ended with `text`: every line is final; the last one gets no line end of
        its own."""
        self._apply(self._carry + text)  # an escape sequence left unfinished is dropped
        self._carry = ""
        *above, last = self._rows
        for row in above:
            self._final(row)
        sent = len(self._out)
        if last.text():
            self._final(last)
        if len(self._out) > sent:
            self._out[-1] = self._out[-1][:-1]
        self._rows, self._y, self._x = [_Row()], 0, 0
        return self._take()

    # -- applying the stream ---------------------------------------------------------------------

    def _apply(self, text: str) -> None:
        pos = 0
        for match in _TOKEN.finditer(text):
            start = match.start()
            if start > pos:
                self._write(text, pos, start)
            pos = match.end()
            kind = match.lastindex
            if kind == _CR:
                self._x = 0
            elif kind == _LF:
                self._down(1)
                self._x = 0
            elif kind == _BS:
                self._x = max(min(self._x, self.width) - (pos - start), 0)
            elif kind == _CSI:
                self._csi(match.group(4), match.group(5), match.group(0))
        if pos < len(text):
            self._write(text, pos, len(text))

    def _write(self, text: str, start: int, end: int) -> None:
        """Characters at the cursor, over what was there; past the width, on the next line."""
        while start < end:
            if self._x >= self.width:
                self._rows[self._y].wraps = True
                self._down(1)
                self._x = 0
            piece = text[start:min(end, start + self.width - self._x)]
            start += len(piece)
            row = self._rows[self._y]
            cells, x = row.cells, self._x
            if x > len(cells):
                cells.extend(" " * (x - len(cells)))
            cells[x:x + len(piece)] = piece
            if self._sgr:
                cells[x] = self._sgr + cells[x]
                self._sgr = ""
            row.drawn = True
            self._x = x + len(piece)

    def _csi(self, params: str, final: str, sequence: str) -> None:
        first = params.split(";", 1)[0]
        n = int(first) if first.isdigit() else 0
        if final in "ABEF":
            rows = min(max(n, 1), MAX_ROWS)
            if final in "AF":
                self._up(rows)
            else:
                self._down(rows)
            if final in "EF":
                self._x = 0
        elif final in "CDG":
            columns = min(max(n, 1), self.width)
            x = min(self._x, self.width - 1)
            x = x + columns if final == "C" else x - columns if final == "D" else columns - 1
            self._x = min(max(x, 0), self.width - 1)
        elif final == "K":
            self._erase(n)
        elif final == "m" and self.keep_sgr and sequence[2:-1] == params:
            cells = self._rows[self._y].cells
            if self._x and self._x == len(cells):  # after the text it ends: keep it there
                cells[-1] += sequence
            else:
                self._sgr += sequence

    def _erase(self, mode: int) -> None:
        """Erase in line: 0 from the cursor to the end, 1 from the start to the cursor, 2 all."""
        cells = self._rows[self._y].cells
        x = min(self._x, len(cells))
        if mode == 0:
            del cells[x:]
        elif mode == 1:
            cells[:x + 1] = " " * min(x + 1, len(cells))
        elif mode == 2:
            cells.clear()

    def _down(self, rows: int) -> None:
        """The cursor `rows` lines down; the lines it leaves wait for their hold, then are final."""
        now = self._now
        for row in self._rows[self._y:self._y + rows]:
            row.left_at = now
        self._y += rows
        while self._y >= len(self._rows):
            self._rows.append(_Row())
        while len(self._rows) > MAX_ROWS:  # scrolled off the top: nothing can change it now
            self._final(self._rows.pop(0))
            self._y -= 1

    def _up(self, rows: int) -> None:
        """The cursor `rows` lines up, into lines already sent if need be (their new state is
        sent when they are final again), never above the screen's top."""
        self._went_up = True
        self._y -= rows
        while self._y < 0 and self._sent and len(self._rows) < MAX_ROWS:
            self._rows.insert(0, self._sent.pop())
            self._y += 1
        self._y = max(self._y, 0)

    # -- what is sent ----------------------------------------------------------------------------

    def _settle(self, hold: float | None = None) -> None:
        """Send the lines at the top that are final: left downwards and not come back (for
        `hold` seconds; by default `hold_s` once the cursor ever went up, else none)."""
        if hold is None:
            hold = self.hold_s if self._went_up else 0.0
        while self._y > 0 and self._now - self._rows[0].left_at >= hold:
            if self._rows[0].wraps and self._y == 1:
                break  # its continuation is still being written: sent together, masked whole
            self._final(self._rows.pop(0))
            self._y -= 1

    def _final(self, row: _Row) -> None:
        """A line in its last state, unless that state went out already and nothing above it was
        sent since (a cleared bar is not sent: a terminal shows a blank line). Either way the
        row is kept for a cursor that comes back up to it: a cleared one too, else what is
        written there later lands on the row below."""
        text = row.text()
        cleared = not text and row.drawn
        if not cleared:
            if text != row.sent or row.sent_seq < self._final_seq:
                self._seq += 1
                row.sent, row.sent_seq = text, self._seq
                # the line goes on: the split comes after masking, in LineAssembler
                self._out.append(text if row.wraps else text + "\n")
            self._final_seq = row.sent_seq
        kept = _Row(row.cells, row.sent, row.sent_seq)
        kept.drawn = row.drawn
        self._sent.append(kept)

    def _snapshot(self) -> None:
        """The latest state of each line still held, where it changed since it was last sent
        (not of a line longer than the width: its final state only). A secret still being
        written shows at most a run too short to mask (docs/ingest.md#logs): the caller masks
        every longer one."""
        self._snapshot_at = self._now
        wrapped = False
        for row in self._rows:
            if wrapped or row.wraps:
                wrapped = row.wraps
                continue
            text = row.text()
            if text and text != row.sent:
                self._seq += 1
                row.sent, row.sent_seq = text, self._seq
                self._out.append(text + "\n")

    def _take(self) -> str:
        out = "".join(self._out)
        self._out.clear()
        return out


def skip_redraws(text: str, width: int) -> str:
    """`text` without the redraws a later one covers whole, found with a few C-speed string
    operations, so that a flood of bar updates costs little more than its last ones: runs of
    `\rTEXT` on one line, runs of tqdm's redraw of a bar below the cursor, and runs of the
    same cursor move."""
    if "\x1b[A" in text:
        for depth in _CYCLE_DEPTHS:
            text = _skip_covered(text, "\x1b[A" * depth + "\n" * depth + "\r", width)
    if "\x1b[" in text and any(move in text for move in _DOUBLED_MOVES):
        text = _REPEATED_MOVE.sub(_one_move, text)
    if "\n" not in text:
        return _skip_covered(text, "\r", width)
    if text.count("\r") <= 2 * text.count("\n") + 2:
        return text
    return "\n".join(_skip_covered(line, "\r", width) for line in text.split("\n"))


def _skip_covered(text: str, separator: str, width: int) -> str:
    """Between the first and the last two `separator`s, each piece is a redraw of the same line
    from its start: when all are plain text and the last of them is the longest, it covers the
    others."""
    first = text.find(separator)
    if first < 0:
        return text
    last = text.rfind(separator)
    before_last = text.rfind(separator, first + len(separator), last)
    if before_last < 0:
        return text
    kept = text[before_last + len(separator):last]
    middle = text[first + len(separator):before_last]
    rest = middle if separator == "\r" else middle.replace(separator, "")
    if not (_plain(kept) and _plain(rest)) or \
            (separator != "\r" and ("\r" in kept or "\r" in rest)):
        return text  # a redraw that moves the cursor itself: applied as it is
    if len(kept) > width or len(kept) < max(map(len, middle.split(separator))):
        return text
    return text[:first + len(separator)] + kept + text[last:]


def _plain(text: str) -> bool:
    """No control character (carriage returns are looked at by the caller)."""
    return not ("\x1b" in text or "\n" in text or "\b" in text)


def _one_move(run: re.Match[str]) -> str:
    """A run of one cursor move as one move of the sum (the model clamps it the same way)."""
    times = len(run.group(0)) // len(run.group(1))
    return f"\x1b[{min(max(int(run.group(2) or 1), 1) * times, 1 << 20)}{run.group(3)}"
