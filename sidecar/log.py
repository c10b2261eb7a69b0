"""The sidecar's own messages: stderr, one line an event, text or JSON, secrets masked."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

MASK = "***"
MIN_SECRET_CHARS = 8  # a shorter "secret" would be masked inside ordinary words


ANCHOR_CHARS = 8  # the shortest part of a secret searched for in its place
TUNE_SAMPLE_CHARS = 64 << 10  # a text at least this long can tell which part is fastest to find
TUNE_EVERY = 1024  # calls between two such measurements


class Secrets:
    """Every secret this process has used (a token re-read after a 401 adds the new one).

    A text is searched for one part of each secret (its anchor), with str.find: the part whose
    search measured fastest on a recent text, so that a secret whose letters suit str.find's
    skip table badly for this output (one made masking three times slower than another) costs
    what the best of its parts costs. Only a text holding an anchor is searched further."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._anchors: dict[str, str] = {}  # secret -> the part of it searched for
        self._calls = 0
        self.longest = 0  # characters: an over-long partial keeps back one fewer (its end may
        #                   begin a secret)
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str) -> None:
        """Mask `secret` from now on (a shorter one than MIN_SECRET_CHARS is ignored)."""
        if len(secret) < MIN_SECRET_CHARS or secret in self._anchors:
            return
        self._anchors[secret] = secret
        self._anchors = dict(sorted(self._anchors.items(), key=lambda item: -len(item[0])))
        self.longest = max(self.longest, len(secret))  # the longest goes first: it may hold
        #                                                a shorter one
        self._calls = 0  # measure at the next long text

    def mask(self, text: str) -> str:
        """`text` with every known secret replaced by ***."""
        if self._calls % TUNE_EVERY == 0 and len(text) >= TUNE_SAMPLE_CHARS:
            self._tune(text[:TUNE_SAMPLE_CHARS])
        self._calls += 1
        for secret, anchor in self._anchors.items():
            if anchor in text and secret in text:
                text = text.replace(secret, MASK)
        return text

    def unfinished(self, text: str) -> int:
        """How many characters at the end of `text` could be the start of a secret (a state
        of a line sent while the secret is still being written must not show that start)."""
        tail = text[-self.longest:]
        return max((size for secret in self._anchors for size in range(len(secret) - 1, 0, -1)
                    if tail.endswith(secret[:size])), default=0)

    def _tune(self, sample: str) -> None:
        """Pick, for each secret, the part that str.find finds (or not) fastest in `sample`."""
        step = ANCHOR_CHARS // 2
        for secret in self._anchors:
            parts = [secret] + [secret[i:i + ANCHOR_CHARS]
                                for i in range(0, len(secret) - ANCHOR_CHARS + 1, step)]
            self._anchors[secret] = min(parts, key=lambda part: _find_seconds(sample, part))


def _find_seconds(text: str, needle: str, tries: int = 3) -> float:
    """The shortest of a few timings of one search (the machine may be busy meanwhile)."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        text.find(needle)
        best = min(best, time.perf_counter() - started)
    return best


secrets = Secrets()
add_secret = secrets.add
mask = secrets.mask

log = logging.getLogger("sidecar")


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        line = f"{when[:-4]}Z sidecar {record.levelname} {record.getMessage()}"
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        return mask(line)


# What a message concerns, read from its start as every message names it first: a route
# ("/metrics: HTTP 503 ..."), a followed file ("--jsonl out/m.jsonl: line 3 ...") or an option.
_ROUTE_AT_START = re.compile(r"/([a-z]+(?:/[a-z]+)?): ")
_OPTION_AT_START = re.compile(r"(--[a-z][a-z-]*)[ =](\S+?):? ")
_VARIABLE_AT_START = re.compile(r"([A-Z][A-Z0-9]*_[A-Z0-9_]+)\b")
SOURCE_OPTIONS = frozenset({"--log", "--jsonl", "--tensorboard", "--hparams", "--checkpoints"})
EXTRA_FIELDS = ("command", "route", "source", "path", "option", "variable")  # given with `extra=`


class _JsonFormatter(logging.Formatter):
    """One JSON object a message: its time, level and text, the run and node it is about
    (`setup`'s context) and, where it names one, the route, source or option it concerns."""

    def __init__(self, context: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.context = dict(context or {})

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "msg": message,
            **self.context,
            **_concerns(getattr(record, "concerns", message)),
            **{name: getattr(record, name) for name in EXTRA_FIELDS if hasattr(record, name)},
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return mask(json.dumps(doc, ensure_ascii=False))


def _concerns(message: str) -> dict[str, str]:
    """The route, the source (and its file), the option or the variable `message` starts by
    naming."""
    route = _ROUTE_AT_START.match(message)
    if route:
        return {"route": route.group(1)}
    option = _OPTION_AT_START.match(message)
    if option is None:
        variable = _VARIABLE_AT_START.match(message)
        return {"variable": variable.group(1)} if variable else {}
    flag, value = option.groups()
    if flag in SOURCE_OPTIONS:
        return {"source": flag[2:], "path": value}
    return {"option": flag}


class Throttle:
    """Lets a repeated message through once per `interval_s`, counting the ones it held back."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def admit(self, key: str) -> int | None:
        """None to stay quiet; else how many were held back since the last admitted one."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


class _RepeatFilter(logging.Filter):
    """The same WARNING or ERROR again within a minute is held back and counted; the next
    one let through says how many were held."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self._throttle = Throttle(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        held = self._throttle.admit(f"{record.levelno}:{record.getMessage()}")
        if held is None:
            return False
        if held:
            record.msg = f"{record.getMessage()} ({held} more like this in the last minute)"
            record.args = None
        return True


_state_dir_trouble = Throttle()


def state_write_failed(path: object, exc: OSError) -> None:
    """A write to the state dir failed (a full disk, most often): one ERROR a minute for all
    of them together, since they share one cause and one fix."""
    held = _state_dir_trouble.admit("state-dir")
    if held is None:
        return
    more = f" ({held} more failed writes since the last message)" if held else ""
    log.error("cannot write to the state dir (%s: %s): lifecycle events and file offsets are kept "
              "in memory and written once it can be, spooled payloads are refused meanwhile, "
              "and the trainer is not affected; free space or give --state-dir more%s",
              path, exc.strerror or exc, more)


class _OpenLine:
    """Whether the command's output, passed through to where our messages go (our stderr: a
    terminal, a file, a pipe to `kubectl logs` or journald), ends in the middle of a line (a
    progress bar, a prompt): then our next message starts a new one."""

    def __init__(self) -> None:
        self._open: set[int] = set()  # the output streams whose last byte was not a newline

    def shares_our_stderr(self, fd: int) -> bool:
        """Whether output written to `fd` lands where our stderr does: fd 2 itself, the same
        terminal, or the same file, pipe or socket (`>all.log 2>&1`); not /dev/null, which
        nobody reads."""
        try:
            ours, theirs = os.fstat(2), os.fstat(fd)
        except OSError:
            return False
        if os.isatty(fd) and os.isatty(2):
            return theirs.st_rdev == ours.st_rdev
        if stat.S_ISCHR(theirs.st_mode):
            return False
        return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)

    def written(self, fd: int, block: bytes) -> None:
        """The command's output `block` was written to `fd`, which our stderr shares."""
        if block.endswith(b"\n"):
            self._open.discard(fd)
        elif block:
            self._open.add(fd)

    def close(self) -> bool:
        """Whether a line is open; our message about to be written ends it."""
        was_open = bool(self._open)
        self._open.clear()
        return was_open


open_line = _OpenLine()


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "\n" + text if open_line.close() else text


def setup(level: str = "info", message_format: str = "text",
          context: Mapping[str, str] | None = None) -> None:
    """Send the sidecar's messages to stderr at `level`, as text lines or JSON objects; each
    JSON one carries `context` (the run id and the node) as fields."""
    handler = _Handler(sys.stderr)
    handler.addFilter(_RepeatFilter())
    handler.setFormatter(_JsonFormatter(context) if message_format == "json"
                         else _TextFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


def format_duration(seconds: float) -> str:
    """2h13m, 41m12s, 30m0s, 7s: hours and minutes, or minutes and seconds."""
    whole = max(int(seconds), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
