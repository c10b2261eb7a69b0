"""`sidecar profile`: every rank of the command a running `sidecar run` or `watch` looks after,
sampled for N seconds from outside, never paused: where each one's time went and the hottest
frames of each category, ranks in the same place grouped (docs/time.md#on-demand).

The daemon samples (it is the ranks' parent, allowed to read them), at 50 samples a second for
each rank and each of its data-loader workers; this command asks its status endpoint for
/profile?seconds=N, found as `sidecar status` finds it, and prints the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.commands import print_out
from sidecar.commands.stacks import _fetch
from sidecar.commands.status import Ambiguous, NoAnswer, choose
from sidecar.exits import EXIT_AMBIGUOUS, EXIT_CANNOT_LOOK, EXIT_NO_ANSWER, EXIT_OK
from sidecar.shares import CATEGORIES
from sidecar.stall import ranges

COLUMNS = ("compute", "data", "collective", "checkpoint")  # the order a table shows them
FETCH_SLACK_S = 30.0  # beyond the seconds sampled: the ranks found, py-spy started and read


def profile_command(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    from sidecar.observe.endpoint import MAX_PROFILE_S  # the bound the daemon holds it to

    if not 1 <= args.seconds <= MAX_PROFILE_S:
        print(f"sidecar profile: --seconds {args.seconds}: give 1 to {MAX_PROFILE_S}",
              file=sys.stderr)
        return EXIT_AMBIGUOUS
    try:
        address, _ = choose(args, environ)
    except Ambiguous as exc:
        print(f"sidecar profile: {exc}", file=sys.stderr)
        return EXIT_AMBIGUOUS
    except NoAnswer as exc:
        print(f"sidecar profile: {exc}", file=sys.stderr)
        return EXIT_NO_ANSWER
    try:
        doc = _fetch(address, f"/profile?seconds={args.seconds}", args.seconds + FETCH_SLACK_S)
    except NoAnswer as exc:
        print(f"sidecar profile: {exc}", file=sys.stderr)
        return EXIT_CANNOT_LOOK
    if args.json:
        print_out(json.dumps(doc, indent=2))
    else:
        print_out("\n".join(render_profile(doc, address)))
    return EXIT_OK


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %"


def render_profile(doc: Mapping[str, Any], address: str) -> list[str]:
    """The table of shares, a row a rank, then the hottest frames by category."""
    ranks = list(doc.get("ranks", ()))
    lines = [f"where the time of {len(ranks)} rank{'s' if len(ranks) != 1 else ''} went over "
             f"{doc.get('window_s')} s ({doc.get('rate_hz')} samples a second each, read from "
             f"outside by the daemon at {address}, never pausing them):"]
    header = ("RANK", "SAMPLES", *(c.upper() for c in COLUMNS), "WORKERS")
    rows = [header]
    for rank in ranks:
        if rank.get("error") and not rank.get("samples"):
            rows.append((str(rank["rank"]), "-", f"({rank['error']})", "", "", "", ""))
            continue
        workers = (f"{rank.get('workers_count', 0)} ({rank.get('workers_cores', 0.0):.1f} cores)"
                   if rank.get("workers_count") else "-")
        rows.append((str(rank["rank"]), str(rank.get("samples", 0)),
                     *(_pct(rank["shares"].get(c, 0.0)) for c in COLUMNS), workers))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
              for row in rows]
    lines.append("hottest frames, by where the time went (share of each rank's samples):")
    for category in CATEGORIES[::-1]:
        grouped = _grouped([(r["rank"], r.get("hottest", {}).get(category, ())) for r in ranks])
        if grouped:
            lines.append(f"  {category}:")
            lines += [f"    {line}" for line in grouped]
    in_workers = _grouped([(r["rank"], r.get("workers", ())) for r in ranks])
    if in_workers:
        lines.append("  the data-loader workers (share of their samples):")
        lines += [f"    {line}" for line in in_workers]
    return lines


def _grouped(by_rank: Sequence[tuple[int, Sequence[Sequence[Any]]]]) -> list[str]:
    """`ranks 0, 2: all_reduce <- step (trainer.py:17) 66-69 %`: a place, the ranks it is among
    the hottest of, their shares; the places by their largest share."""
    places: dict[str, list[tuple[int, float]]] = {}
    for rank, hottest in by_rank:
        for place, share in hottest:
            places.setdefault(str(place), []).append((int(rank), float(share)))
    lines = []
    for place, found in sorted(places.items(), key=lambda item: -max(s for _, s in item[1])):
        ranks = sorted(r for r, _ in found)
        low, high = min(s for _, s in found), max(s for _, s in found)
        share = _pct(high) if round(100 * low) == round(100 * high) else \
            f"{100 * low:.0f}-{_pct(high)}"
        who = ("rank " if len(ranks) == 1 else "ranks ") + ranges(ranks).replace(",", ", ")
        lines.append(f"{who}: {place}  {share}")
    return lines


def main(args: argparse.Namespace) -> int:
    """`sidecar profile`."""
    from sidecar.config import warn_unknown_variables
    from sidecar.log import setup

    setup()
    warn_unknown_variables()
    return profile_command(args)
