"""What a model checkpoint looks like on disk, writer by writer, and when it is whole.

Pure functions over names and files, no state: which writer a folder or file came from (its
`format` short name, its `kind`, the step its name carries), and, once it has stopped changing,
whether it is complete: the writer's own marker where it leaves one, a structure check where
the format allows one (a zip's end record, a safetensors header against the file size, a tar's
end, a legacy pickle's storages against the file size). The table of
docs/checkpoints.md#which-paths-are-checkpoints is this module's table.
"""

from __future__ import annotations

import errno
import json
import os
import pickletools
import re
import stat
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO, NamedTuple

# Names a writer gives what it has not finished: never a checkpoint, whatever they hold.
_WORK_IN_PROGRESS = re.compile(
    r"(^tmp-checkpoint-)|(^\.)|(\.tmp[0-9A-Za-z_]*$)|(\.tmp\.)|(\.part$)|(\.partial$)"
    r"|(\.incomplete$)|(~$)|(-unfinished$)|(\.lock$)")
_ZIP_END = b"PK\x05\x06"
_ZIP_END_BYTES = 22
_ZIP_MAX_COMMENT = 0xFFFF
_TAR_BLOCK = 512
_MAX_SAFETENSORS_HEADER = 100 << 20  # the library's own limit
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's and verl's, next to iter_N/
DEEPSPEED_LATEST = "latest"  # DeepSpeed's pointer to the newest tag, next to global_stepN/
NEMO_UNFINISHED = "-unfinished"  # NeMo 2's sibling marker, removed when a save is complete


class Shape(NamedTuple):
    """What a candidate is: the writer's short name, the artifact kind, the step in its name."""

    format: str
    kind: str  # checkpoint, hf_export, merged_model
    step: int | None


class Assessment(NamedTuple):
    """Whether a candidate that stopped changing is complete, and if not, why not."""

    complete: bool
    why: str = ""  # when not complete: what is missing
    step: int | None = None  # a step the marker holds (trainer_state.json, a tracker)
    marker: str = ""  # the file whose identity stands for the checkpoint's ("" : every file)


def object_name_problem(name: str) -> str:
    """Why `name` cannot be an object's name ("" when it can): not UTF-8 (a byte the filesystem
    holds that no URI can carry), or a control character."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "holds bytes that are not UTF-8"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "holds a control character (a newline, a tab)"
    return ""


def work_in_progress(name: str) -> bool:
    """Whether `name` is one a writer uses before a save is finished (or a hidden file)."""
    return _WORK_IN_PROGRESS.search(name) is not None


_LAST_COPY = re.compile(r"-last(\.ckpt)?$")  # NeMo's second save of the newest step


def is_alias_name(name: str, siblings: frozenset[str] = frozenset()) -> bool:
    """Whether `name` is the newest checkpoint again under another name: Lightning's
    `last.ckpt` (`last-v1.ckpt`), overwritten at every save, or NeMo's `...-step=N-last` when
    a sibling holds the same step under its own name (without one, it is the only copy)."""
    if re.fullmatch(r"last(-v\d+)?\.ckpt", name):
        return True
    if not _LAST_COPY.search(name):
        return False
    step = step_in_name(name)
    return step is not None and any(
        not _LAST_COPY.search(other) and step_in_name(other) == step for other in siblings)


_STEP_IN_NAME = (
    re.compile(r"^checkpoint-(\d+)$"),  # HF Trainer
    re.compile(r"^global_step_?(\d+)$"),  # DeepSpeed (global_stepN), verl (global_step_N)
    re.compile(r"^iter_(\d+)$"),  # Megatron
    re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)", re.IGNORECASE),  # Lightning, NeMo, torchtitan
    re.compile(r"(?:^|[^a-z])iter(?:ation)?[=_-]?(\d+)", re.IGNORECASE),
)
_TRAILING_NUMBER = re.compile(r"[-_](\d+)$")


def step_in_name(name: str) -> int | None:
    """The training step a checkpoint's name carries, or None."""
    for pattern in _STEP_IN_NAME:
        found = pattern.search(name)
        if found:
            return int(found.group(1))
    stem = name.split(".", 1)[0]
    trailing = _TRAILING_NUMBER.search(stem)
    return int(trailing.group(1)) if trailing and not stem.startswith("checkpoint_") else None


# -- folders ------------------------------------------------------------------------------------

def _has(names: frozenset[str], suffix: str) -> bool:
    return any(name.endswith(suffix) for name in names)


_SHARD = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")


def _hf_weights(names: frozenset[str]) -> bool:
    """Weights as save_pretrained writes them: one file, shards (before their index, which
    comes last), or the index; `training_args.bin` is the Trainer's, not a weight."""
    return any(n.endswith((".safetensors", ".index.json")) or (
        n.endswith(".bin") and n != "training_args.bin") for n in names)


# What the HF Trainer writes into checkpoint-N/, the first of it (config.json, the weights) too.
_HF_TRAINER_FILE = re.compile(
    r"(trainer_state\.json|training_args\.bin|config\.json|adapter_config\.json"
    r"|generation_config\.json|rng_state.*\.pth|tokenizer.*|special_tokens_map\.json"
    r"|model\.safetensors.*|model-\d{5}-of-\d{5}\..*|pytorch_model.*|adapter_model.*)$")
_TORCH_FILES = (".pt", ".pth", ".safetensors", ".bin", ".ckpt")


def folder_shape(name: str, names: frozenset[str], subfolders: frozenset[str]) -> Shape | None:
    """The shape of a folder named `name` holding files `names` and folders `subfolders`, when
    it is a checkpoint; None when it is only a folder that may hold some."""
    step = step_in_name(name)
    if re.fullmatch(r"checkpoint-\d+", name):
        if names and not any(_HF_TRAINER_FILE.match(n) for n in names) and all(
                n.endswith(_TORCH_FILES) for n in names):
            # the name is the Trainer's, the files are not: torch.save's own, judged as such
            return Shape("pt", "checkpoint", step)
        return Shape("hf-trainer", "checkpoint", step)
    if re.fullmatch(r"global_step\d+", name):
        return Shape("deepspeed", "checkpoint", step)
    if re.fullmatch(r"global_step_\d+", name):
        return Shape("verl", "checkpoint", step)
    if re.fullmatch(r"iter_\d+", name):
        return Shape("megatron", "checkpoint", step)
    if any(n.endswith(("model_states.pt", "optim_states.pt")) for n in names):
        return Shape("deepspeed", "checkpoint", step)  # a tag of the caller's own choosing
    if {"weights", "context"} <= subfolders:
        return Shape("nemo", "checkpoint", step)
    if ".metadata" in names or _has(names, ".distcp"):
        return Shape("lightning-distcp" if name.endswith(".ckpt") else "distcp", "checkpoint",
                     step)
    if ("config.json" in names and _hf_weights(names)) or "adapter_config.json" in names:
        kind = "merged_model" if "merged" in name.lower() else "hf_export"
        return Shape("hf", kind, step)
    if any(re.fullmatch(r"random_states_\d+\.pkl", n) for n in names):
        return Shape("accelerate", "checkpoint", None)  # its checkpoint_k counts saves, not steps
    return None


# -- loose files --------------------------------------------------------------------------------

_FILE_FORMATS = (
    (".ckpt", "lightning-ckpt"),
    (".safetensors", "safetensors"),
    (".nemo", "nemo"),
    (".pt", "pt"),
    (".pth", "pt"),
)


def file_shape(name: str) -> Shape | None:
    """The shape of a checkpoint file on its own, or None for any other file."""
    for suffix, fmt in _FILE_FORMATS:
        if name.endswith(suffix):
            return Shape(fmt, "checkpoint", step_in_name(name[:-len(suffix)]))
    return None


# -- completeness -------------------------------------------------------------------------------

def _open(path: Path) -> BinaryIO:
    """`path` opened for reading, never blocking: OSError when it is not a regular file (a
    FIFO put where a checkpoint was would hold an open for reading until a writer came)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


def _read(path: Path) -> bytes:
    with _open(path) as fh:
        return fh.read()


def zip_complete(path: Path) -> str:
    """"" when `path` ends with a zip's end-of-central-directory record (torch.save writes it
    last), or is a whole legacy pickle save, else what is wrong."""
    size = path.stat().st_size
    with _open(path) as fh:
        head = fh.read(4)
        if head != b"PK\x03\x04":
            return legacy_pickle_problem(fh, size) if head else "empty"
        tail_len = min(size, _ZIP_END_BYTES + _ZIP_MAX_COMMENT)
        fh.seek(size - tail_len)
        tail = fh.read(tail_len)
    at = tail.rfind(_ZIP_END)
    while at >= 0:
        (comment_len,) = struct.unpack_from("<H", tail, at + 20) if at + 22 <= len(tail) else (-1,)
        if at + _ZIP_END_BYTES + comment_len == len(tail):
            return ""
        at = tail.rfind(_ZIP_END, 0, at)
    return "no zip end record yet (still being written)"


# torch.save(..., _use_new_zipfile_serialization=False), as torch's _legacy_save writes it:
# five pickles one after another (the magic number, the protocol version, the system's sizes,
# the object, whose persistent ids name its storages, and the sorted list of storage keys), then
# each storage in that order: its element count (8 bytes, little-endian), then its bytes.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PICKLES_MAX_BYTES = 256 << 20  # more pickled than this: judged as a file without one
_STORAGE_ELEMENT_BYTES = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
    "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1,
    "BoolStorage": 1, "ComplexDoubleStorage": 16, "ComplexFloatStorage": 8,
    "QUInt8Storage": 1, "QInt8Storage": 1, "QInt32Storage": 4, "QUInt4x2Storage": 1,
    "QUInt2x4Storage": 1, "UntypedStorage": 1,
}


class _Unreadable(Exception):
    """The file is not laid out as a legacy torch save we know."""


class _Global(NamedTuple):
    module: str
    name: str


class _Opaque:
    """A value on the pickle's stack this walk does not need."""


_OPAQUE = _Opaque()
_PUSH_ARG = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING",
    "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_CONSTANTS: Mapping[str, object] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


class _Counted:
    """A file read through pickletools: says whether a read met the file's end, and stops
    one that would hold more than _LEGACY_PICKLES_MAX_BYTES in memory."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.left = _LEGACY_PICKLES_MAX_BYTES
        self.met_end = False

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self.left:
            raise _Unreadable("more pickled than it is worth reading")
        data = self.fh.read(n)
        self.left -= len(data)
        self.met_end |= len(data) < n
        return data

    def readline(self, limit: int = -1) -> bytes:
        line = self.fh.readline(self.left)
        self.left -= len(line)
        if not line.endswith(b"\n"):
            if self.left <= 0:
                raise _Unreadable("more pickled than it is worth reading")
            self.met_end = True
        return line

    def tell(self) -> int:
        return self.fh.tell()


def _walk_pickle(stream: _Counted, persistent_ids: list[object]) -> object:
    """The value of the pickle at the stream's position, as far as this check needs it
    (numbers, strings, tuples, lists, globals by name; anything else opaque), read opcode by
    opcode: nothing is imported or called. Each persistent id met goes to `persistent_ids`."""
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[object, object] = {}
    # genops reads with read, readline and tell only, all of which _Counted has
    for op, arg, _ in pickletools.genops(stream):  # type: ignore[arg-type]
        name = op.name
        if name == "STOP":
            return stack.pop()
        if name == "MARK":
            marks.append(len(stack))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "DUP":
            stack.append(stack[-1])
        elif name in _PUSH_ARG:
            stack.append(arg)
        elif name in _CONSTANTS:
            stack.append(_CONSTANTS[name])
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(_Global(module, attr))
        elif name == "STACK_GLOBAL":
            name_, module_ = stack.pop(), stack.pop()
            stack.append(_Global(str(module_), str(name_)))
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            last = tuple(stack[-count:])
            del stack[-count:]
            stack.append(last)
        elif name in ("TUPLE", "LIST", "APPENDS"):
            at = marks.pop()
            items = stack[at:]
            del stack[at:]
            if name == "APPENDS":
                target = stack[-1]
                if isinstance(target, list):
                    target.extend(items)
            else:
                stack.append(tuple(items) if name == "TUPLE" else items)
        elif name == "APPEND":
            item = stack.pop()
            if isinstance(stack[-1], list):
                stack[-1].append(item)
        elif name == "BINPERSID":
            persistent_ids.append(stack.pop())
            stack.append(_OPAQUE)
        else:  # what this check does not need: only its effect on the stack
            before = op.stack_before
            if pickletools.markobject in before:
                at = marks.pop()
                del stack[at:]
                count = before.index(pickletools.markobject)
            else:
                count = len(before)
            if count > len(stack):
                raise _Unreadable("its pickle takes more from the stack than it holds")
            del stack[len(stack) - count:]
            stack.extend([_OPAQUE] * len(op.stack_after))
    raise _Unreadable("no STOP")  # genops raises first


def _storage_bytes(persistent_ids: list[object]) -> dict[str, tuple[int, int]]:
    """Each storage's key: (its element count, bytes an element), from the persistent ids
    `("storage", torch.FloatStorage, key, location, count, view)` torch's pickler wrote."""
    storages = {}
    for pid in persistent_ids:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            continue  # ("module", ...): a module's source, nothing stored after the pickles
        if len(pid) != 6 or not isinstance(pid[1], _Global) or not isinstance(pid[4], int):
            raise _Unreadable("a storage's persistent id is not torch's")
        element_bytes = _STORAGE_ELEMENT_BYTES.get(pid[1].name)
        if element_bytes is None or not pid[1].module.startswith("torch"):
            raise _Unreadable(f"a storage of type {pid[1].module}.{pid[1].name}")
        storages[str(pid[2])] = (pid[4], element_bytes)
    return storages


def legacy_pickle_problem(fh: BinaryIO, size: int) -> str:
    """"" when the legacy torch save in `fh` (`size` bytes) is whole: its five pickles, then
    every storage they name, ending at the file's end; else where it stops. "" too when it is
    not laid out as one (what its quiet time and its writers decide then)."""
    stream = _Counted(fh)
    fh.seek(0)
    try:
        try:
            magic = _walk_pickle(stream, [])
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            fh.seek(0)
            # shorter than the magic number's pickle, and begun as one (its PROTO opcode)
            if stream.met_end and fh.read(1) == b"\x80" and size < 32:
                return f"cut short at {size} bytes, in its first pickle (still being written)"
            raise _Unreadable(str(exc)) from exc
        if magic != _LEGACY_MAGIC:
            raise _Unreadable("not torch's magic number")
        persistent_ids: list[object] = []
        try:
            for _ in range(3):  # the protocol version, the system's sizes, the object
                _walk_pickle(stream, persistent_ids)
            keys = _walk_pickle(stream, [])
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            if stream.met_end:
                return f"cut short at {size} bytes, in its pickles (still being written)"
            raise _Unreadable(str(exc)) from exc
        storages = _storage_bytes(persistent_ids)
        if not isinstance(keys, list) or any(key not in storages for key in keys):
            raise _Unreadable("its storage keys are not those its object names")
        at = fh.tell()
        for number, key in enumerate(keys, 1):
            fh.seek(at)
            raw = fh.read(8)
            if len(raw) < 8:
                return (f"cut short at {size} bytes, before storage {number} of {len(keys)} "
                        f"(still being written)")
            (count,) = struct.unpack("<q", raw)
            expected, element_bytes = storages[key]
            if count != expected:
                raise _Unreadable(f"storage {key} holds {count} elements, its id says {expected}")
            at += 8 + count * element_bytes
            if at > size:
                return (f"cut short at {size} bytes, in storage {number} of {len(keys)}, which "
                        f"ends at {at} (still being written)")
        if at != size:
            raise _Unreadable(f"its storages end at {at} of {size} bytes")
        return ""
    except _Unreadable:
        return ""


def safetensors_complete(path: Path) -> str:
    """"" when the header's tensors end exactly at the file's end, else what is wrong."""
    size = path.stat().st_size
    with _open(path) as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return "shorter than a safetensors header"
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_SAFETENSORS_HEADER or 8 + length > size:
            return "its header is not all there yet"
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not valid JSON"
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            return f"tensor {key!r} has no data offsets"
        end = max(end, offsets[1])
    if 8 + length + end != size:
        return f"the header describes {8 + length + end} bytes, the file has {size}"
    return ""


def tar_complete(path: Path) -> str:
    """"" when `path` ends with a tar's end of archive (two zero blocks), else what is wrong."""
    size = path.stat().st_size
    if size < 2 * _TAR_BLOCK or size % _TAR_BLOCK:
        return "not a whole number of tar blocks yet"
    with _open(path) as fh:
        fh.seek(size - 2 * _TAR_BLOCK)
        if fh.read(2 * _TAR_BLOCK).strip(b"\0"):
            return "no tar end of archive yet"
    return ""


def json_complete(path: Path) -> str:
    try:
        json.loads(_read(path))
    except ValueError:
        return f"{path.name} is not whole JSON yet"
    return ""


_FILE_CHECKS: tuple[tuple[str, Callable[[Path], str]], ...] = (
    (".safetensors", safetensors_complete),
    (".pt", zip_complete), (".pth", zip_complete), (".bin", zip_complete),
    (".ckpt", zip_complete),
    (".nemo", tar_complete),
    (".json", json_complete),
)


def file_problem(path: Path) -> str:
    """What is wrong with one file of a checkpoint, by its name's format; "" when nothing."""
    for suffix, check in _FILE_CHECKS:
        if path.name.endswith(suffix):
            try:
                return check(path)
            except OSError as exc:
                return f"{path.name}: {exc.strerror or exc}"
    return ""


def _files_problem(root: Path, files: tuple[str, ...]) -> str:
    for rel in files:
        problem = file_problem(root / rel)
        if problem:
            return f"{rel}: {problem}"
    return ""


def _index_problem(root: Path, names: frozenset[str]) -> str:
    """Every shard a `*.index.json` names is there (save_pretrained writes the index last)."""
    for name in sorted(n for n in names if n.endswith(".index.json")):
        try:
            doc = json.loads(_read(root / name))
        except (OSError, ValueError):
            return f"{name} is not whole JSON yet"
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            return f"{name} has no weight_map"
        missing = sorted({str(s) for s in weight_map.values()} - names)
        if missing:
            return f"{name} names {missing[0]}, not there yet"
    return ""


def _read_int(path: Path) -> int | None:
    try:
        text = _read(path).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def assess(shape: Shape, path: Path, files: tuple[str, ...]) -> Assessment:
    """Whether the checkpoint at `path` (a folder holding `files`, relative paths, or one file)
    is complete, by its writer's rules. Call it once it stopped changing."""
    if not files and not path.is_dir():
        problem = file_problem(path)
        return Assessment(not problem, problem)
    rule = _FOLDER_RULES.get(shape.format, _whole_files)
    return rule(shape, path, frozenset(files))


def _whole_files(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    problem = _index_problem(path, names) or _files_problem(path, tuple(sorted(names)))
    return Assessment(not problem, problem)


def _hf_export(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    """save_pretrained writes config.json first, then the shards, then their index."""
    if any(_SHARD.search(n) for n in names) and not any(n.endswith(".index.json") for n in names):
        return Assessment(False, "shards without their index yet")
    return _whole_files(shape, path, names)


def _hf_trainer(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    marker = "trainer_state.json"  # Trainer._save_checkpoint writes it after everything else
    if marker not in names:
        return Assessment(False, f"no {marker} yet")
    try:
        state = json.loads(_read(path / marker))
    except (OSError, ValueError):
        return Assessment(False, f"{marker} is not whole JSON yet")
    assessment = _whole_files(shape, path, names)
    step = state.get("global_step") if isinstance(state, dict) else None
    return assessment._replace(step=step if isinstance(step, int) else None, marker=marker)


def _distcp(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    # The coordinator renames .metadata.tmp to .metadata once every rank wrote its shards.
    if ".metadata" not in names:
        return Assessment(False, "no .metadata yet")
    if shape.format == "lightning-distcp":
        unfinished = _nemo_unfinished(path)
        if unfinished:  # NeMo's distributed .ckpt folders (Megatron's layout)
            return Assessment(False, unfinished)
        if not {"meta.pt", "metadata.json"} & names:  # Lightning's, Megatron's, written last
            return Assessment(False, "no meta.pt yet")
    assessment = _whole_files(shape, path, frozenset(n for n in names if not n.endswith(".distcp")))
    return assessment._replace(marker=".metadata")


def _tracked(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    """Megatron and verl: rank 0 writes the tracker next to iter_N/ after every rank's files."""
    tracked = _read_int(path.parent / TRACKER)
    if tracked is None and shape.format == "megatron":
        return Assessment(False, f"no {TRACKER} yet")
    if tracked is not None and shape.step is not None and tracked < shape.step:
        return Assessment(False, f"{TRACKER} still says {tracked}")
    return _whole_files(shape, path, names)


def _deepspeed(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    """rank 0 writes `latest` before the barrier the other ranks reach after their own files:
    `latest` naming this tag says rank 0 is done, each shard's zip end says its rank is. One
    naming another tag, written after every file of this one, means a later save began."""
    latest_path = path.parent / DEEPSPEED_LATEST
    if latest_path.exists():
        try:
            latest = _read(latest_path).decode("utf-8").strip()
            written = latest_path.stat().st_mtime_ns
            newest = max((os.stat(path / n).st_mtime_ns for n in names), default=0)
        except (OSError, UnicodeDecodeError):
            return Assessment(False, f"{DEEPSPEED_LATEST} cannot be read yet")
        if latest != path.name and written < newest:
            return Assessment(False, f"{DEEPSPEED_LATEST} does not name it yet")
    if not any(n.endswith("model_states.pt") for n in names):
        return Assessment(False, "no model states yet")
    return _whole_files(shape, path, names)


def _nemo_unfinished(path: Path) -> str:
    """NeMo's marker of a save under way: the checkpoint's name without `.ckpt` and `-EMA`,
    plus `-unfinished`, created first and removed once the save is complete."""
    name = path.name.removesuffix(".ckpt").removesuffix("-EMA") + NEMO_UNFINISHED
    return f"{name} is still there" if (path.parent / name).exists() else ""


def _nemo(shape: Shape, path: Path, names: frozenset[str]) -> Assessment:
    unfinished = _nemo_unfinished(path)
    return Assessment(False, unfinished) if unfinished else _whole_files(shape, path, names)


_FOLDER_RULES: Mapping[str, Callable[[Shape, Path, frozenset[str]], Assessment]] = {
    "hf-trainer": _hf_trainer,
    "hf": _hf_export,
    "distcp": _distcp,
    "lightning-distcp": _distcp,
    "megatron": _tracked,
    "verl": _tracked,
    "deepspeed": _deepspeed,
    "nemo": _nemo,
}


def marker_identity(path: Path) -> str:
    """A marker file's identity: size, modification time and inode; rewriting it changes it."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
