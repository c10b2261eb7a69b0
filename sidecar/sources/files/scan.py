"""Looking for the files every source names (issue: file sources), as in_tail's
tail_scan_glob.c: the regular files the patterns name now (discover.py matches one pattern), a
line when what a pattern names changes and a WARNING when one still names nothing a while after
the start, the folders to watch so that new files are noticed, and whether a changed path may be
one to follow."""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from sidecar.log import log
from sidecar.sources.files import discover

if TYPE_CHECKING:
    from sidecar.sources.files.spec import SourceSpec

MAX_FITS_CACHED = 4096  # paths remembered as fitting a pattern or not
NOTHING_MATCHED_WARN_S = 60.0  # a source still matching nothing this long after start: WARNING


class MatchState(NamedTuple):
    """What one pattern of one source names, for the status endpoint."""

    source: str  # the option and the pattern: "--jsonl out/*.jsonl"
    files: int
    note: str  # why there are none ("the folder out does not exist yet"), or ""


class Scan:
    """What the patterns of `specs` name, look after look."""

    def __init__(self, specs: Sequence[SourceSpec]) -> None:
        self.specs = specs
        self._matches: dict[str, MatchState] = {}
        self._warned: set[str] = set()
        self._started = time.monotonic()
        self._fits: dict[str, bool] = {}  # path -> whether it fits a pattern (may_follow)

    def look(self) -> dict[str, tuple[SourceSpec, os.stat_result]]:
        """The regular files the patterns name now, by path, each with the first spec that
        names it and its stat; what each pattern names is reported (`matches`)."""
        found: dict[str, tuple[SourceSpec, os.stat_result]] = {}
        for spec in self.specs:
            for pattern in spec.patterns:
                names, note = discover.match(pattern, spec.option, spec.kind, spec.tree)
                files = 0
                for name in names:
                    try:
                        st = os.stat(name)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        files += 1
                        found.setdefault(name, (spec, st))
                self._report(spec, pattern, files, note)
        return found

    def matches(self) -> list[MatchState]:
        """What each pattern of each source names, for the status endpoint."""
        return list(self._matches.values())

    def _report(self, spec: SourceSpec, pattern: str, files: int, note: str) -> None:
        """Say what a pattern names when that changes; WARNING once if it still names nothing
        a while after the start."""
        source = f"{spec.option} {pattern}".strip()
        now = MatchState(source, files, note)
        if self._matches.get(source) != now:
            self._matches[source] = now
            if files:
                log.info("%s: %d file%s", source, files, "" if files == 1 else "s",
                         extra={"source": spec.kind, "path": pattern})
            else:
                level = logging.WARNING if note.startswith("is a") else logging.INFO
                log.log(level, "%s: %s", source, note, extra={"source": spec.kind, "path": pattern})
        waited = time.monotonic() - self._started
        if not files and source not in self._warned and waited >= NOTHING_MATCHED_WARN_S:
            self._warned.add(source)
            log.warning("%s: still nothing to read after %.0f s (%s)", source,
                        NOTHING_MATCHED_WARN_S, note, extra={"source": spec.kind, "path": pattern})

    def roots(self) -> set[str]:
        """The folders to watch for every pattern (discover.watch_roots)."""
        return set().union(*(_roots(spec) for spec in self.specs))

    def watch_folders(self) -> list[str]:
        """The folders to watch: each pattern's roots, and every folder below a root whose
        pattern recurses (`**`, TensorBoard run folders), so new files anywhere in them are
        noticed."""
        folders: list[str] = []
        for spec in self.specs:
            recursive = bool(spec.tree) or any("**" in pattern for pattern in spec.patterns)
            for root in sorted(_roots(spec)):
                # A parent watched until the pattern's folder appears is watched alone, never
                # the tree below it: a recursive watch of a large tree costs more than polling.
                if recursive and root in _fixed_folders(spec):
                    folders.extend(str(folder) for folder in discover.folders(Path(root)))
                else:
                    folders.append(root)
        return folders

    def may_follow(self, path: str) -> bool:
        """Whether a file at `path` (absolute) may be one to follow: its name fits a pattern
        (fnmatch's `*` crosses folders, so this errs towards a look, never away from one).
        A trainer's other files in a followed folder then cost no look when they grow."""
        fits = self._fits.get(path)
        if fits is None:
            name = os.path.basename(path)
            fits = any(
                fnmatch.fnmatch(name, spec.tree) if spec.tree and not os.path.isfile(pattern)
                else fnmatch.fnmatch(path, os.path.abspath(pattern))
                for spec in self.specs for pattern in spec.patterns)
            if len(self._fits) >= MAX_FITS_CACHED:
                self._fits.clear()
            self._fits[path] = fits
        return fits


def _roots(spec: SourceSpec) -> set[str]:
    return discover.watch_roots(_globs(spec))


def _fixed_folders(spec: SourceSpec) -> set[str]:
    return {str(discover.fixed_folder(pattern)) for pattern in _globs(spec)}


def _globs(spec: SourceSpec) -> list[str]:
    """The patterns as globs: a `tree` spec's folder as the files of its name in it (a file
    given where its kind takes one stays itself)."""
    if not spec.tree:
        return list(spec.patterns)
    return [p if os.path.isfile(p) else str(Path(p) / spec.tree) for p in spec.patterns]
