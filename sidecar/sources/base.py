"""What every file parser returns, and the protocol the file follower drives them through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Parsed:
    """The outcome of parsing some bytes of one file."""

    consumed: int  # bytes taken from the front of the input; the rest is offered again later
    text: str = ""  # for /logs
    points: list[dict[str, Any]] = field(default_factory=list)  # for /metrics
    hparams: dict[str, Any] | None = None  # for /hparams
    records: int = 0  # lines or records taken
    skipped: int = 0  # bad lines or records, skipped and counted
    invalid: dict[str, int] = field(default_factory=dict)  # NaN/inf values per key, not sent


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
