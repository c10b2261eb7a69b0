"""Operator commands other than run and watch, each loaded by `cli.py` only when it runs."""

from __future__ import annotations

import os
import sys
from typing import TextIO


def print_out(text: str, out: TextIO | None = None) -> None:
    """Print a line of a command's report; when the reader has gone (`| head -1`, `| grep -q`),
    the rest goes to /dev/null so that the command still finishes and exits with its verdict,
    as a Unix tool would, instead of ending in a BrokenPipeError."""
    out = sys.stdout if out is None else out
    try:
        print(text, file=out, flush=True)
    except BrokenPipeError:
        discard(out)


def discard(out: TextIO) -> None:
    """Point `out`'s descriptor at /dev/null (what it held is lost: its reader left)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, out.fileno())
    os.close(devnull)
