"""`--hparams FILE`: a config flattened with dots for /hparams (docs/ingest.md#hyperparameters).

The trainer often writes the file itself once it starts (Hydra's `.hydra/config.yaml`,
Lightning's `hparams.yaml`): it is waited for, as a --log or --jsonl file is, read once a writer
has left it alone for a moment, and sent again whenever its content changes (/hparams upserts).
A file that cannot be read as a config is said in one WARNING a version and never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.exits import ConfigError
from sidecar.log import log
from sidecar.supervise import fault_point
from sidecar.threads import off_loop

Scalar = str | int | float | bool | None
POLL_S = 1.0  # how often the file is looked at
SETTLE_S = 0.5  # a file modified less than this long ago may be half-written: read it later
READ_TIMEOUT_S = 10.0  # a read that hangs (a dead NFS mount) is given up, and tried again later
WAITING_SAID_AFTER_S = 60.0  # a file still missing this long after start gets one INFO


class HparamsFile:
    """Follows one --hparams file: `push` gets its flattened content each time it changes."""

    __slots__ = ("_failed", "_push", "_said_waiting", "_seen", "_sent", "_started", "path")

    def __init__(self, path: Path, push: Callable[[dict[str, Scalar]], None]) -> None:
        self.path = path
        self._push = push
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) last read
        self._sent: dict[str, Scalar] | None = None
        self._failed = ""  # the last version's error, said once
        self._said_waiting = False
        self._started = time.monotonic()

    async def run(self) -> None:
        """Look at the file every POLL_S until cancelled."""
        while True:
            fault_point()
            await self.check()
            await asyncio.sleep(POLL_S)

    async def check(self, final: bool = False) -> None:
        """Send the file's content if it is new; `final` (shutdown): read it even if it was
        modified a moment ago."""
        try:
            st = os.stat(self.path)
        except OSError:
            if final and self._sent is None:
                log.warning("--hparams %s never appeared in this run: nothing of it was sent; "
                            "check the path the trainer writes its config to", self.path,
                            extra={"source": "hparams", "path": self.path})
            elif not self._said_waiting and (
                    time.monotonic() - self._started >= WAITING_SAID_AFTER_S):
                self._said_waiting = True
                log.info("--hparams %s does not exist yet; it is sent once it appears", self.path,
                         extra={"source": "hparams", "path": self.path})
            return
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        if version == self._seen or (not final and time.time() - st.st_mtime < SETTLE_S):
            return
        try:
            params = await off_loop(lambda: load_hparams(self.path), READ_TIMEOUT_S, "hparams")
        except TimeoutError:
            return  # tried again at the next look
        except ConfigError as exc:
            self._seen = version
            if str(exc) != self._failed:
                self._failed = str(exc)
                log.warning("%s; it is sent once it can be read (the run goes on)", exc,
                            extra={"source": "hparams", "path": self.path})
            return
        self._seen, self._failed = version, ""
        if params == self._sent:
            return
        again = self._sent is not None
        self._sent = params
        self._push(params)
        log.info("--hparams %s: %d parameter%s sent%s", self.path, len(params),
                 "" if len(params) == 1 else "s", " again: the file changed" if again else "",
                 extra={"source": "hparams", "path": self.path})


def load_hparams(path: Path) -> dict[str, Scalar]:
    """Read and flatten `path`; ConfigError naming the file when it cannot be used."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--hparams {path}: cannot read it ({exc.strerror})") from None
    data = _parse(path, raw)
    if not isinstance(data, dict):
        raise ConfigError(f"--hparams {path}: the top level is a {type(data).__name__}, "
                          "not a mapping of names to values")
    try:
        return flatten(data)
    except RecursionError:
        raise ConfigError(f"--hparams {path}: nested too deeply, or a YAML alias refers to "
                          "itself") from None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested mappings and lists as dotted keys (`optimizer.lr`, `layers.0`); NaN/inf dropped."""
    flat: dict[str, Scalar] = {}
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict | list | tuple):
            flat.update(flatten(value, name + "."))  # type: ignore[arg-type]
        elif isinstance(value, float) and not math.isfinite(value):
            continue
        elif isinstance(value, str | int | float | bool) or value is None:
            flat[name] = value
        else:
            flat[name] = str(value)  # YAML dates and the like
    return flat


def _parse(path: Path, raw: bytes) -> Any:
    suffix = path.suffix.lower()
    kind = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}.get(suffix, "JSON")
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(raw.decode("utf-8"))
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--hparams {path}: not valid {kind} ({exc})") from None
    except RecursionError:
        raise ConfigError(f"--hparams {path}: {kind} nested too deeply to read") from None
    except Exception as exc:  # yaml.YAMLError and its kin
        raise ConfigError(f"--hparams {path}: not valid {kind} ({_one_line(exc)})") from None


def _one_line(exc: Exception) -> str:
    """A parser's error on one line: YAML's spans four (the problem, where in a `<byte
    string>`, what it was scanning, where that began), said here as problem and place."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        context, began = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        said = f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
        if context and began is not None:
            said += f", {context} begun at line {began.line + 1}, column {began.column + 1}"
        return said
    return " ".join(str(exc).split())
