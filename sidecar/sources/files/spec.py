"""What a run asks the follower to follow: a kind of file, the patterns that name its files and
how to parse one (follow.py follows them; scan.py looks for them; tail.py reads one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from sidecar.records import LOG_BLOCK
from sidecar.sources.base import Parser
from sidecar.sources.files import discover


class SourceSpec(NamedTuple):
    """A kind of file to follow: which paths, and how to make a parser for one file."""

    kind: str  # "log", "jsonl", "tensorboard"
    patterns: tuple[str, ...]  # paths and globs; with `tree`, folders searched at any depth
    make_parser: Callable[[Path, dict[str, Any]], Parser]  # (path, saved state) -> parser
    # bytes handed to the parser at once: the granularity of acknowledgement, so of what a crash can
    # repeat
    parse_bytes: int = LOG_BLOCK
    option: str = ""  # the option that named the patterns, for messages: "--log"
    tree: str = ""  # a file-name glob: each pattern is a folder holding such files at any depth
    # why a file's parser gave no point yet, given the bytes it holds unparsed; None: not asked
    silence: Callable[[Parser, int], str] | None = None

    def names(self) -> list[str]:
        """The paths the patterns name now."""
        return [name for pattern in self.patterns
                for name in discover.match(pattern, self.option, self.kind, self.tree)[0]]
