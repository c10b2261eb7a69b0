"""Summarise a py-spy raw profile (collapsed stacks): where the samples are, by function.

    python tests/bench/profile_summary.py PROFILE.txt [--top 25] [--idle]

A benchmark run with `--profile DIR` attaches `py-spy record --format raw --threads` to the
sidecar and writes DIR/<name>.txt. This prints, per thread, the share of samples spent in each
function itself (self) and below it (inclusive). Samples in which a thread is waiting (py-spy
omits idle frames unless --idle was given to it) are not in the file, so shares are of the
busy samples.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<where>[^()]*)\)$")


def frame_name(frame: str) -> str:
    """`func (path/file.py:line)` -> `func (file.py)`: lines of one function added together."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    where = match["where"].rsplit(":", 1)[0]
    return f"{match['func']} ({'/'.join(where.split('/')[-2:])})"


def summarise(path: Path, top: int) -> None:
    self_time: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        thread, *frames = stack.split(";")
        thread = re.sub(r"\(\d+\)", "", thread).strip()
        totals[thread] += count
        names = [frame_name(f) for f in frames]
        if names:
            self_time[thread][names[-1]] += count
        for name in set(names):
            inclusive[thread][name] += count
    for thread, total in totals.most_common():
        print(f"== {thread}: {total} samples")
        print("   self%  incl%  function")
        ranked = sorted(inclusive[thread], key=lambda n: (-self_time[thread][n],
                                                          -inclusive[thread][n]))
        for name in ranked[:top]:
            print(f"  {100 * self_time[thread][name] / total:6.1f} "
                  f"{100 * inclusive[thread][name] / total:6.1f}  {name}")


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("profile", type=Path)
    options.add_argument("--top", type=int, default=25)
    args = options.parse_args()
    summarise(args.profile, args.top)


if __name__ == "__main__":
    main()
