"""`--checkpoints DIR`: every model checkpoint written anywhere under DIR, handed on once it is
complete, and never before.

A look walks each folder (in a thread): a folder a writer names or fills like a checkpoint
(checkpoint_formats.py) is one candidate, as is a checkpoint file lying on its own; symbolic
links and `last.ckpt` are aliases, work-in-progress names are passed over. A candidate is
judged once none of its files changed size or modification time between two looks
`quiet_s` apart (longer on a network filesystem); then its writer's marker and the structure of
its files decide. What is complete is handed to `register` with a fingerprint (its marker's
identity, else its files'), which `known` remembers across restarts: a checkpoint is handed on
once, and again only when it is rewritten. Looks are made when inotify says a folder changed,
while a candidate is settling, and otherwise once every `SAFETY_LOOK_S`: a folder at rest costs
one walk a minute.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from sidecar.aio import wait_set
from sidecar.log import Throttle, log
from sidecar.masking import holds_secret
from sidecar.sources.files.checkpoint_formats import (
    Assessment,
    Shape,
    assess,
    file_shape,
    folder_shape,
    is_alias_name,
    marker_identity,
    object_name_problem,
    work_in_progress,
)
from sidecar.sources.files.inotify import Inotify, filesystem_of, is_remote
from sidecar.sources.files.writers import open_for_writing
from sidecar.supervise import fault_point

QUIET_S = 2.0  # no file of a candidate changed for this long, over two looks: it settled
EXPORT_QUIET_FACTOR = 5.0  # an HF export: 10 s (its tokenizer lands 4 s after its weights)
REMOTE_QUIET_S = 30.0  # on NFS and the like, where attributes are cached and no event arrives
REMOTE_LOOK_S = 10.0  # how often a folder on a network filesystem is walked
SAFETY_LOOK_S = 60.0  # with inotify: a walk even without events (a watch lost, a full queue)
EVENT_SETTLE_S = 0.5  # after an event, more usually follow: one walk for the lot
# While a save streams events, walks are spaced by this many times the CPU the last one took:
# a walk of a large tree (10,000 files: tens of ms) then costs at most 1 % of a core.
WALK_SPACING = 100.0
MIN_LOOK_S = 0.05
WALK_LIMIT_S = 30.0  # one walk of a folder at most: SIGTERM waits for no longer
MISSING_LOOK_S = 1.0  # while a --checkpoints folder does not exist yet (its parent's events too)
MAX_NAMED_AT_EXIT = 20  # candidates named one a line at the exit; the rest counted
CONTAINER_HINT = "--artifact-uri"
UPLOAD_HINT = "--checkpoint-upload auto or always"
# An export saved into a folder that also holds the run's checkpoints (the Trainer's final
# save_model into output_dir): its own files are the export, its folders are looked into.
FLAT_FORMATS = frozenset({"hf", "accelerate"})
# What a path segment may hold as it is (RFC 3986's pchar, but the unreserved, which are always
# kept): anything else is percent-encoded in a mapped URI.
URI_PATH_SAFE = "/:@!$&'()*+,;="


class Found(NamedTuple):
    """A complete checkpoint, as `register` receives it."""

    artifact_path: str  # what /artifact's `path` says: the mapped URI, or the local path
    local: str  # absolute, local: with the fingerprint, its identity
    kind: str
    format: str
    step: int | None
    size_bytes: int
    fingerprint: str
    root: str  # the --checkpoints folder it lies under
    files: tuple[str, ...]  # relative to `local`; empty for a checkpoint that is one file
    upload: bool  # unmapped: to be uploaded, `artifact_path` is then its local path


class Candidate:
    """One candidate: what it is, what it looked like at the last look, where it stands."""

    __slots__ = (
        "files",
        "fingerprint",
        "path",
        "registered_as",
        "root",
        "seen_at",
        "shape",
        "signature",
        "size",
        "state",
        "why",
    )

    def __init__(self, path: str, root: str, shape: Shape) -> None:
        self.path = path
        self.root = root
        self.shape = shape
        self.files: tuple[str, ...] = ()
        self.signature = ""
        self.size = 0
        self.seen_at = 0.0  # when the signature last changed (monotonic)
        # waiting; complete: handed on, to be registered (mapped) or uploaded, then
        # registered (delivery/upload.py); skipped
        self.state = "waiting"
        self.why = "changing"
        self.fingerprint = ""
        # the step and size it was registered with by this start (None: not registered)
        self.registered_as: tuple[int | None, int] | None = None


class _Look(NamedTuple):
    """A candidate as one walk saw it."""

    path: str
    shape: Shape
    files: tuple[str, ...]  # relative to `path`; empty for a file
    signature: str
    size: int


class FolderState(NamedTuple):
    """What `/status` shows of one --checkpoints folder."""

    folder: str
    complete: tuple[str, ...]  # handed on: registered, or uploaded then registered
    waiting: tuple[tuple[str, str], ...]  # path, why
    skipped: tuple[tuple[str, str], ...]  # path, why
    aliases: int
    not_posted: int  # unmapped local paths in a container
    deleted_before_complete: int
    note: str  # "" or why the folder shows nothing (missing, not a folder)
    deleted: tuple[tuple[str, str], ...]  # the latest deleted before they were complete, why


class ArtifactPaths:
    """Local paths as the platform can use them (`--artifact-uri LOCAL=URI`, longest prefix
    first); an unmapped one is uploaded (`upload`), else posted as it is on bare metal, and
    in a container, where a local path is useless to the platform, not posted."""

    def __init__(self, mappings: Iterable[tuple[str, str]], container: str,
                 upload: bool = False) -> None:
        self.mappings = sorted(mappings, key=lambda m: len(m[0]), reverse=True)
        self.container = container  # why this looks like a container, "" on bare metal
        self.upload = upload

    def resolve(self, path: str) -> str | None:
        """The URI posted for `path`: its mapping's, else the path itself on bare metal when
        nothing is uploaded; None when it is not posted as it is."""
        for local, uri in self.mappings:
            if path == local or path.startswith(local.rstrip("/") + "/"):
                rest = quote(path[len(local.rstrip("/")):].lstrip("/"), safe=URI_PATH_SAFE)
                return uri.rstrip("/") + ("/" + rest if rest else "")
        return None if self.container or self.upload else path


def uploads_unmapped(mode: str, container: str) -> bool:
    """Whether an unmapped checkpoint is uploaded under --checkpoint-upload `mode`: auto
    uploads in a container (`container`: why this looks like one, "" when it does not)."""
    return mode == "always" or (mode == "auto" and bool(container))


def container_signal(environ: Mapping[str, str], root: Path = Path("/")) -> str:
    """Why this process looks like it runs in a container ("" when it does not): Kubernetes'
    variables, Docker's and Podman's marker files, a container runtime in the cgroup path."""
    if "KUBERNETES_SERVICE_HOST" in environ:
        return "KUBERNETES_SERVICE_HOST is set"
    for marker in (".dockerenv", "run/.containerenv"):
        if (root / marker).exists():
            return f"/{marker} exists"
    try:
        cgroup = (root / "proc/1/cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        cgroup = ""
    for runtime in ("kubepods", "docker", "containerd", "libpod", "crio"):
        if runtime in cgroup:
            return f"the cgroup names {runtime}"
    return ""


def shown(path: str) -> str:
    """A path as a log line may hold it: as it is, unless a character in it (a newline, a
    byte that is not UTF-8) would split or garble the line; then with escapes."""
    return path if path.isprintable() else ascii(path)


def _nearest_existing(folder: str) -> str:
    """The folder itself, else its nearest parent that exists (to be told when it is made)."""
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def look_over(root: str, limit_s: float = WALK_LIMIT_S) -> tuple[list[_Look], int, list[str], bool]:
    """Every candidate under `root`, how many aliases were passed over, every folder seen (to
    be watched: a checkpoint's own folders too, even empty, as a save fills them later), and
    whether the walk saw everything (False: it stopped after `limit_s`, on a filesystem that
    slow). Blocking: call it in a thread."""
    looks: list[_Look] = []
    aliases = 0
    seen: list[str] = []
    pending = [root]
    deadline = time.monotonic() + limit_s
    while pending:
        if time.monotonic() > deadline:
            return looks, aliases, seen, False
        folder = pending.pop()
        entries = _entries(folder)
        if entries is None:
            continue
        shape = _folder_shape(folder, entries)
        if shape is not None and shape.format not in FLAT_FORMATS:
            looks.append(_folder_look(folder, shape, seen, recurse=True))
            continue
        if shape is not None:  # its own files; its folders may hold checkpoints of their own
            looks.append(_folder_look(folder, shape, seen, recurse=False))
        else:
            seen.append(folder)
        names = frozenset(entry.name for entry in entries)
        for entry in entries:
            if work_in_progress(entry.name):
                continue
            if entry.is_symlink() or is_alias_name(entry.name, names):
                aliases += 1
                continue
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
                continue
            if shape is not None:
                continue
            file = file_shape(entry.name)
            if file is not None:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # deleted since the folder was listed
                    continue
                if not stat.S_ISREG(st.st_mode):  # a FIFO is never opened: it would block
                    continue
                looks.append(_Look(entry.path, file, (), _signature(
                    ((entry.name, st.st_size, st.st_mtime_ns),)), st.st_size))
    return looks, aliases, seen, True


class Surveyed(NamedTuple):
    """One candidate as `sidecar check` shows it: judged now, without waiting for quiet."""

    path: str
    shape: Shape
    size: int
    assessment: Assessment


def checkpoints_in(root: str) -> tuple[list[Surveyed], int]:
    """Every candidate under `root` with its assessment now, and the aliases passed over."""
    looks, aliases, _, _ = look_over(root)
    found = []
    for seen in sorted(looks, key=lambda lk: lk.path):
        entry = Candidate(seen.path, root, seen.shape)
        entry.files, entry.signature = seen.files, seen.signature
        found.append(Surveyed(seen.path, seen.shape, seen.size, _judge(entry)[0]))
    return found, aliases


def _entries(folder: str) -> list[os.DirEntry[str]] | None:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return None


def _folder_shape(folder: str, entries: list[os.DirEntry[str]]) -> Shape | None:
    names = frozenset(e.name for e in entries if not e.is_dir(follow_symlinks=False))
    subfolders = frozenset(e.name for e in entries if e.is_dir(follow_symlinks=False))
    return folder_shape(os.path.basename(folder), names, subfolders)


def _folder_look(folder: str, shape: Shape, seen: list[str], recurse: bool) -> _Look:
    files: list[tuple[str, int, int]] = []
    pending = [""]
    while pending:
        rel = pending.pop()
        seen.append(os.path.join(folder, rel) if rel else folder)
        for entry in _entries(os.path.join(folder, rel)) or ():
            name = os.path.join(rel, entry.name) if rel else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if recurse:
                        pending.append(name)
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # a FIFO, a socket, a device: never opened
                files.append((name, st.st_size, st.st_mtime_ns))
    files.sort()
    return _Look(folder, shape, tuple(f[0] for f in files), _signature(files),
                 sum(f[1] for f in files))


def _signature(files: Iterable[tuple[str, int, int]]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name, size, mtime_ns in files:
        digest.update(f"{name}\0{size}\0{mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _judge(entry: Candidate) -> tuple[Assessment, str]:
    """The assessment of a settled candidate and, when complete, its fingerprint. Blocking."""
    path = Path(entry.path)
    try:
        assessment = assess(entry.shape, path, entry.files)
        if not assessment.complete:
            return assessment, ""
        # whole by its structure, or with none to check (a legacy pickle): a writer that
        # still holds a file open for writing says otherwise
        writer = open_for_writing(
            {os.path.join(entry.path, rel) for rel in entry.files} or {entry.path})
        if writer:
            return Assessment(False, f"still open for writing by process {writer}"), ""
        fingerprint = (f"{assessment.marker}:{marker_identity(path / assessment.marker)}"
                       if assessment.marker else f"files:{entry.signature}")
        if not os.path.exists(entry.path):  # deleted (rotated away) while it was judged
            return Assessment(False, "deleted"), ""
        return assessment, fingerprint
    except OSError as exc:
        return Assessment(False, f"cannot be read ({exc.strerror or exc})"), ""


class CheckpointWatcher:
    """Finds checkpoints under the --checkpoints folders and hands on each complete one."""

    def __init__(self, folders: Iterable[str], register: Callable[[Found], None],
                 known: Callable[[str, str], bool], paths: ArtifactPaths,
                 registers: str = "", mode: str = "auto") -> None:
        """`registers`: "" when this node registers, else why not (shown per checkpoint);
        `mode`: auto (inotify plus a safety walk) or poll."""
        self.folders = tuple(os.path.abspath(f) for f in folders)
        self.register = register
        self.known = known
        self.paths = paths
        self.not_registering = registers
        self.mode = mode
        self.entries: dict[str, Candidate] = {}
        self.aliases: dict[str, int] = dict.fromkeys(self.folders, 0)
        self.not_posted: dict[str, int] = dict.fromkeys(self.folders, 0)
        self.deleted: dict[str, int] = dict.fromkeys(self.folders, 0)
        self._warned: set[str] = set()
        self._wake = asyncio.Event()
        self._events: Inotify | None = None
        self._remote = False
        self._walk_cpu_s = 0.0  # what the last walk cost, in CPU seconds
        self._missing: set[str] = set()  # folders that do not exist yet
        self._throttle = Throttle()
        # the latest deleted before they were complete: folder, path, why
        self.gone: list[tuple[str, str, str]] = []

    @property
    def quiet_s(self) -> float:
        return REMOTE_QUIET_S if self._remote else QUIET_S

    async def run(self) -> None:
        """Look, and look again when something changes, until cancelled."""
        self._remote = any(is_remote(filesystem_of(Path(f))) for f in self.folders)
        if self.mode == "auto" and not self._remote:
            try:
                self._events = Inotify(self._wake.set)
            except OSError as exc:
                log.info("--checkpoints: file events unavailable (%s): walking every %.0f s",
                         exc, REMOTE_LOOK_S, extra={"source": "checkpoints"})
        try:
            while True:
                fault_point()
                self._wake.clear()
                await self.look()
                woken = await wait_set(self._wake, self._next_look_in())
                if woken:  # a save is under way: one walk for its burst of events
                    await asyncio.sleep(max(EVENT_SETTLE_S, WALK_SPACING * self._walk_cpu_s))
        finally:
            if self._events is not None:
                self._events.close()
                self._events = None

    def _next_look_in(self) -> float:
        """Seconds to the next look: when a candidate that changed will have been quiet long
        enough, else the interval. One judged incomplete waits for a change (a file event, or
        the interval's walk) to be judged again."""
        interval = SAFETY_LOOK_S if self._events is not None else REMOTE_LOOK_S
        if self._missing:  # a folder the trainer has yet to make: found within a second
            interval = min(interval, MISSING_LOOK_S)
        now = time.monotonic()
        settling = [e.seen_at + self._quiet_of(e) - now for e in self.entries.values()
                    if e.state == "waiting" and e.why == "changing"]
        return max(min([interval, *settling]), MIN_LOOK_S)

    async def look(self) -> None:
        """One walk of every folder; judge what settled; hand on what is complete."""
        walks = await asyncio.to_thread(self._walk_all)
        now = time.monotonic()
        present: set[str] = set()
        cut_short: set[str] = set()
        for folder, (looks, aliases, folders, whole) in walks:
            if not whole:
                cut_short.add(folder)
                if self._throttle.admit(f"walk:{folder}") is not None:
                    log.warning("--checkpoints %s: a walk stopped after %.0f s (%d folders "
                                "seen): the filesystem answers that slowly; what lay beyond "
                                "is looked at by the next walks", shown(folder), WALK_LIMIT_S,
                                len(folders),
                                extra={"source": "checkpoints", "path": shown(folder)})
            self.aliases[folder] = aliases
            self._note_missing(folder, folders)
            if self._events is not None:
                self._events.watch(folders or [_nearest_existing(folder)])
            for seen in looks:
                present.add(seen.path)
                self._update(folder, seen, now)
        for path in [p for p, e in self.entries.items()
                     if p not in present and e.root not in cut_short]:
            gone = self.entries.pop(path)
            if gone.state == "waiting":
                self.deleted[gone.root] += 1
                why = f"deleted before it was complete ({gone.why})"
                self.gone.append((gone.root, path, why))
                del self.gone[:-MAX_NAMED_AT_EXIT]
                log.info("--checkpoints: %s was %s; not registered", shown(path), why,
                         extra={"source": "checkpoints", "path": shown(path)})
        due = [e for e in self.entries.values()
               if e.state == "waiting" and self._settled(e, now)]
        if due:
            assessments = await asyncio.to_thread(lambda: [(e, *_judge(e)) for e in due])
            for entry, assessment, fingerprint in assessments:
                self._decide(entry, assessment, fingerprint)

    def _note_missing(self, folder: str, seen: list[str]) -> None:
        """Say once that a folder does not exist yet, and once that it appeared."""
        if seen and folder in self._missing:
            self._missing.discard(folder)
            log.info("--checkpoints %s: the folder exists now; watching it", shown(folder),
                     extra={"source": "checkpoints", "path": shown(folder)})
        elif not seen and folder not in self._missing:
            self._missing.add(folder)
            log.info("--checkpoints %s does not exist yet; watching %s for it",
                     shown(folder), shown(_nearest_existing(folder)),
                     extra={"source": "checkpoints", "path": shown(folder)})

    def _walk_all(self) -> list[tuple[str, tuple[list[_Look], int, list[str], bool]]]:
        started = time.thread_time()
        walks = [(folder, look_over(folder)) for folder in self.folders]
        self._walk_cpu_s = time.thread_time() - started
        return walks

    def _update(self, folder: str, seen: _Look, now: float) -> None:
        entry = self.entries.get(seen.path)
        if entry is None:
            entry = self.entries[seen.path] = Candidate(seen.path, folder, seen.shape)
            entry.seen_at = now
        elif entry.signature == seen.signature:
            return
        else:  # changed: rewritten in place when it was registered
            entry.seen_at = now
            entry.state = "waiting"
        entry.shape, entry.files, entry.signature, entry.size = (
            seen.shape, seen.files, seen.signature, seen.size)
        entry.why = "changing"

    def _settled(self, entry: Candidate, now: float) -> bool:
        return now - entry.seen_at >= self._quiet_of(entry)

    def _quiet_of(self, entry: Candidate) -> float:
        """How long a candidate must be quiet: a save_pretrained export longer, as the
        Trainer's save_model writes the tokenizer and its arguments seconds after the
        weights, and nothing marks the export's end."""
        return self.quiet_s * (EXPORT_QUIET_FACTOR if entry.shape.format == "hf" else 1)

    def _decide(self, entry: Candidate, assessment: Assessment, fingerprint: str) -> None:
        if not assessment.complete:
            if entry.why != assessment.why:
                log.debug("--checkpoints: %s is not complete: %s", shown(entry.path),
                          assessment.why,
                          extra={"source": "checkpoints", "path": shown(entry.path)})
            entry.why = assessment.why
            return
        entry.fingerprint = fingerprint
        if self.known(entry.path, fingerprint):
            log.debug("--checkpoints: %s was registered already, as it is now", entry.path,
                      extra={"source": "checkpoints", "path": entry.path})
            entry.state, entry.why = "complete", ""
            return
        if self.not_registering:
            entry.state, entry.why = "skipped", self.not_registering
            if entry.root not in self._warned:
                self._warned.add(entry.root)
                log.info("--checkpoints %s: %s is complete and not registered here: %s",
                         entry.root, entry.path, self.not_registering,
                         extra={"source": "checkpoints", "path": entry.root})
            return
        problem = object_name_problem(entry.path)
        if problem:
            entry.state, entry.why = "skipped", f"its name {problem}, which no URI can carry"
            log.warning("--checkpoints: %s is not registered: its name %s, which no URI can "
                        "carry; rename it", shown(entry.path), problem,
                        extra={"source": "checkpoints", "path": shown(entry.path)})
            return
        uri = self.paths.resolve(entry.path)
        if holds_secret(entry.path) or (uri is not None and holds_secret(uri)):
            # masked, the registration would name no object; whole, the token would be in the
            # store's keys, the console and every file of the state folder that names it
            entry.state, entry.why = "skipped", "its path holds the ingest's token"
            log.error("--checkpoints: %s is neither uploaded nor registered: its path holds the "
                      "ingest's token, which its object key, the console and the state folder "
                      "would keep; rename it (or the folder above it)", shown(entry.path),
                      extra={"source": "checkpoints", "path": shown(entry.path)})
            return
        if uri is None and not self.paths.upload:
            entry.state = "skipped"
            entry.why = (f"a local path in a container ({self.paths.container}) is useless to "
                         f"the platform; map it with {CONTAINER_HINT}, or let it be uploaded "
                         f"({UPLOAD_HINT})")
            self.not_posted[entry.root] += 1
            if entry.root not in self._warned:
                self._warned.add(entry.root)
                log.warning("--checkpoints %s: %s is not posted: this runs in a container (%s), "
                            "where a local path stops existing with it; give %s LOCAL=URI "
                            "naming the object-store URI this folder mirrors, or let it be "
                            "uploaded (%s)", entry.root, shown(entry.path),
                            self.paths.container, CONTAINER_HINT, UPLOAD_HINT,
                            extra={"source": "checkpoints", "path": entry.root})
            return
        step = assessment.step if assessment.step is not None else entry.shape.step
        if entry.registered_as == (step, entry.size) and not assessment.marker:
            # Nothing would tell the two registrations apart (a `last.pt` saved over again):
            # a rewrite is registered again with a step or a size of its own, or when its
            # writer's marker says it saved again.
            entry.state, entry.why = "complete", ""
            log.info("--checkpoints: %s was rewritten with the same step (%s) and size: not "
                     "registered again", shown(entry.path), "unknown" if step is None else step,
                     extra={"source": "checkpoints", "path": shown(entry.path)})
            return
        entry.state, entry.why, entry.registered_as = "complete", "", (step, entry.size)
        log.info("--checkpoints: %s complete (%s, %s, step %s, %d bytes); %s it",
                 shown(entry.path), entry.shape.kind, entry.shape.format,
                 "unknown" if step is None else step, entry.size,
                 "registering" if uri is not None else "uploading",
                 extra={"source": "checkpoints", "path": shown(entry.path)})
        self.register(Found(entry.path if uri is None else uri, entry.path, entry.shape.kind,
                            entry.shape.format, step, entry.size, fingerprint, entry.root,
                            entry.files, uri is None))

    def settling(self) -> int:
        """Candidates not judged since their files last changed: they may be complete."""
        return sum(1 for e in self.entries.values()
                   if e.state == "waiting" and e.why == "changing")

    async def drain(self, deadline: float) -> None:
        """A last look, and more while a candidate is settling, until `deadline`: a checkpoint
        the command finished just before it exited is registered too."""
        await self.look()
        while self.settling() and time.monotonic() + self.quiet_s <= deadline:
            await asyncio.sleep(min(self._next_look_in(), max(deadline - time.monotonic(), 0)))
            await self.look()

    def say_unregistered(self) -> None:
        """At the exit: every candidate seen and not registered, with why, one a line (the
        first MAX_NAMED_AT_EXIT), so that no checkpoint is missed in silence."""
        left = [(e.path, e.why) for e in self.entries.values() if e.state != "complete"]
        left += [(path, why) for _, path, why in self.gone]
        for path, why in left[:MAX_NAMED_AT_EXIT]:
            log.info("--checkpoints: %s was not registered: %s", shown(path), why,
                     extra={"source": "checkpoints", "path": shown(path)})
        if len(left) > MAX_NAMED_AT_EXIT:
            log.info("--checkpoints: %d more candidates were not registered; `sidecar "
                        "check` names them", len(left) - MAX_NAMED_AT_EXIT,
                        extra={"source": "checkpoints"})

    def states(self) -> list[FolderState]:
        """Each folder's checkpoints by state, for the status endpoint."""
        result = []
        for folder in self.folders:
            mine = [e for e in self.entries.values() if e.root == folder]
            note = "" if os.path.isdir(folder) else (
                "is not a folder" if os.path.exists(folder) else "does not exist yet")
            result.append(FolderState(
                folder, tuple(sorted(e.path for e in mine if e.state == "complete")),
                tuple(sorted((e.path, e.why) for e in mine if e.state == "waiting")),
                tuple(sorted((e.path, e.why) for e in mine if e.state == "skipped")),
                self.aliases.get(folder, 0), self.not_posted[folder], self.deleted[folder],
                note, tuple((p, w) for root, p, w in self.gone if root == folder)))
        return result
