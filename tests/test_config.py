"""Config resolution: options by precedence (docs/commands.md#where-options-come-from) and the
platform's variables (docs/ingest.md#the-platforms-variables)."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from sidecar.cli import build_parser
from sidecar.config import (
    Config,
    probe_options,
    resolve,
    resolve_platform,
    unknown_variables,
)
from sidecar.exits import ConfigError
from sidecar.options import OPTIONS, option
from sidecar.sources.files.kinds import FILE_KINDS
from tests.conftest import SIDECAR, clean_environ

TOKEN = "tok-SECRET-0123456789abcdef"
ENDPOINT = "https://platform.example.com/api/ingest"
RUN_ID = "run-4f2a91"
HOME = "/home/trainer"

STARFORGE = {"STARFORGE_ENABLED": "1", "STARFORGE_ENDPOINT": ENDPOINT,
             "STARFORGE_RUN_ID": RUN_ID, "STARFORGE_TOKEN": TOKEN}
TUNEPLANE = {"TUNEPLANE_JOB_ENABLED": "1", "TUNEPLANE_JOB_ENDPOINT": ENDPOINT,
             "TUNEPLANE_JOB_RUN_ID": RUN_ID, "TUNEPLANE_JOB_TOKEN": TOKEN}
OFFLINE = {"STARFORGE_ENABLED": "0"}


def parse(*options: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *options, "--", "./train.sh", "--lr", "3e-4"])


def cfg(*options: str, **environ: str) -> Config:
    """Resolve `run` with these options and this environment (offline unless told otherwise)."""
    env = {"HOME": HOME, **OFFLINE, **environ}
    return resolve(parse(*options), "run", env)


def config_error(*options: str, environ: dict[str, str]) -> str:
    """The message of the ConfigError that resolving raises; fails if none is raised."""
    with pytest.raises(ConfigError) as info:
        resolve(parse(*options), "run", {"HOME": HOME, **environ})
    message = str(info.value)
    assert TOKEN not in message
    return message


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    return tmp_path / "sidecar.toml"


# --- the options table and Config ------------------------------------------------------------


# What a Config field of each kind of option holds; `T | None` where the row's default is None.
FIELD_TYPES: dict[str, Any] = {"str": str, "float": float, "int": int, "bool": bool,
                               "path": Path, "list": tuple[str, ...]}
# Config's fields that are no option: the platform's, and what `resolve` finds of the state dir.
NOT_OPTIONS = {"platform", "token", "state_dir_is_default", "node_folder"}


def test_every_option_has_a_config_field_of_its_type_and_no_second_default() -> None:
    hints = typing.get_type_hints(Config)
    # the file-source kinds' options fold into one field, `files`, keyed by kind
    kinds = {kind.name for kind in FILE_KINDS}
    assert set(hints) - NOT_OPTIONS == {
        opt.attr for opt in OPTIONS if opt.name not in kinds} | {"files"}
    assert hints["files"] == Mapping[str, tuple[str, ...]]
    assert Config._field_defaults == {}, "a default is written in OPTIONS alone"
    defaults = cfg()
    assert defaults.files == {name: option(name).default for name in kinds}
    for opt in OPTIONS:
        if opt.name in kinds:
            assert opt.kind == "list", opt.name
            continue
        typed = FIELD_TYPES[opt.kind]
        # --state-dir's default, None, is found by resolve: a Config always has its folder
        if opt.default is None and opt.name != "state-dir":
            assert hints[opt.attr] == typed | None, opt.name
        else:
            assert hints[opt.attr] == typed, opt.name
            assert isinstance(getattr(defaults, opt.attr),
                              typing.get_origin(typed) or typed), opt.name
        if opt.name != "state-dir":
            assert getattr(defaults, opt.attr) == opt.default, opt.name


def test_the_options_a_command_does_not_take_keep_their_defaults() -> None:
    watch = resolve(build_parser("watch").parse_args(["watch"]), "watch",
                    {"HOME": HOME, **OFFLINE, "SIDECAR_LOG_RATE": "1", "SIDECAR_TTY": "1"})
    run_only = [opt for opt in OPTIONS if opt.only == "run"]
    assert {opt.name for opt in run_only} == {"running-when", "tty", "log-rate"}
    for opt in run_only:
        assert getattr(watch, opt.attr) == opt.default, opt.name


def test_a_busy_status_addr_is_refused_by_the_probe_not_by_resolving() -> None:
    """`check` and `config` resolve as `run` does, and hold nothing: only `run` and `watch`
    probe (tests/test_cli.py runs them)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        resolved = cfg("--status-addr", taken)
        assert resolved.status_addr == taken
        with pytest.raises(ConfigError, match=f"^--status-addr {taken} .*cannot listen there"):
            probe_options(resolved)
    probe_options(cfg("--status-addr", "off"))


# --- precedence: command line > SIDECAR_* > --config file > default -------------------------


def test_defaults() -> None:
    c = cfg()
    assert c.drain_timeout == 20.0
    assert c.hardware_interval == 10.0
    assert c.files["log"] == ()
    assert c.status_addr == "127.0.0.1:9620"
    assert c.running_when == "spawn"
    assert c.log_format == "auto"
    assert c.token_file is None
    assert not c.platform.enabled


def test_float_precedence(toml: Path) -> None:
    toml.write_text("drain-timeout = 7.5\n")
    assert cfg("--config", str(toml)).drain_timeout == 7.5
    assert cfg("--config", str(toml), SIDECAR_DRAIN_TIMEOUT="5").drain_timeout == 5.0
    c = cfg("--config", str(toml), "--drain-timeout", "3", SIDECAR_DRAIN_TIMEOUT="5")
    assert c.drain_timeout == 3.0
    assert isinstance(c.drain_timeout, float)


def test_list_precedence_and_colon_separation(toml: Path) -> None:
    toml.write_text('log = ["file.log"]\njsonl = "one.jsonl"\n')
    c = cfg("--config", str(toml))
    assert c.files["log"] == ("file.log",)
    assert c.files["jsonl"] == ("one.jsonl",)
    c = cfg("--config", str(toml), SIDECAR_LOG="/var/log/a.log:/data/*.log::")
    assert c.files["log"] == ("/var/log/a.log", "/data/*.log")
    c = cfg("--config", str(toml), "--log", "x.log", "--log", "y*.log", SIDECAR_LOG="a:b")
    assert c.files["log"] == ("x.log", "y*.log")


def test_path_precedence_and_underscore_keys(toml: Path, tmp_path: Path) -> None:
    toml.write_text(f'state_dir = "{tmp_path / "from-file"}"\n')
    assert cfg("--config", str(toml)).state_dir == tmp_path / "from-file"
    toml.write_text(f'state-dir = "{tmp_path / "from-file"}"\n')
    assert cfg("--config", str(toml)).state_dir == tmp_path / "from-file"
    c = cfg("--config", str(toml), SIDECAR_STATE_DIR=str(tmp_path / "from-env"))
    assert c.state_dir == tmp_path / "from-env"
    c = cfg("--config", str(toml), "--state-dir", str(tmp_path / "from-cli"),
            SIDECAR_STATE_DIR=str(tmp_path / "from-env"))
    assert c.state_dir == tmp_path / "from-cli"
    assert isinstance(c.state_dir, Path)


def test_config_keeps_the_command_after_the_separator() -> None:
    args = parse("--drain-timeout", "1")
    assert args.command[-3:] == ["./train.sh", "--lr", "3e-4"]


# --- platform families (docs/ingest.md#the-platforms-variables) --------------------------------


@pytest.mark.parametrize(("environ", "header", "other"), [
    (STARFORGE, "X-StarForge-Token", "X-TunePlane-Token"),
    (TUNEPLANE, "X-TunePlane-Token", "X-StarForge-Token"),
])
def test_each_family_alone(environ: dict[str, str], header: str, other: str) -> None:
    platform = resolve_platform(environ)
    assert platform.enabled
    assert platform.endpoint == ENDPOINT
    assert platform.run_id == RUN_ID
    assert header in platform.token_headers
    assert other not in platform.token_headers
    c = resolve(parse(), "run", {"HOME": HOME, **environ})
    assert c.token == TOKEN
    assert c.read_token() == TOKEN


def test_both_families_agreeing_is_fine() -> None:
    c = resolve(parse(), "run", {"HOME": HOME, **STARFORGE, **TUNEPLANE})
    assert c.platform.enabled
    assert c.platform.endpoint == ENDPOINT
    assert c.platform.run_id == RUN_ID
    assert c.token == TOKEN


@pytest.mark.parametrize(("starforge", "tuneplane", "value"), [
    ("STARFORGE_ENDPOINT", "TUNEPLANE_JOB_ENDPOINT", "https://other.example.com/api/ingest"),
    ("STARFORGE_RUN_ID", "TUNEPLANE_JOB_RUN_ID", "run-other"),
    ("STARFORGE_TOKEN", "TUNEPLANE_JOB_TOKEN", "tok-OTHER-fedcba9876543210"),
    ("STARFORGE_ENABLED", "TUNEPLANE_JOB_ENABLED", "0"),
])
def test_families_disagreeing_name_both_variables(starforge: str, tuneplane: str,
                                                  value: str) -> None:
    environ = {**STARFORGE, **TUNEPLANE, tuneplane: value}
    message = config_error(environ=environ)
    assert starforge in message
    assert tuneplane in message
    assert "tok-OTHER" not in message


def test_trailing_slash_of_the_endpoint_is_dropped() -> None:
    platform = resolve_platform({**STARFORGE, "STARFORGE_ENDPOINT": ENDPOINT + "/"})
    assert platform.endpoint == ENDPOINT


@pytest.mark.parametrize("family", ["STARFORGE_ENABLED", "TUNEPLANE_JOB_ENABLED"])
@pytest.mark.parametrize("value", ["yes", "", "true", "2", " 1"])
def test_enabled_must_be_0_or_1(family: str, value: str) -> None:
    environ = {**(STARFORGE if family.startswith("STAR") else TUNEPLANE), family: value}
    assert family in config_error(environ=environ)


@pytest.mark.parametrize("environ", [
    {},
    {"STARFORGE_ENDPOINT": ENDPOINT, "STARFORGE_RUN_ID": RUN_ID, "STARFORGE_TOKEN": TOKEN},
    {"TUNEPLANE_JOB_ENDPOINT": ENDPOINT, "TUNEPLANE_JOB_TOKEN": TOKEN},
])
def test_enabled_unset_is_an_error_naming_the_variable(environ: dict[str, str]) -> None:
    message = config_error(environ=environ)
    assert "STARFORGE_ENABLED" in message or "TUNEPLANE_JOB_ENABLED" in message
    if environ.get("TUNEPLANE_JOB_ENDPOINT"):
        assert "TUNEPLANE_JOB_ENABLED" in message


@pytest.mark.parametrize("enabled", ["STARFORGE_ENABLED", "TUNEPLANE_JOB_ENABLED"])
def test_offline_needs_nothing_else(enabled: str) -> None:
    c = resolve(parse(), "run", {"HOME": HOME, enabled: "0"})
    assert not c.platform.enabled
    assert c.token == ""
    assert c.run_dir.parent == c.state_dir


def test_offline_ignores_an_unreadable_token_file(tmp_path: Path) -> None:
    c = cfg("--token-file", str(tmp_path / "missing"))
    assert not c.platform.enabled


@pytest.mark.parametrize("family", [STARFORGE, TUNEPLANE])
@pytest.mark.parametrize("which", ["_ENDPOINT", "_RUN_ID", "_TOKEN"])
def test_enabled_needs_endpoint_run_id_and_token(family: dict[str, str], which: str) -> None:
    missing = next(name for name in family if name.endswith(which))
    for absent in ({k: v for k, v in family.items() if k != missing}, {**family, missing: "  "}):
        assert missing in config_error(environ=absent)


@pytest.mark.parametrize("endpoint", [
    "ftp://platform.example.com/api/ingest",
    "platform.example.com/api/ingest",
    "https://",
    "file:///etc/passwd",
])
def test_endpoint_must_be_http_or_https(endpoint: str) -> None:
    assert "STARFORGE_ENDPOINT" in config_error(environ={**STARFORGE,
                                                         "STARFORGE_ENDPOINT": endpoint})


def test_http_endpoint_is_accepted() -> None:
    platform = resolve_platform({**STARFORGE, "STARFORGE_ENDPOINT": "http://10.0.0.5:8080/api/ingest"})
    assert platform.endpoint == "http://10.0.0.5:8080/api/ingest"


# --- the token ----------------------------------------------------------------------------------


def test_token_file_wins_and_is_stripped(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("  tok-FROM-FILE-42 \n\n")
    c = resolve(parse("--token-file", str(secret)), "run", {"HOME": HOME, **STARFORGE})
    assert c.token == "tok-FROM-FILE-42"
    secret.write_text("tok-ROTATED\n")
    assert c.read_token() == "tok-ROTATED"  # re-read on demand (after a 401)


def test_token_file_from_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("tok-FROM-FILE-42\n")
    environ = {"HOME": HOME, **STARFORGE, "SIDECAR_TOKEN_FILE": str(secret)}
    assert resolve(parse(), "run", environ).token == "tok-FROM-FILE-42"


@pytest.mark.parametrize("content", ["", "\n", "   \n\t\n"])
def test_empty_token_file_is_an_error(tmp_path: Path, content: str) -> None:
    secret = tmp_path / "token"
    secret.write_text(content)
    assert "--token-file" in config_error("--token-file", str(secret), environ=STARFORGE)


def test_missing_token_file_is_an_error(tmp_path: Path) -> None:
    message = config_error("--token-file", str(tmp_path / "nope"), environ=STARFORGE)
    assert "--token-file" in message


def test_token_never_in_repr_of_config(tmp_path: Path) -> None:
    c = resolve(parse(), "run", {"HOME": HOME, **STARFORGE})
    assert TOKEN not in repr(c)
    assert TOKEN not in str(c)
    assert TOKEN not in repr(c.platform)
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    c = resolve(parse("--token-file", str(secret)), "run", {"HOME": HOME, **TUNEPLANE})
    assert c.token == TOKEN
    assert TOKEN not in repr(c)


@pytest.mark.parametrize("environ", [
    {**STARFORGE, "STARFORGE_ENDPOINT": "ftp://x"},
    {**STARFORGE, "STARFORGE_RUN_ID": ""},
    {**STARFORGE, "STARFORGE_ENABLED": "yes"},
    {**STARFORGE, "TUNEPLANE_JOB_TOKEN": TOKEN + "x"},
    {**STARFORGE, "SIDECAR_DRAIN_TIMEOUT": "abc"},
    {**STARFORGE, "SIDECAR_STATUS_ADDR": "nowhere"},
    {"TUNEPLANE_JOB_TOKEN": TOKEN},
])
def test_token_never_in_error_messages(environ: dict[str, str]) -> None:
    config_error(environ=environ)  # asserts the token is absent


# --- malformed values ----------------------------------------------------------------------------


def test_unknown_toml_key_is_an_error(toml: Path) -> None:
    toml.write_text('drain-timeout = 5\nlog_lvl = "debug"\n')
    message = config_error("--config", str(toml), environ=OFFLINE)
    assert "log_lvl" in message


def test_toml_token_key_is_refused_without_echoing_it(toml: Path) -> None:
    toml.write_text(f'token = "{TOKEN}"\n')
    assert "token" in config_error("--config", str(toml), environ=OFFLINE)


def test_invalid_or_missing_toml_file_is_an_error(toml: Path) -> None:
    toml.write_text("drain-timeout = = 5\n")
    assert "--config" in config_error("--config", str(toml), environ=OFFLINE)
    assert "--config" in config_error("--config", str(toml.with_name("absent.toml")),
                                      environ=OFFLINE)


@pytest.mark.parametrize(("name", "value"), [
    ("SIDECAR_DRAIN_TIMEOUT", "abc"),
    ("SIDECAR_HARDWARE_INTERVAL", "10s"),
    ("SIDECAR_NODES", "two"),
    ("SIDECAR_NODES", "2.5"),
])
def test_bad_number_in_the_environment_names_the_variable(name: str, value: str) -> None:
    assert name in config_error(environ={**OFFLINE, name: value})


@pytest.mark.parametrize("toml_value", ['"abc"', "true", "[1, 2]"])
def test_bad_number_in_the_file_names_the_option(toml: Path, toml_value: str) -> None:
    toml.write_text(f"drain-timeout = {toml_value}\n")
    assert "drain-timeout" in config_error("--config", str(toml), environ=OFFLINE)


def test_bad_number_on_the_command_line_names_the_option() -> None:
    assert "--drain-timeout" in config_error("--drain-timeout", "soon", environ=OFFLINE)


@pytest.mark.parametrize(("option", "value"), [
    ("--drain-timeout", "-1"), ("--hardware-interval", "-0.5"), ("--nodes", "0"),
])
def test_negative_values_are_errors(option: str, value: str) -> None:
    assert option in config_error(option, value, environ=OFFLINE)


def test_zero_hardware_interval_turns_sampling_off_and_is_accepted() -> None:
    assert cfg("--hardware-interval", "0").hardware_interval == 0.0


@pytest.mark.parametrize(("name", "value"), [
    ("SIDECAR_LOG_FORMAT", "xml"),
    ("SIDECAR_RUNNING_WHEN", "later"),
    ("SIDECAR_MESSAGE_FORMAT", "yaml"),
    ("SIDECAR_LOG_LEVEL", "loud"),
])
def test_bad_choice_in_the_environment_names_the_variable(name: str, value: str) -> None:
    message = config_error(environ={**OFFLINE, name: value})
    assert name in message
    assert value in message


def test_bad_choice_in_the_file_is_an_error(toml: Path) -> None:
    toml.write_text('log-format = "xml"\n')
    assert "log-format" in config_error("--config", str(toml), environ=OFFLINE)


def test_bad_choice_on_the_command_line_is_refused_with_the_configuration() -> None:
    """Checked with every other mistake of the configuration, not by argparse alone."""
    with pytest.raises(ConfigError) as info:
        cfg("--log-format", "xml", "--log-ansi", "no")
    assert sorted(info.value.problems) == ["--log-ansi='no' must be one of strip, keep",
                                           "--log-format='xml' must be one of plain, cri, auto"]


def test_choices_are_accepted() -> None:
    c = cfg("--log-format", "cri", "--running-when", "marker", SIDECAR_MESSAGE_FORMAT="json")
    assert (c.log_format, c.running_when, c.message_format) == ("cri", "marker", "json")


@pytest.mark.parametrize("addr", ["localhost", "localhost:", ":9620", "127.0.0.1:65536",
                                  "127.0.0.1:http", "127.0.0.1:-1", ""])
def test_malformed_status_addr_is_an_error(addr: str) -> None:
    assert "--status-addr" in config_error("--status-addr", addr, environ=OFFLINE)


@pytest.mark.parametrize("addr", ["off", "0.0.0.0:0", "[::1]:9620", "localhost:65535"])
def test_status_addr_forms_accepted(addr: str) -> None:
    assert cfg("--status-addr", addr).status_addr == addr


@pytest.mark.parametrize("name", ["SIDECAR_DRAIN_TIMEOUT", "SIDECAR_HARDWARE_INTERVAL"])
def test_nan_seconds_are_an_error(name: str) -> None:
    assert name in config_error(environ={**OFFLINE, name: "nan"})


def test_fractional_nodes_in_the_file_is_an_error(toml: Path) -> None:
    toml.write_text("nodes = 2.5\n")
    assert "nodes" in config_error("--config", str(toml), environ=OFFLINE)


@pytest.mark.parametrize(("name", "value"), [
    ("SIDECAR_DRAIN_TIMEOUT", "-1"), ("SIDECAR_STATUS_ADDR", "nowhere"),
])
def test_range_error_from_the_environment_names_the_variable(name: str, value: str) -> None:
    assert name in config_error(environ={**OFFLINE, name: value})


@pytest.mark.parametrize(("options", "environ", "message"), [
    (["--drain-timeout", "-1"], {}, "--drain-timeout=-1.0 must be a number, 0 or more"),
    ([], {"SIDECAR_STALL_AFTER": "nan"}, "SIDECAR_STALL_AFTER=nan must be a number, 0 or more"),
    ([], {"SIDECAR_HARDWARE_INTERVAL": "inf"},
     "SIDECAR_HARDWARE_INTERVAL=inf must be a number, 0 or more"),
    (["--log-rate", "-2"], {}, "--log-rate=-2.0 must be a number, 0 or more"),
    (["--hardware-interval", "0.5"], {}, "--hardware-interval=0.5 is below the floor of 1 s: "
     "sampling faster costs the trainer's CPU and floods /hardware; give 1 or more, or 0 to "
     "turn sampling off"),
    (["--nodes", "0"], {}, "--nodes=0 must be at least 1"),
    ([], {"SIDECAR_NODES": "-3"}, "SIDECAR_NODES=-3 must be at least 1"),
    (["--status-addr", "foo"], {},
     "--status-addr='foo' is not HOST:PORT (for example 127.0.0.1:9620) or off"),
    (["--gpus", "0,x"], {}, "--gpus='0,x': 'x' is neither a GPU index nor a UUID; give NVML "
     "indexes or UUIDs separated by commas, for example 0,1 or GPU-5f2c...,GPU-91ab... "
     "(`nvidia-smi -L` lists them)"),
    (["--log-prefix", "{x}"], {}, "--log-prefix='{x}' uses {x}; only {node} and {rank} are "
     "filled in; write {{ or }} for a literal brace"),
    (["--artifact-uri", "/a=s3://b", "--artifact-uri", "foo"], {}, "--artifact-uri='foo' is "
     "not LOCAL=URI; give the local folder and the URI it mirrors, as in "
     "/mnt/ckpt=s3://bucket/run-1/ckpt"),
])
def test_each_range_and_check_says_its_message(options: list[str], environ: dict[str, str],
                                               message: str) -> None:
    assert config_error(*options, environ={**OFFLINE, **environ}) == message


# --- state dir and run dir -----------------------------------------------------------------------


def test_default_state_dir_from_xdg_state_home() -> None:
    assert cfg(XDG_STATE_HOME="/state").state_dir == Path("/state/sidecar")


@pytest.mark.parametrize("xdg", [None, ""])
def test_default_state_dir_from_home(xdg: str | None) -> None:
    extra = {} if xdg is None else {"XDG_STATE_HOME": xdg}
    assert cfg(**extra).state_dir == Path(HOME) / ".local" / "state" / "sidecar"


def test_run_dir_is_named_after_the_run_id(tmp_path: Path) -> None:
    c = cfg("--state-dir", str(tmp_path), **STARFORGE)
    assert c.run_dir == tmp_path / RUN_ID


@pytest.mark.parametrize("run_id", ["../../etc", "..", ".", "/etc/passwd", "a/b/../c", ".hidden",
                                    "x\\..\\y", "run\x00id", "~root"])
def test_run_dir_is_one_component_under_the_state_dir(tmp_path: Path, run_id: str) -> None:
    c = cfg("--state-dir", str(tmp_path), **{**STARFORGE, "STARFORGE_RUN_ID": run_id})
    assert c.platform.run_id == run_id
    name = c.run_dir.name
    assert c.run_dir.parent == tmp_path
    assert name not in ("", ".", "..")
    assert "/" not in name
    assert "\x00" not in name
    assert c.run_dir.resolve().parent == tmp_path.resolve()


@pytest.mark.parametrize("node", ["gpu-node-7", "../escape"])
def test_the_default_state_dir_has_a_folder_per_run_and_per_node(node: str) -> None:
    """A home folder may be shared by every node of a run (Slurm, NFS):
    docs/commands.md#the-state-folder."""
    c = cfg(**STARFORGE, NODE_NAME=node)
    run_folder = Path(HOME) / ".local" / "state" / "sidecar" / RUN_ID
    assert c.run_dir.parent == run_folder
    assert c.run_dir.name not in ("", ".", "..") and "/" not in c.run_dir.name
    assert cfg(**STARFORGE, NODE_NAME="other").run_dir != c.run_dir


def test_a_given_state_dir_has_no_node_folder(tmp_path: Path) -> None:
    assert cfg("--state-dir", str(tmp_path), **STARFORGE, NODE_NAME="n1").run_dir == (
        tmp_path / RUN_ID)


@pytest.mark.parametrize("interval", ["0.001", "0.5"])
def test_hardware_interval_below_one_second_is_refused(interval: str) -> None:
    message = config_error("--hardware-interval", interval, environ=OFFLINE)
    assert "--hardware-interval" in message and "0 to turn sampling off" in message


@pytest.mark.parametrize("template", ["[{node}] ", "{rank}/{node}: ", "{{literal}} ", ""])
def test_log_prefix_templates_accepted(template: str) -> None:
    assert cfg("--log-prefix", template).log_prefix == template


@pytest.mark.parametrize("template", ["{nod} ", "x{", "}", "{node.__class__}", "{0}", "{}",
                                      "{node!r}", "{rank:>{width}}"])
def test_log_prefix_templates_refused(template: str) -> None:
    message = config_error("--log-prefix", template, environ=OFFLINE)
    assert "--log-prefix" in message and "{node}" in message


@pytest.mark.parametrize("endpoint", ["https://h/api/ingest", "http://h:8080/api/ingest",
                                      "https://h/prefix/api/ingest/", "http://[::1]:80/api/ingest"])
def test_endpoints_accepted(endpoint: str) -> None:
    assert resolve_platform({**STARFORGE, "STARFORGE_ENDPOINT": endpoint}).endpoint == (
        endpoint.rstrip("/"))


@pytest.mark.parametrize("endpoint", ["https://h/", "https://h/api", "https://h/api/ingest?x=1",
                                      "http://h:0/api/ingest", "http://h:/api/ingest",
                                      "http://h:99999/api/ingest", "http://h:-1/api/ingest",
                                      "http://u:p@h/api/ingest", "http://u@h/api/ingest"])
def test_endpoints_refused(endpoint: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_platform({**STARFORGE, "STARFORGE_ENDPOINT": endpoint})
    assert "STARFORGE_ENDPOINT" in str(info.value) and "u:p" not in str(info.value)


@pytest.mark.parametrize("token", ["a b" + TOKEN, TOKEN + "\x00", TOKEN[:5] + "\u2028" + TOKEN[5:],
                                   "tök" + TOKEN])
def test_a_token_a_header_cannot_carry_is_refused_without_echoing_it(token: str) -> None:
    message = config_error(environ={**STARFORGE, "STARFORGE_TOKEN": token})
    assert "STARFORGE_TOKEN" in message and token not in message


# --- the sample file and `sidecar config` ---------------------------------------------------

SAMPLE = Path(__file__).parent.parent / "deploy" / "sidecar.toml"


def _uncommented(text: str) -> str:
    """The sample with its commented keys (`# key = value`) set too."""
    return "\n".join(line[2:] if re.match(r"# [a-z-]+ = ", line) else line
                     for line in text.splitlines())


def test_the_sample_file_holds_every_option_and_each_resolves(tmp_path: Path) -> None:
    text = SAMPLE.read_text()
    keys = set(re.findall(r"^(?:# )?([a-z-]+) = ", text, re.MULTILINE))
    assert keys == {opt.name for opt in OPTIONS}
    as_is = cfg("--config", str(SAMPLE))
    defaults = cfg()
    assert as_is.files == defaults.files
    for opt in OPTIONS:
        if opt.name != "state-dir" and opt.name not in defaults.files:
            assert getattr(as_is, opt.attr) == getattr(defaults, opt.attr), opt.name
    every = tmp_path / "every.toml"
    every.write_text(_uncommented(text))
    resolved = cfg("--config", str(every))
    assert resolved.hparams == Path("outputs/.hydra/config.yaml")
    assert resolved.nodes == 4 and resolved.node_name == "gpu-07"


def test_an_unknown_toml_key_gets_the_closest_one(toml: Path) -> None:
    toml.write_text('jsnol = ["out/*.jsonl"]\n')
    message = config_error("--config", str(toml), environ=OFFLINE)
    assert "unknown option 'jsnol'; did you mean jsonl?" in message
    toml.write_text("drain_timeut = 3\n")
    assert "did you mean drain-timeout?" in config_error("--config", str(toml), environ=OFFLINE)


@pytest.mark.parametrize(("name", "platform"), [
    ("SIDECAR_TOKEN", "STARFORGE_TOKEN or TUNEPLANE_JOB_TOKEN"),
    ("SIDECAR_ENDPOINT", "STARFORGE_ENDPOINT or TUNEPLANE_JOB_ENDPOINT"),
    ("SIDECAR_RUN_ID", "STARFORGE_RUN_ID or TUNEPLANE_JOB_RUN_ID")])
def test_a_sidecar_variable_for_a_platform_one_points_at_the_platform_s(name: str,
                                                                        platform: str) -> None:
    [warning] = unknown_variables({name: TOKEN})
    assert f"the platform's own variable is read instead: {platform}" in warning
    assert TOKEN not in warning and "SIDECAR_TOKEN_FILE?" not in warning


def config_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SIDECAR, "config", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_sidecar_config_prints_each_value_and_where_it_came_from(tmp_path: Path) -> None:
    file = tmp_path / "sidecar.toml"
    file.write_text('drain-timeout = 7.5\nlog-level = "debug"\n')
    env = {**clean_environ(), **STARFORGE, "SIDECAR_JSONL": "a.jsonl:b.jsonl",
           "SIDECAR_LOG_LEVEL": "warning", "SIDECAR_STATE_DIR": str(tmp_path / "state"),
           "SIDECAR_CONFIG": str(file), "SIDECAR_STATUS_ADDR": "127.0.0.1:1"}
    done = config_process(["--log", "x.log", "--tty"], env)
    assert done.returncode == 0, done.stderr
    assert TOKEN not in done.stdout + done.stderr
    rows = {line.split(" = ")[0]: line for line in done.stdout.splitlines() if " = " in line}
    assert rows["log"].startswith('log = ["x.log"]') and rows["log"].endswith("# --log")
    assert rows["jsonl"].startswith('jsonl = ["a.jsonl", "b.jsonl"]')
    assert rows["jsonl"].endswith("# SIDECAR_JSONL")
    assert rows["drain-timeout"].endswith(f"# file {file}")
    assert rows["log-level"].startswith('log-level = "warning"')  # the variable beats the file
    assert rows["hardware-interval"].endswith("# default")
    assert rows["tty"].startswith("tty = true")
    assert "# token: *** (27 characters), from STARFORGE_TOKEN" in done.stdout
    assert not (tmp_path / "state").exists()  # touched nothing
    printed = tmp_path / "printed.toml"  # what it prints, --config reads back
    printed.write_text(done.stdout)
    again = config_process(["--config", str(printed), "--json"],
                           {**clean_environ(), **STARFORGE})
    doc = json.loads(again.stdout)
    assert doc["options"]["jsonl"] == {"value": ["a.jsonl", "b.jsonl"],
                                       "from": f"file {printed}"}
    assert doc["options"]["log-level"]["value"] == "warning"
    assert doc["platform"]["token"] == "*** (27 characters)"
    assert TOKEN not in again.stdout


def test_sidecar_config_exits_2_on_what_run_would_refuse(tmp_path: Path) -> None:
    env = {**clean_environ(), **STARFORGE, "STARFORGE_ENDPOINT": "http://127.0.0.1:8080/"}
    done = config_process([], env)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("sidecar config: configuration error: STARFORGE_ENDPOINT=")
    as_json = config_process(["--json"], env)
    assert as_json.returncode == 2
    assert "does not end in /api/ingest" in json.loads(as_json.stdout)["error"]


def test_the_platform_s_cap_on_validation_text_is_below_the_sidecar_s_own_settings(
        tmp_path: Path) -> None:
    env = {**clean_environ(), **STARFORGE, "SIDECAR_STATE_DIR": str(tmp_path / "state"),
           "TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES": "5"}
    shown = json.loads(config_process(["--json"], env).stdout)["options"]
    assert shown["validation-samples"] == {"value": 5,
                                           "from": "TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES"}
    mine = json.loads(config_process(["--json"], {**env, "SIDECAR_VALIDATION_SAMPLES": "7"})
                      .stdout)["options"]
    assert mine["validation-samples"] == {"value": 7, "from": "SIDECAR_VALIDATION_SAMPLES"}
    disagree = config_process([], {**env, "STARFORGE_VAL_UPLOAD_SAMPLES": "6"})
    assert disagree.returncode == 2
    assert ("STARFORGE_VAL_UPLOAD_SAMPLES='6' and TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES='5' "
            "disagree") in disagree.stderr
    bad = config_process([], {**env, "TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES": "-1"})
    assert bad.returncode == 2
    assert "TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES=-1 must be at least 0" in bad.stderr
