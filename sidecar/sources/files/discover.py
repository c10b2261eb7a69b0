"""Which files a source's patterns name right now, and, when none, why (issue: file sources).

A pattern is a path, a glob (`*`, `?`, `[...]`; `**` for any depth of folders), or for a
`tree` kind (TensorBoard) a folder searched at any depth for its files, or one file of the
tree's name (an event file), or, for a kind that takes one file too (samples of validation
rounds), any file. Folders are searched following
symbolic links, each folder once by device and inode: a link back up the tree (`loop/self ->
..`) is not followed again, so no file is found twice under a longer name.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from sidecar.sources.files.kinds import file_too, folder_hint


def match(pattern: str, option: str, kind: str, tree: str = "") -> tuple[list[str], str]:
    """The paths `pattern` names (sorted), and when there are none a short note saying why.
    `tree`: a name glob; then `pattern` is a folder whose files of that name are wanted."""
    path = Path(pattern)
    if tree:
        if path.is_dir():
            names = sorted(str(p) for p in files_matching(path, tree))
            return names, "" if names else f"no {tree} file under it yet"
        if names_one_file(pattern, kind, tree):
            return ([pattern], "") if path.exists() else ([], _missing(path))
        if path.exists():
            return [], (f"is a file not named {tree}; {option} takes the folder the event "
                        f"files are written to (here {path.parent}) or one of them")
        return [], _missing(path, "folder")
    if glob.has_magic(pattern):
        names = _glob(pattern)
        if names:
            return names, ""
        fixed = fixed_folder(pattern)
        return [], "nothing matches yet" if fixed.is_dir() else _missing(fixed / "x")
    if path.is_dir():
        return [], (f"is a folder; {option} takes files (a glob such as "
                    f"{path / folder_hint(kind)})")
    if path.exists():
        return [pattern], ""
    return [], _missing(path)


def names_one_file(pattern: str, kind: str, tree: str) -> bool:
    """Whether a pattern of the `tree` kind `kind` names one file rather than a folder to
    search: a file of the tree's name (an event file given as --tensorboard), there or not yet,
    or any file for a kind that takes one."""
    path = Path(pattern)
    if path.is_dir():
        return False
    return fnmatch.fnmatchcase(path.name, tree) or (file_too(kind) and path.exists())


def tree_root(pattern: str, kind: str, tree: str) -> Path:
    """The folder below which a `tree` kind's files are named (TensorBoard's keys carry the
    path below it): the pattern itself, or the folder of the one file it names."""
    path = Path(pattern)
    return path.parent if names_one_file(pattern, kind, tree) else path


def _missing(path: Path, what: str = "file") -> str:
    """Why `path`, a `what` ("file" or "folder") not there, names nothing yet."""
    return f"no such {what} yet" if path.parent.is_dir() else \
        f"the folder {path.parent} does not exist yet"


def fixed_folder(pattern: str) -> Path:
    """The deepest folder of `pattern` without a wildcard in it."""
    fixed = Path(pattern).parent
    while glob.has_magic(str(fixed)):
        fixed = fixed.parent
    return fixed


def _glob(pattern: str) -> list[str]:
    if "**" not in pattern:
        return sorted(glob.glob(pattern))
    root = fixed_folder(pattern)
    parts = Path(pattern).relative_to(root).parts
    return sorted(str(p) for p in files_matching(root, "*")
                  if _match_parts(p.relative_to(root).parts, parts))


def _match_parts(names: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether a relative path matches glob components, `**` standing for any folders."""
    if not parts:
        return not names
    if parts[0] == "**":
        return any(_match_parts(names[i:], parts[1:]) for i in range(len(names) + 1))
    return bool(names) and fnmatch.fnmatchcase(names[0], parts[0]) and _match_parts(
        names[1:], parts[1:])


def folders(root: Path) -> Iterator[Path]:
    """`root` and every folder below it, symbolic links followed, each folder once."""
    seen: set[tuple[int, int]] = set()

    def first_visit(path: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        key = (st.st_dev, st.st_ino)
        if key in seen:
            return False
        seen.add(key)
        return True

    if not first_visit(str(root)):
        return
    for dirpath, dirnames, _ in os.walk(root, followlinks=True):
        dirnames[:] = [name for name in dirnames if first_visit(os.path.join(dirpath, name))]
        yield Path(dirpath)


def files_matching(root: Path, name_glob: str) -> Iterator[Path]:
    """The files named like `name_glob` in `root` and every folder below it (see folders)."""
    for folder in folders(root):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if fnmatch.fnmatchcase(entry.name, name_glob) and not _is_dir(entry):
                yield folder / entry.name


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def watch_roots(patterns: Iterable[str]) -> set[str]:
    """The folders to watch for `patterns`: each one's fixed folder, or while it does not exist
    yet its nearest existing parent, where the next folder of the path will appear."""
    roots = (nearest_folder(fixed_folder(pattern)) for pattern in patterns)
    return {str(root) for root in roots if root is not None}


def nearest_folder(path: Path) -> Path | None:
    """`path` if it is a folder, else its nearest parent that is; None when none is (a file in
    the way)."""
    while not path.is_dir():
        if path.exists() or path == path.parent:
            return None
        path = path.parent
    return path
