"""The kinds of followed file, one row a kind: the one place a kind is named.

Its option (`options.OPTIONS` makes the row of each), how its files are parsed (the pipeline's
specs), and what `check`, `replay` and the wrapper need of it are read from the row; a new kind is
its parser module and a row here (tests/test_layout.py keeps every other module from naming one).

Plain data at import: `config.py` reads the rows at every start, so a row's parser module is
imported by its factory, when a run follows such files (tests/test_footprint.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from sidecar.records import LOG_BLOCK
from sidecar.sources.base import Head, Survey

if TYPE_CHECKING:
    from sidecar.sources.base import Parser, Settings
    from sidecar.sources.files.logfile import LogFileParser

# (path, saved state) -> the parser of that file, as files/follow.py's SourceSpec takes it
MakeParser = Callable[[Path, dict[str, Any]], "Parser"]


class Follow(NamedTuple):
    """What a kind's parser factory is given for one spec of files."""

    cfg: Settings
    prefix: str  # of each forwarded log line: --log-prefix with {node} and {rank} filled in
    made: Callable[[LogFileParser], None] | None = None  # told of each log file's parser
    folder: Path = Path()  # a `tree` kind's spec is one folder: this one


class FileKind(NamedTuple):
    """One kind of followed file."""

    # the option (--NAME, SIDECAR_NAME, NAME in TOML), the key of Config.files and of the run's
    # sources.json
    name: str
    help: str  # the option's --help text, before its default and variable
    parsers: Callable[[Follow], MakeParser]  # imports the kind's parser module when called
    metavar: str = ""  # what --help shows for a value; empty: the list options' PATH
    # bytes handed to a parser at once: the granularity of acknowledgement, so of what a crash
    # may repeat
    parse_bytes: int = LOG_BLOCK
    # a file-name glob: each pattern is a folder searched at any depth for such files, one spec a
    # folder
    tree: str = ""
    folder_hint: str = "*"  # the glob to give in a folder named by mistake for a file
    # its files give metric points, held back by a file's offset until acknowledged: what a
    # drain cut short leaves for the next start or `sidecar replay`
    metrics: bool = False
    head: Callable[[bytes], Head] | None = None  # `check`: what a file's first bytes give
    # why a file's parser gave no point yet, given the bytes it holds unparsed: said when a file
    # gives none in its first minute or by the end (files/follow.py's NO_POINT_S); None: not said
    silence: Callable[[Parser, int], str] | None = None
    # `check`: what the files a pattern names hold, for a kind whose files are not metrics
    survey: Callable[[Settings, list[str]], Survey] | None = None
    # the route its parsers' documents go to (Parsed.documents), one a request, at-least-once
    # with the file's offset held until acknowledged
    route: str = ""
    file_too: bool = False  # a `tree` kind's pattern may also name one file
    # followed by the reporting node alone (rank 0) on a multi-node run: what its files hold
    # is the run's, written once (by the trainer's main process, often on a shared filesystem
    # every node sees)
    reporting_node: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name


def _log_parsers(follow: Follow) -> MakeParser:
    from sidecar.masking import secrets
    from sidecar.sources.files.logfile import LogFileParser

    cfg = follow.cfg

    def make(path: Path, state: dict[str, Any]) -> Parser:
        parser = LogFileParser.resume(state, log_format=cfg.log_format, secrets=secrets,
                                      prefix=follow.prefix, keep_sgr=cfg.log_ansi == "keep")
        if follow.made is not None:
            follow.made(parser)
        return parser

    return make


def _jsonl_parsers(follow: Follow) -> MakeParser:
    from sidecar.sources.files.jsonl import JsonlParser

    return lambda path, state: JsonlParser.resume(state, str(path))


def _jsonl_head(data: bytes) -> Head:
    from sidecar.sources.files.jsonl import JsonlParser

    parser = JsonlParser()
    parsed = parser.parse(data, time.time())
    return Head(len(parsed.points), parser.not_finite, parser.problem, parsed.unusable,
                parser.first_not_finite)


def _jsonl_silence(parser: Parser, held: int) -> str:
    from sidecar.sources.files.jsonl import JsonlParser

    assert isinstance(parser, JsonlParser)
    return parser.silence(held)


def _tensorboard_parsers(follow: Follow) -> MakeParser:
    from sidecar.sources.files.tensorboard import folder_parsers

    return folder_parsers(follow.folder)


def _validation_parsers(follow: Follow) -> MakeParser:
    from sidecar.masking import secrets
    from sidecar.sources.files.validation import Fields, ValidationParser, name_step, parse_map

    cfg = follow.cfg
    fields = Fields.of(parse_map(cfg.validation_map))
    return lambda path, state: ValidationParser.resume(
        state, source=str(path), name_step=name_step(path.name), mapping=fields,
        kept=cfg.validation_samples, secrets=secrets)


def _validation_survey(cfg: Settings, files: list[str]) -> Survey:
    from sidecar.sources.files.validation import survey

    return survey(cfg, files)


FILE_KINDS: tuple[FileKind, ...] = (
    FileKind("log", "plain-text log file forwarded to /logs (repeatable, globs allowed)",
             _log_parsers, folder_hint="*.log"),
    # about one /metrics request of points
    FileKind("jsonl", "JSONL metric log forwarded to /metrics (repeatable, globs)",
             _jsonl_parsers, parse_bytes=64 << 10, folder_hint="*.jsonl", metrics=True,
             head=_jsonl_head, silence=_jsonl_silence),
    # TensorBoard's event file names (docs/ingest.md#how-sources-become-payloads)
    FileKind("tensorboard", "TensorBoard log directory, searched recursively, or one event "
             "file (repeatable)",
             _tensorboard_parsers, metavar="DIR", parse_bytes=256 << 10,
             tree="events.out.tfevents.*", metrics=True),
    # verl's validation_data_dir: <global_step>.jsonl (docs/validation.md). Its parser reads
    # each line once, however long the round it holds back, so a call parses about one read
    # of the follower's (960 KiB) on the loop, as the other kinds' do
    FileKind("validation", "evaluation or rollout samples as JSONL, a folder of one file a "
             "round (verl's <step>.jsonl) or one file of rounds, posted to /validation "
             "(repeatable)", _validation_parsers, parse_bytes=1 << 20, tree="*.jsonl",
             file_too=True, route="validation", survey=_validation_survey,
             reporting_node=True),
)


BY_NAME = {kind.name: kind for kind in FILE_KINDS}


def file_too(name: str) -> bool:
    """Whether a pattern of the `tree` kind `name` may also name one file."""
    return name in BY_NAME and BY_NAME[name].file_too


def folder_hint(name: str) -> str:
    """The glob a folder given for a file of kind `name` should have named; `*` when unknown."""
    return BY_NAME[name].folder_hint if name in BY_NAME else "*"
