"""`--hparams FILE`: JSON, YAML and TOML configs flattened with dots for /hparams."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sidecar.exits import ConfigError
from sidecar.sources.files.hparams import flatten, load_hparams
from tests.conftest import Sidecar, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest

NESTED: dict[str, Any] = {
    "model": {"name": "resnet50", "layers": [64, 128, {"units": 256, "act": "gelu"}],
              "dropout": 0.1},
    "optimizer": {"lr": 0.0003, "betas": [0.9, 0.999], "amsgrad": False},
    "epochs": 90,
    "seed": None,
}
FLAT = {
    "model.name": "resnet50", "model.layers.0": 64, "model.layers.1": 128,
    "model.layers.2.units": 256, "model.layers.2.act": "gelu", "model.dropout": 0.1,
    "optimizer.lr": 0.0003, "optimizer.betas.0": 0.9, "optimizer.betas.1": 0.999,
    "optimizer.amsgrad": False, "epochs": 90, "seed": None,
}
TOML = """\
epochs = 90
[model]
name = "resnet50"
layers = [64, 128, {units = 256, act = "gelu"}]
dropout = 0.1
[optimizer]
lr = 0.0003
betas = [0.9, 0.999]
amsgrad = false
"""


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _assert_same_types(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got == expected
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}


# --- the three formats -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "config.JSON", "hparams"])
def test_json_is_flattened_with_dots(tmp_path: Path, name: str) -> None:
    _assert_same_types(load_hparams(_write(tmp_path, name, json.dumps(NESTED))), FLAT)


@pytest.mark.parametrize("name", ["config.yaml", "config.yml", "config.YAML"])
def test_yaml_is_flattened_with_dots(tmp_path: Path, name: str) -> None:
    _assert_same_types(load_hparams(_write(tmp_path, name, yaml.safe_dump(NESTED))), FLAT)


def test_toml_is_flattened_with_dots(tmp_path: Path) -> None:
    expected = {k: v for k, v in FLAT.items() if k != "seed"}  # TOML has no null
    _assert_same_types(load_hparams(_write(tmp_path, "config.toml", TOML)), expected)


def test_scalars_are_kept_with_their_types(tmp_path: Path) -> None:
    text = 'text = "a"\nempty = ""\nint = -3\nbig = 9007199254740993\nfloat = 2.5\nyes = true\n'
    got = load_hparams(_write(tmp_path, "c.toml", text))
    _assert_same_types(got, {"text": "a", "empty": "", "int": -3, "big": 9007199254740993,
                             "float": 2.5, "yes": True})


def test_dates_become_strings(tmp_path: Path) -> None:
    got = load_hparams(_write(tmp_path, "c.yaml", "day: 2026-11-30\n"))
    assert got == {"day": "2026-11-30"}
    toml = load_hparams(_write(tmp_path, "c.toml", "at = 2026-11-30T10:00:00Z\n"))
    assert isinstance(toml["at"], str) and toml["at"].startswith("2026-11-30")


# --- invalid numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "text"), [
    ("c.json", '{"lr": NaN, "a": [1, Infinity, 3], "b": {"c": -Infinity}, "ok": 1.5}'),
    ("c.yaml", "lr: .nan\na: [1, .inf, 3]\nb: {c: -.inf}\nok: 1.5\n"),
    ("c.toml", "lr = nan\na = [1, inf, 3]\nok = 1.5\n[b]\nc = -inf\n"),
])
def test_nan_and_infinities_are_dropped(tmp_path: Path, name: str, text: str) -> None:
    got = load_hparams(_write(tmp_path, name, text))
    assert got == {"a.0": 1, "a.2": 3, "ok": 1.5}
    assert all(not isinstance(v, float) or math.isfinite(v) for v in got.values())


# --- flatten on its own --------------------------------------------------------------------------


def test_flatten_nested_dicts_lists_and_tuples() -> None:
    got = flatten({"a": {"b": {"c": 1}}, "l": [[1, 2], {"x": "y"}], "t": (True, None)})
    assert got == {"a.b.c": 1, "l.0.0": 1, "l.0.1": 2, "l.1.x": "y", "t.0": True, "t.1": None}


def test_flatten_with_a_prefix_and_empty_containers() -> None:
    assert flatten({"a": 1, "e": {}, "l": []}, prefix="cfg.") == {"cfg.a": 1}


_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=4),
                  st.floats(allow_nan=False, allow_infinity=False))
_tree = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=3), inner, max_size=3)),
    max_leaves=15)


@given(data=st.dictionaries(st.text(alphabet="xyz", min_size=1, max_size=3), _tree, max_size=4))
def test_flatten_gives_only_scalars_and_every_leaf_is_reachable(data: dict[str, Any]) -> None:
    flat = flatten(data)
    for key, value in flat.items():
        assert value is None or isinstance(value, str | int | float | bool)
        node: Any = data
        for part in key.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        assert node == value


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "text", "kind"), [
    ("c.json", '{"lr": 0.1,', "JSON"),
    ("c.json", "", "JSON"),
    ("c.json", b'{"a": "\xff"}', "JSON"),
    ("c.yaml", "a: [1, 2\nb: 3\n", "YAML"),
    ("c.yml", "a: b: c\n", "YAML"),
    ("c.yaml", b"a: \xff\xfe\n", "YAML"),
    ("c.toml", "lr = \n", "TOML"),
    ("c.toml", b'x = "\xff"\n', "TOML"),
    ("c.toml", "a = 1\na = 2\n", "TOML"),
])
def test_bad_file_is_a_config_error_naming_the_option_and_file(
        tmp_path: Path, name: str, text: str | bytes, kind: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(ConfigError) as caught:
        load_hparams(path)
    message = str(caught.value)
    assert "--hparams" in message and str(path) in message
    assert kind in message


@pytest.mark.parametrize(("name", "text"), [
    ("c.json", "[1, 2, 3]"), ("c.json", "42"), ("c.json", '"text"'), ("c.json", "null"),
    ("c.yaml", "- a\n- b\n"), ("c.yaml", "just a string\n"), ("c.yaml", ""),
])
def test_top_level_that_is_not_a_mapping_is_a_config_error(
        tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(ConfigError) as caught:
        load_hparams(path)
    assert "--hparams" in str(caught.value) and str(path) in str(caught.value)
    assert "mapping" in str(caught.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        load_hparams(path)
    assert "--hparams" in str(caught.value) and str(path) in str(caught.value)


def test_folder_instead_of_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_hparams(tmp_path)
    assert "--hparams" in str(caught.value) and str(tmp_path) in str(caught.value)


# --- bugs found --------------------------------------------------------------------------------


def test_self_referencing_yaml_alias_is_a_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.yaml", "a: &loop [1, *loop]\n")
    with pytest.raises(ConfigError) as caught:
        load_hparams(path)
    assert "--hparams" in str(caught.value) and str(path) in str(caught.value)


def test_too_deeply_nested_json_is_reported_as_json(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.json", "[" * 100_000)
    with pytest.raises(ConfigError) as caught:
        load_hparams(path)
    assert "JSON" in str(caught.value) and "YAML" not in str(caught.value)


# --- through the real process: a file the trainer writes -------------------------------------

WRITES_CONFIG_LATER = """
import os, pathlib, sys, time
path, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
time.sleep(0.3)  # the trainer starts, then Hydra writes its config
path.parent.mkdir(parents=True)
path.write_text("optimizer:\\n  lr: 0.1\\nseed: 1\\n")
print("training", flush=True)
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
path.write_text("optimizer:\\n  lr: 0.01\\n")  # changed: sent again
print("done", flush=True)
"""


def test_run_waits_for_a_file_the_trainer_writes_and_sends_it_again_when_it_changes(
        ingest: RunningIngest, tmp_path: Path) -> None:
    config = tmp_path / "outputs" / ".hydra" / "config.yaml"
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    run = Sidecar(["run", "--hparams", str(config), "--",
                   *python_child(WRITES_CONFIG_LATER), str(config), str(go)], env,
                  tmp_path / "run")
    try:
        ingest.wait_for(lambda: ingest.records("hparams"), 20)
        assert ingest.records("hparams")[0]["params"] == {"optimizer.lr": 0.1, "seed": 1}
        go.touch()
    finally:
        done = run.wait(60)
    assert done.status == 0, done.stderr
    sent = [r["params"] for r in ingest.records("hparams")]
    assert sent == [{"optimizer.lr": 0.1, "seed": 1}, {"optimizer.lr": 0.01}]
    assert "configuration error" not in done.stderr.decode()
    said = [line for line in done.stderr.decode().splitlines() if "sent" in line]
    assert any(f"--hparams {config}: 2 parameters sent" in line for line in said), said
    assert any(f"--hparams {config}: 1 parameter sent again" in line for line in said), said


def test_a_file_that_cannot_be_read_is_said_once_and_the_run_goes_on(
        ingest: RunningIngest, tmp_path: Path) -> None:
    config = tmp_path / "hparams.yaml"
    config.write_text("- a list\n- not a mapping\n")
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--hparams", str(config), "--", *python_child("print('trained')")],
                   env, tmp_path / "run")
    assert done.status == 0, done.stderr
    said = [line for line in done.stderr.decode().splitlines() if "not a mapping" in line]
    assert len(said) == 1 and " WARNING " in said[0]
    assert ingest.records("hparams") == []
    assert any("trained" in c for r in ingest.records("logs") for c in r["chunks"])


def test_a_file_that_never_appears_is_said_at_the_end(ingest: RunningIngest,
                                                       tmp_path: Path) -> None:
    config = tmp_path / "lightning_logs" / "version_0" / "hparams.yaml"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--hparams", str(config), "--", *python_child("print('trained')")],
                   env, tmp_path / "run")
    assert done.status == 0, done.stderr
    said = [line for line in done.stderr.decode().splitlines() if str(config) in line]
    assert len(said) == 1 and " WARNING " in said[0] and "never appeared" in said[0]


def test_a_yaml_parse_error_is_said_on_one_line_with_its_place(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """The warning spanned four lines (PyYAML's problem, its `<byte string>` place, what it was
    scanning, where that began), and a log line is one event (issue 35)."""
    config = tmp_path / "hparams.yaml"
    config.write_text('lr: 0.1\nname: "abc\nseed: 1\n')
    env = platform_env(ingest, tmp_path / "state", SIDECAR_HARDWARE_INTERVAL="0")
    done = sidecar(["run", "--hparams", str(config), "--", *python_child("pass")], env,
                   tmp_path / "run")
    assert done.status == 0, done.stderr
    said = [line for line in done.stderr.decode().splitlines() if "not valid YAML" in line]
    assert len(said) == 1, done.stderr
    assert f"--hparams {config}: not valid YAML (found unexpected end of stream at line 4, " \
           "column 1, while scanning a quoted scalar begun at line 2, column 7)" in said[0]
    assert "byte string" not in done.stderr.decode()
    assert " WARNING " in said[0] and said[0].endswith("(the run goes on)")
