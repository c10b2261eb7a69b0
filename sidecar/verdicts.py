"""What the shares of a window say, in words (docs/time.md#verdicts): the straggler, every local
rank waiting on another node, a rank that is input-bound, checkpoint saves that take the time.

Each verdict is judged on every window; it is said once it has held for two windows in a row
(one window is one save, one slow batch, an epoch's start), as one `[sidecar]` line with the
figures it rests on, and its end once when it stops holding. A balanced, healthy run holds none.

The thresholds, and why:
- straggler: the ranks that wait, at least half of the others, wait STRAGGLER_WAIT of their
  time or more in collectives (median), the straggler STRAGGLER_GAP less than each of them and
  STRAGGLER_RATIO times their median at most. Three gloo ranks, one 3x slower, gave 59-74 % against
  3 %; balanced, 0-15 % each (tests/test_timeshare.py), and 26-85 % each as busy ranks sharing
  two loaded cores.
- every local rank waits (a multi-node run only): each of this node's ranks waits REMOTE_WAIT or
  more and none is a straggler here: the rank they wait for is elsewhere, and the other nodes'
  `rank/<R>/time/collective/ratio` show which (the one that waits least).
- input-bound: a rank's main thread waits INPUT_BOUND or more of its time for its next batch:
  TensorFlow's profiler's "highly input-bound" (20 % of the step time waiting for input); a
  step could then be 1.25x faster, and 300 samples know the share to +-3 points.
- checkpoint: saves took CHECKPOINT_SHARE or more of the samples of the last CHECKPOINT_SPAN
  windows, all ranks together, judged once there are that many: a save of a minute every ten
  minutes, where a single window would only see one long save.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sidecar.log import log
from sidecar.shares import CHECKPOINT, COLLECTIVE, DATA
from sidecar.stall import ranges

if TYPE_CHECKING:
    from sidecar.timeshare import ShareWindow, Tally

MIN_SAMPLES = 30  # a rank with fewer in a window is not judged in it
STRAGGLER_WAIT = 0.25
STRAGGLER_GAP = 0.15
STRAGGLER_RATIO = 1 / 3
REMOTE_WAIT = 0.25
INPUT_BOUND = 0.20
CHECKPOINT_SHARE = 0.10
CHECKPOINT_SPAN = 10
HELD_WINDOWS = 2  # a verdict is said once it held this many windows in a row


def _median(values: Iterable[float]) -> float:
    """Not statistics.median: that module loads random, which a daemon does not need."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ranges(sorted(ranks)).replace(",", ", ")


def _hottest(tallies: list[Tally], category: str) -> str:
    """The function most of these ranks' samples of `category` were in: `all_reduce`."""
    places: Counter[str] = Counter()
    for tally in tallies:
        places.update(tally.places[category])
    if not places:
        return ""
    place = places.most_common(1)[0][0]
    return place.split(" <- ")[0].split(" (")[0]


class Verdicts:
    """Judges each window and says what held for two in a row, and when it stops."""

    def __init__(self, announce: Callable[[str], None], node: str, multi_node: bool,
                 gpus: Callable[[], str] = lambda: "no GPU") -> None:
        self.announce = announce  # a line for /logs
        self.node, self.multi_node = node, multi_node
        self.gpus = gpus  # the GPUs' utilisation in words, or "no GPU"
        self.held: dict[str, int] = {}  # verdict -> windows in a row it has held
        self.said: dict[str, str] = {}  # verdict -> its line, while said and holding
        self._recent: deque[ShareWindow] = deque(maxlen=CHECKPOINT_SPAN)

    @staticmethod
    def starving(window: ShareWindow) -> set[int]:
        """The ranks input-bound in `window`: the next window samples their workers too, so
        that the verdict says what the workers do."""
        return {rank for rank, tally in window.tallies.items()
                if tally.samples >= MIN_SAMPLES and tally.share(DATA) >= INPUT_BOUND}

    def lines(self) -> list[str]:
        """The verdicts said and holding now."""
        return list(self.said.values())

    def __call__(self, window: ShareWindow) -> None:
        self._recent.append(window)
        now = self.judge(window)
        for key in [k for k in self.held if k not in now]:
            del self.held[key]
        for key, line in now.items():
            self.held[key] = self.held.get(key, 0) + 1
            if self.held[key] >= HELD_WINDOWS and key not in self.said:
                self.said[key] = line
                self._say(line, warning=True)
        for key in [k for k in self.said if k not in now]:
            del self.said[key]
            self._say(self._ended(key, now), warning=False)

    def _say(self, line: str, *, warning: bool) -> None:
        (log.warning if warning else log.info)("%s", line)
        self.announce(f"[sidecar] {line}")

    def judge(self, window: ShareWindow) -> dict[str, str]:
        """The verdicts this window holds, each with its line."""
        tallies = {r: t for r, t in window.tallies.items() if t.samples >= MIN_SAMPLES}
        found: dict[str, str] = {}
        straggler = self._straggler(tallies)
        if straggler:  # by rank: another rank that takes its place is said anew
            found[f"straggler {straggler[0]}"] = straggler[1]
        elif self.multi_node:
            remote = self._remote(tallies)
            if remote:
                found["remote"] = remote
        bound = self._input_bound(window, tallies)
        if bound:
            found["input-bound"] = bound
        saves = self._checkpoint()
        if saves:
            found["checkpoint"] = saves
        return found

    def _gpu_words(self) -> str:
        gpus = self.gpus()
        return "" if gpus == "no GPU" else f"; {gpus}"

    def _straggler(self, tallies: dict[int, Tally]) -> tuple[int, str] | None:
        """The straggler's rank and its line, if there is one."""
        if len(tallies) < 2:
            return None
        rank, slow = min(tallies.items(), key=lambda item: item[1].share(COLLECTIVE))
        others = {r: t for r, t in tallies.items() if r != rank}
        waits = slow.share(COLLECTIVE)
        waiting = {r: t for r, t in others.items() if t.share(COLLECTIVE) >= waits + STRAGGLER_GAP}
        if 2 * len(waiting) < len(others):
            return None
        median = _median(t.share(COLLECTIVE) for t in waiting.values())
        if median < STRAGGLER_WAIT or waits > median * STRAGGLER_RATIO:
            return None
        where = _hottest(list(waiting.values()), COLLECTIVE)
        return rank, (f"rank {rank} is the straggler: {_ranks(list(waiting))} wait for it"
                      f"{' in ' + where if where else ''} {_pct(median)} of their time, rank "
                      f"{rank} waits {_pct(waits)}{self._gpu_words()}")

    def _remote(self, tallies: dict[int, Tally]) -> str:
        if not tallies or any(t.share(COLLECTIVE) < REMOTE_WAIT for t in tallies.values()):
            return ""
        shares = sorted(t.share(COLLECTIVE) for t in tallies.values())
        span = (_pct(shares[0]) if shares[0] == shares[-1] or len(shares) == 1
                else f"{100 * shares[0]:.0f}-{_pct(shares[-1])}")
        where = _hottest(list(tallies.values()), COLLECTIVE)
        return (f"every rank on this node ({self.node}: {_ranks(list(tallies))}) waits in "
                f"collectives{' (' + where + ')' if where else ''} {span} of its time: the "
                "rank they wait for is on another node, the one whose "
                "rank/<R>/time/collective/ratio in /hardware is lowest"
                f"{self._gpu_words()}")

    def _input_bound(self, window: ShareWindow, tallies: dict[int, Tally]) -> str:
        bound = {r: t for r, t in tallies.items() if t.share(DATA) >= INPUT_BOUND}
        if not bound:
            return ""
        shares = [t.share(DATA) for t in bound.values()]
        waits = _pct(shares[0]) if len(shares) == 1 else f"{_pct(_median(shares))} " \
                                                           "(median)"
        where = _hottest(list(bound.values()), DATA)
        count = sum(window.workers.get(r, (0, 0.0))[0] for r in bound)
        cores = sum(window.workers.get(r, (0, 0.0))[1] for r in bound)
        workers = (f"its {count} data-loader worker process{'es' if count > 1 else ''} use "
                   f"{cores:.1f} core{'s' if cores >= 1.5 else ''} of CPU"
                   if count else "it loads its batches in its main process (no worker process)")
        places: Counter[str] = Counter()
        for tally in bound.values():
            places.update(tally.workers)
        if places:
            place, seen = places.most_common(1)[0]
            workers += f", their main threads most in {place} ({_pct(seen / places.total())})"
        verb = "is" if len(bound) == 1 else "are"
        return (f"{_ranks(list(bound))} {verb} input-bound: the main thread waits for its next "
                f"batch{' in ' + where if where else ''} {waits} of its time; {workers}"
                f"{self._gpu_words()}")

    def _checkpoint(self) -> str:
        if len(self._recent) < CHECKPOINT_SPAN:  # the run's first save is no share of its time
            return ""
        total = saving = 0
        ranks: set[int] = set()
        places: list[Tally] = []
        for window in self._recent:
            for rank, tally in window.tallies.items():
                total += tally.samples
                saving += tally.counts[CHECKPOINT]
                if tally.counts[CHECKPOINT]:
                    ranks.add(rank)
                    places.append(tally)
        if not total or saving / total < CHECKPOINT_SHARE:
            return ""
        span_s = sum(w.length_s for w in self._recent)
        where = _hottest(places, CHECKPOINT)
        return (f"checkpoint saves took {_pct(saving / total)} of the time of "
                f"{_ranks(sorted(ranks))} over the last {span_s:.0f} s"
                f"{' (in ' + where + ')' if where else ''}")

    def _ended(self, key: str, now: dict[str, str]) -> str:
        """The line that says a verdict no longer holds; `now`: those that hold."""
        if key.startswith("straggler "):
            rank = key.split()[1]
            if any(k.startswith("straggler ") for k in now):
                return f"rank {rank} is no longer the straggler"
            return "no rank is the straggler any more: the ranks wait for each other alike"
        if key == "remote":
            return "this node's ranks no longer all wait on another node"
        if key == "input-bound":
            return (f"no rank is input-bound any more: the main threads wait less than "
                    f"{_pct(INPUT_BOUND)} of their time for their batches")
        return (f"checkpoint saves take less than {_pct(CHECKPOINT_SHARE)} of the time again "
                f"(the last {sum(w.length_s for w in self._recent):.0f} s)")
