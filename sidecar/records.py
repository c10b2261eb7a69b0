"""What sources and delivery share: the acknowledgement ticket, the routes' timestamp form, the
size of a block of log text and the most points a /metrics request carries.

A source hands items to delivery with a `Ticket`; the ingest's 2xx releases it, and the source
then commits its offset (docs/ingest.md#at-least-once). Neither imports the other: both import this.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

# bytes a followed file is read by at once, and characters a /logs request carries: a block of plain
# lines goes as one request, its JSON body under 1 MiB (nginx's default client_max_body_size),
# without a cut
LOG_BLOCK = 960 << 10

# points one /metrics request carries at most (docs/ingest.md#limits): the batcher cuts there, a big
# node's telemetry sample is split there, and `sidecar receive` refuses more
MAX_POINTS_PER_REQUEST = 2048


def iso_ts(epoch_s: float) -> str:
    """An ISO-8601 UTC timestamp as the routes carry it."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat()


class Ticket:
    """Counts outstanding parts of one unit of work; calls `on_done` when the last is acked."""

    def __init__(self, on_done: Callable[[], None] | None = None) -> None:
        self._outstanding = 1  # the creator's own hold, released by seal()
        self._on_done = on_done

    def hold(self) -> Ticket:
        self._outstanding += 1
        return self

    def release(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0 and self._on_done is not None:
            self._on_done()

    def seal(self) -> None:
        """The creator handed out every part: done once those are acknowledged."""
        self.release()
