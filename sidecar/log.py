"""The sidecar's own messages: stderr, one line an event, text or JSON, secrets masked."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from sidecar.masking import mask, mask_doc
from sidecar.process import held

log = logging.getLogger("sidecar")


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        line = f"{when[:-4]}Z sidecar {record.levelname} {record.getMessage()}"
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        return mask(line)


# What a message concerns, given where it is written as `log.warning(..., extra={"route":
# "metrics"})` (a structlog event's fields): the command it stops, the route it is about (as the
# ingest names it: "metrics", "artifact/upload-url"), the source (an option's name without its
# dashes: "jsonl", "checkpoints") and its file or pattern, an option, a variable. JSON messages
# carry each one given; text messages name them in their words.
EXTRA_FIELDS = ("command", "route", "source", "path", "option", "variable")


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
            **{name: str(getattr(record, name)) for name in EXTRA_FIELDS if hasattr(record, name)},
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(mask_doc(doc), ensure_ascii=False)


THROTTLE_PRUNE_FROM = 1024  # messages remembered before those of no use are forgotten


class Throttle:
    """Lets a repeated message through once per `interval_s`, counting the ones it held back."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._prune_at = THROTTLE_PRUNE_FROM

    def forget(self) -> None:
        """Every message let through again, as at start."""
        self._last.clear()
        self._held.clear()

    def admit(self, key: str) -> int | None:
        """None to stay quiet; else how many were held back since the last admitted one."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        if len(self._last) > self._prune_at:
            self._prune(now)
        return self._held.pop(key, 0)

    def _prune(self, now: float) -> None:
        """Forget the messages whose interval is over and that hold nothing back: each message
        that differs (a count, a key in it) would otherwise be remembered for the whole run."""
        self._last = {key: at for key, at in self._last.items()
                      if now - at < self.interval_s or key in self._held}
        self._prune_at = max(THROTTLE_PRUNE_FROM, 2 * len(self._last))


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
held(_state_dir_trouble.forget)


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


def one_destination(fd: int, other: int) -> bool:
    """Whether output written to `fd` and to `other` lands in one place: the same terminal or
    device (/dev/null), or the same file, pipe or socket (`>all.log 2>&1`, `2>&1 | tee`)."""
    try:
        first, second = os.fstat(fd), os.fstat(other)
    except OSError:
        return False
    if stat.S_ISCHR(first.st_mode) and stat.S_ISCHR(second.st_mode):
        return first.st_rdev == second.st_rdev
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _is_device(fd: int) -> bool:
    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode)
    except OSError:
        return False


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
        if not os.isatty(fd) and _is_device(fd):
            return False
        return one_destination(fd, 2)

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
held(open_line.close)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "\n" + text if open_line.close() else text


# `extra` of the few INFO messages that are said at a terminal too (`--log-level auto`): the one
# that says what the sidecar does before the command's output, and the one at its end
BRIEF = {"brief": True}


class _Brief(logging.Filter):
    """At a terminal, by default: warnings and errors, and the messages marked BRIEF."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(record, "brief", False)


def brief() -> bool:
    """Whether the sidecar's messages are the brief ones alone (a terminal, `--log-level
    auto`): what `setup` installed says so."""
    return any(isinstance(f, _Brief) for handler in log.handlers for f in handler.filters)


def setup(level: str = "info", message_format: str = "text",
          context: Mapping[str, str] | None = None) -> None:
    """Send the sidecar's messages to stderr at `level`, as text lines or JSON objects; each
    JSON one carries `context` (the run id and the node) as fields. `auto`: info, but at a
    terminal only warnings, errors and the BRIEF messages: a person watching the command's
    output reads it, not ours (docs/commands.md#its-own-messages)."""
    handler = _Handler(sys.stderr)
    handler.addFilter(_RepeatFilter())
    if level == "auto" and sys.stderr.isatty():
        handler.addFilter(_Brief())
    handler.setFormatter(_JsonFormatter(context) if message_format == "json"
                         else _TextFormatter())
    log.handlers[:] = [handler]
    log.setLevel("INFO" if level == "auto" else level.upper())
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
