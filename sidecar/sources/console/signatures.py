"""Failure signatures in a command's output: a table kept as data, matched on bytes as they pass.

Each row names a cause, the bytes pattern that gives it away (within one line), the stream it
shows on (any, by default: `exec 2>&1`, `| tee` and `| cat` put a traceback on stdout) and which
occurrence is quoted; stderr's is quoted before stdout's. `Scanner.feed` sits beside the log
path, not inside it: a block whose bytes hold none of the table's keywords costs a few C-speed
substring searches and nothing else (no per-line work); only a block that holds one runs the
table's single compiled alternation, and only its complete lines count, so a signature cut
across two blocks is found once, in the later one, with the partial line carried over. A row
may be armed by another (a Python exception line is looked for only after a traceback header on
the same stream), so that common words need not be keywords.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

CARRY_BYTES = 4096  # of an unfinished line kept for the next block; also the stream tail kept
QUOTE_CHARS = 160  # of a quoted line; a longer one ends in " ..."
ARMED_BYTES = 256 << 10  # how far after a traceback header its exception line is looked for


class Signature(NamedTuple):
    """One row of the table."""

    name: str  # the label in /metrics and /status
    cause: str  # the summary's words; {group} fills in a named group of the pattern
    keywords: tuple[bytes, ...]  # one of these is in every line the pattern matches
    pattern: bytes  # a regex over one line; its named groups must be unique in the table
    stream: str = "any"  # "stdout", "stderr" or "any"
    keep: str = "first"  # which occurrence is quoted: "first" or "last"
    armed_by: str = ""  # looked for only after this row matched on the same stream
    # "cause": named before the signal the command died of; "fallback": after it; "count": counted,
    # never named
    weight: str = "cause"


# Ranked: when several match, the summary names the highest. Sources of the messages are cited in
# tests/test_signatures.py, which checks every row on real lines.
SIGNATURES: tuple[Signature, ...] = (
    Signature("cuda_oom", "CUDA out of memory", (b"CUDA",),
              rb"CUDA out of memory|CUDA error: out of memory", keep="last"),
    Signature("nccl_watchdog_timeout", "NCCL watchdog timeout", (b"NCCL",),
              rb"Watchdog caught collective operation timeout"),
    Signature("cuda_error", "CUDA error", (b"CUDA",),
              rb"CUDA error: (?:an illegal memory access|device-side assert|misaligned address|"
              rb"unspecified launch failure|an illegal instruction|uncorrectable ECC|[a-z])"),
    Signature("nccl_warn", "NCCL error", (b"NCCL WARN",), rb"NCCL WARN"),
    Signature("nccl_error", "NCCL error", (b"NCCL",),
              rb"NCCL error|NCCL communicator was aborted|DistBackendError: NCCL"),
    Signature("disk_full", "No space left on device", (b"No space left",),
              rb"No space left on device"),
    Signature("python_traceback", "Python traceback", (b"Traceback",),
              rb"^Traceback \(most recent call last\):", weight="count"),
    Signature("python_exception", "Python exception {exception}", (),
              rb"^(?P<exception>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Warning))"
              rb"(?::[^\n]*)?\r?$", keep="last", armed_by="python_traceback",
              weight="fallback"),
)


class Quote(NamedTuple):
    """One occurrence of a signature: its line, as quoted, and the pattern's named groups."""

    line: str
    groups: dict[str, str]


QUOTED_FIRST = "stderr"  # where PyTorch, CUDA, glog and Python's tracebacks write
# The wrapped command's streams as `run` reads them: stdout and stderr on two pipes, or both on
# one pipe (where the sidecar's own stdout and stderr are one destination) or one terminal
# (--tty), a stream that holds both.
TWO_PIPES = ("stdout", "stderr")
ONE_PIPE = "stdout+stderr"
TTY = "terminal"


class Seen:
    """What the scanner knows of one signature: how often, and the occurrence it quotes on
    each stream; stderr's is the one named."""

    __slots__ = ("count", "quotes")

    def __init__(self) -> None:
        self.count = 0
        self.quotes: dict[str, Quote] = {}  # by stream, in the order first seen

    @property
    def stream(self) -> str:
        """The stream of the quoted occurrence: stderr when it has one, else the first other."""
        return QUOTED_FIRST if QUOTED_FIRST in self.quotes else next(iter(self.quotes), "")

    @property
    def line(self) -> str:
        quote = self.quotes.get(self.stream)
        return quote.line if quote is not None else ""

    @property
    def groups(self) -> dict[str, str]:
        quote = self.quotes.get(self.stream)
        return quote.groups if quote is not None else {}


class _StreamState:
    __slots__ = ("armed", "carry", "keywords", "tail")

    def __init__(self, keywords: tuple[tuple[bytes, bytes], ...]) -> None:
        self.keywords = keywords  # (guard, keyword) of the rows that apply
        self.carry = b""  # the unfinished last line
        self.tail = b""  # the last CARRY_BYTES of the stream
        # a row seen that arms others, and how many more bytes it stays armed
        self.armed: dict[str, int] = {}


class Scanner:
    """Counts the table's signatures in one run's streams and keeps what to quote."""

    def __init__(self, table: Sequence[Signature] = SIGNATURES) -> None:
        self.table = tuple(table)
        self.seen: dict[str, Seen] = {}
        self._rows = {row.name: row for row in self.table}
        self._probe_bytes = max((len(k) for row in self.table for k in row.keywords), default=1)
        # Zero-width: a row's match never hides another row's later in the same line.
        self._regex = re.compile(b"(?=%s)" % b"|".join(
            b"(?P<%s>%s)" % (row.name.encode(), row.pattern) for row in self.table), re.MULTILINE)
        self._streams: dict[str, _StreamState] = {}
        self._arms = {row.armed_by for row in self.table if row.armed_by}

    @property
    def counts(self) -> dict[str, int]:
        """How often each signature was seen, every row of the table included."""
        return {row.name: self.seen[row.name].count if row.name in self.seen else 0
                for row in self.table}

    def feed(self, stream: str, block: bytes) -> None:
        """Look at the next block of `stream` (bytes as the command wrote them)."""
        state = self._streams.get(stream)
        if state is None:
            state = self._streams[stream] = _StreamState(keywords=self._keywords_of(stream))
        carry = state.carry
        armed_before = tuple(state.armed)
        if armed_before or self._hot(state.keywords, carry, block):
            text = carry + block
            end = text.rfind(b"\n") + 1
            if end:
                self._match(stream, state, text, end)
            state.carry = text[end:][-CARRY_BYTES:]
        else:
            cut = block.rfind(b"\n") + 1
            state.carry = block[cut:][-CARRY_BYTES:] if cut else (carry + block)[-CARRY_BYTES:]
        state.tail = (block if len(block) >= CARRY_BYTES else state.tail + block)[-CARRY_BYTES:]
        for name in armed_before:  # a header without its exception line disarms in the end
            left = state.armed.get(name, 0) - len(block)
            if left > 0:
                state.armed[name] = left
            else:
                state.armed.pop(name, None)

    def finish(self, stream: str) -> None:
        """The stream ended: its unfinished last line counts as complete."""
        state = self._streams.get(stream)
        if state is not None and state.carry:
            text, state.carry = state.carry + b"\n", b""
            self._match(stream, state, text, len(text))

    def last_line(self, stream: str) -> str:
        """The stream's last non-empty line, as text."""
        state = self._streams.get(stream)
        if state is None:
            return ""
        for line in reversed(state.tail.splitlines()):
            text = _text(line)
            if text:
                return text
        return ""

    def _keywords_of(self, stream: str) -> tuple[tuple[bytes, bytes], ...]:
        """The keywords of the rows that apply to `stream`, each after its guard byte."""
        keywords = dict.fromkeys(k for row in self.table if _applies(row, stream)
                                 for k in row.keywords)
        return tuple((_guard(keyword), keyword) for keyword in keywords)

    def _hot(self, keywords: tuple[tuple[bytes, bytes], ...], carry: bytes,
             block: bytes) -> bool:
        """Whether a keyword is in the block or across its start; a keyword is searched for
        only when its guard byte is there (one memchr, a tenth of a substring search)."""
        if any(guard in block and keyword in block for guard, keyword in keywords):
            return True
        if not carry:
            return False
        probe = carry + block[:self._probe_bytes]
        return any(keyword in probe for _, keyword in keywords)

    def _match(self, stream: str, state: _StreamState, text: bytes, end: int) -> None:
        """Count the signatures in the complete lines of `text` (those before `end`), each row
        at most once a line."""
        counted: set[tuple[str, int]] = set()
        for match in self._regex.finditer(text, 0, end):
            name = match.lastgroup
            if name is None:
                continue
            row = self._rows[name]
            if not _applies(row, stream):
                continue
            if row.armed_by and row.armed_by not in state.armed:
                continue
            start = text.rfind(b"\n", 0, match.start()) + 1
            if (name, start) in counted:
                continue
            counted.add((name, start))
            if name in self._arms:
                state.armed[name] = ARMED_BYTES
            self._record(row, stream, text, match, start)
            if row.armed_by:
                state.armed.pop(row.armed_by, None)

    def _record(self, row: Signature, stream: str, text: bytes, match: re.Match[bytes],
                start: int) -> None:
        seen = self.seen.get(row.name)
        if seen is None:
            seen = self.seen[row.name] = Seen()
        seen.count += 1
        if stream in seen.quotes and row.keep == "first":
            return
        stop = text.find(b"\n", match.end())
        seen.quotes[stream] = Quote(
            _text(text[start:stop if stop >= 0 else len(text)]),
            {key: value.decode("utf-8", "replace") for key, value in match.groupdict().items()
             if value is not None and key not in self._rows})


def _guard(keyword: bytes) -> bytes:
    """The keyword's rarest byte in ordinary output, by a rough order of frequency: searching
    for one byte is memchr, several times cheaper than a substring, and rarely finds one."""
    return bytes([max(keyword, key=lambda byte: _BY_FREQUENCY.find(bytes([byte])) % 256)])


_BY_FREQUENCY = (b" etaoinsrhldcumfpgwybvkxjqz0123456789.,:;-_/=()[]'\"ETAOINSRHLDCUMFPGWYBVKXJQZ")


def _applies(row: Signature, stream: str) -> bool:
    """Whether `row` is looked for on `stream`; a stream other than stdout and stderr holds
    both (ONE_PIPE, TTY, a log file)."""
    return row.stream in ("any", stream) or stream not in TWO_PIPES


def _text(line: bytes) -> str:
    """A line as quoted: decoded with replacement, stripped, at most QUOTE_CHARS."""
    text = line.decode("utf-8", "replace").strip()
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS].rstrip() + " ..."
