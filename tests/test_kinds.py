"""The registry of file-source kinds (sources/files/kinds.py) as the rest of the sidecar reads
it: the specs the pipeline follows, and the sources.json a run leaves for `sidecar replay`."""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.node import Node
from sidecar.pipeline import SOURCES_FILE, recorded_sources, source_specs
from sidecar.records import LOG_BLOCK
from sidecar.sources.files.kinds import BY_NAME
from sidecar.sources.files.tensorboard import EventFile
from tests.test_config import cfg


def test_a_log_kind_is_one_spec_and_a_tensorboard_folder_one_each(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    specs = source_specs(cfg("--log", "a.log", "--log", "b*.log", "--jsonl", "m.jsonl",
                             "--tensorboard", str(runs), "--tensorboard", "other"),
                         Node("n", 0))
    assert [(s.kind, s.patterns, s.option, s.parse_bytes, s.tree) for s in specs] == [
        ("log", ("a.log", "b*.log"), "--log", LOG_BLOCK, ""),
        ("jsonl", ("m.jsonl",), "--jsonl", 64 << 10, ""),
        ("tensorboard", (str(runs),), "--tensorboard", 256 << 10, "events.out.tfevents.*"),
        ("tensorboard", ("other",), "--tensorboard", 256 << 10, "events.out.tfevents.*"),
    ]
    parser = specs[2].make_parser(runs / "train" / "events.out.tfevents.1", {})
    assert isinstance(parser, EventFile)


def test_a_log_parser_made_is_told_to_the_pipeline() -> None:
    made: list[object] = []
    spec, = source_specs(cfg("--log", "a.log"), Node("n", 0), made.append)
    parser = spec.make_parser(Path("a.log"), {})
    assert made == [parser]


def _recorded(run_dir: Path) -> dict[str, tuple[str, ...]]:
    """The recorded sources of every kind, which the kinds given none must have."""
    found = recorded_sources(run_dir)
    assert found is not None and set(found) == set(BY_NAME)
    return {kind: paths for kind, paths in found.items() if paths}


def test_the_sources_an_earlier_run_recorded_are_read_back(tmp_path: Path) -> None:
    (tmp_path / SOURCES_FILE).write_text(json.dumps(
        {"log": ["/o/a.log"], "jsonl": ["/o/m.jsonl", "/o/n.jsonl"], "tensorboard": []}))
    assert _recorded(tmp_path) == {"log": ("/o/a.log",), "jsonl": ("/o/m.jsonl", "/o/n.jsonl")}


def test_a_kind_the_recorded_sources_do_not_name_has_none(tmp_path: Path) -> None:
    (tmp_path / SOURCES_FILE).write_text(json.dumps({"jsonl": ["/o/m.jsonl"]}))
    assert _recorded(tmp_path) == {"jsonl": ("/o/m.jsonl",)}


def test_recorded_sources_that_are_not_lists_of_paths_are_set_aside(tmp_path: Path) -> None:
    (tmp_path / SOURCES_FILE).write_text(json.dumps({"log": "/o/a.log", "jsonl": []}))
    assert recorded_sources(tmp_path) is None
    assert not (tmp_path / SOURCES_FILE).exists()
