"""What every file parser returns, the protocol the file follower drives them through, what
`sidecar check` is told of a file's head or a pattern's files, and the settings of the run a
parser reads (`Settings`: config.Config has each, and no source imports config)."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class Parsed:
    """The outcome of parsing some bytes of one file."""

    __slots__ = ("consumed", "documents", "hparams", "invalid", "invalid_steps", "points",
                 "records", "skipped", "text", "unusable")

    def __init__(self, consumed: int, text: str = "",
                 points: list[dict[str, Any]] | None = None,
                 hparams: dict[str, Any] | None = None, records: int = 0, skipped: int = 0,
                 invalid: dict[str, int] | None = None, unusable: int = 0) -> None:
        # bytes taken from the front of the input; the rest is offered again later
        self.consumed = consumed
        self.text = text  # for /logs
        self.points = [] if points is None else points  # for /metrics
        self.hparams = hparams  # for /hparams
        self.records = records  # lines or records taken
        self.skipped = skipped  # bad lines or records, skipped and counted
        self.invalid = {} if invalid is None else invalid  # NaN/inf values per key, not sent
        # the step of the first NaN/inf value of each key in `invalid`, when the format has steps
        self.invalid_steps: dict[str, int] = {}
        # lines or values not sent (not JSON, no number, a key given twice): counted as invalid, as
        # NaN values are
        self.unusable = unusable
        # payloads for the route of the file's kind (its row in files/kinds.py), one a request
        self.documents: list[dict[str, Any]] = []


class Parser(Protocol):
    """Turns one file's bytes into payloads; pure, the caller supplies the clock."""

    def parse(self, data: bytes, now: float) -> Parsed:
        """Parse what is whole in `data` (bytes from the first unconsumed offset on)."""
        ...

    def quiet(self, data: bytes, now: float, final: bool = False) -> Parsed:
        """`data` has waited unconsumed for a quiet second: take it if the format allows.
        `final`: the file is not read again in this process (shutdown): hold nothing back."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-serialisable state to resume from with the offset after a restart."""
        ...


class Settings(Protocol):
    """What the kinds' parsers read of the run's configuration (sidecar.config.Config)."""

    @property
    def log_format(self) -> str: ...
    @property
    def log_ansi(self) -> str: ...
    @property
    def validation_map(self) -> tuple[str, ...]: ...
    @property
    def validation_samples(self) -> int | None: ...


class Head(NamedTuple):
    """What the head of one file gives, parsed as `watch` would (`sidecar check`)."""

    points: int
    not_finite: int  # NaN or infinite values, never sent
    problem: str  # the first bad line and what is wrong with it, or ""
    skipped: int = 0  # lines (or values) that gave no point: counted as invalid
    first_not_finite: str = ""  # the first NaN or infinite value: its key and step


class Survey(NamedTuple):
    """What `sidecar check` says of the files one pattern names."""

    status: str  # ok, warn, fail
    message: str  # after the option and the pattern
    details: dict[str, Any]
