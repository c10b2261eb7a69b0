"""The options of `run` and `watch` (and of the commands that take theirs), a row each: its
name, kind, default, help and check; each is settable on the command line, as SIDECAR_<NAME> and
in the `--config` TOML file (docs/commands.md#options). The row is the one place an option's
default, range and check live: `--help`, the parsers, config.py's resolution and `sidecar config`
all read it. A kind of followed file adds its own row (sources/files/kinds.py).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from sidecar.exits import ConfigError
from sidecar.masking import mask
from sidecar.observe.address import DEFAULT_STATUS_ADDR, parse_host_port
from sidecar.sources.files.kinds import FILE_KINDS

# -- the checks and probes the rows of OPTIONS name, beyond a row's `at_least` ------------------
# A check takes the value (each item of a list option's) and where it came from, for the message.

MIN_HARDWARE_INTERVAL_S = 1.0


def check_hardware_interval(interval_s: float, source: str) -> None:
    """--hardware-interval: 0 (off), or at least MIN_HARDWARE_INTERVAL_S."""
    if 0 < interval_s < MIN_HARDWARE_INTERVAL_S:
        raise ConfigError(f"{source}={interval_s:g} is below the floor of "
                          f"{MIN_HARDWARE_INTERVAL_S:g} s: sampling faster costs the trainer's "
                          "CPU and floods /hardware; give 1 or more, or 0 to turn sampling off")


MIN_TIME_WINDOW_S = 2


def check_time_window(window_s: int, source: str) -> None:
    """--time-window: 0 (off), or at least MIN_TIME_WINDOW_S."""
    if 0 < window_s < MIN_TIME_WINDOW_S:
        raise ConfigError(f"{source}={window_s} is below the floor of {MIN_TIME_WINDOW_S} s: a "
                          "shorter window holds too few samples to say where the time goes; "
                          "give 2 or more, or 0 to turn the sampling off")


def check_gpus(value: str, source: str) -> None:
    """--gpus: NVML indexes (0, 3) or UUIDs (GPU-..., MIG-...), comma-separated; empty: the
    environment's."""
    if not value:
        return
    for token in (t.strip() for t in value.split(",")):
        uuid = token.upper().startswith(("GPU-", "MIG-")) and len(token) > 4
        if not (token.isdigit() or uuid):
            raise ConfigError(f"{source}={value!r}: {token!r} is neither a GPU index nor a UUID; "
                              "give NVML indexes or UUIDs separated by commas, for example 0,1 "
                              "or GPU-5f2c...,GPU-91ab... (`nvidia-smi -L` lists them)")


def check_status_addr(addr: str, source: str) -> None:
    """--status-addr: HOST:PORT, or off."""
    if addr != "off":
        parse_host_port(addr, source)


def refuse_busy_status_addr(addr: str) -> None:
    """An address given for the status endpoint that cannot be had is a configuration error,
    found before the command starts; only the default falls back to an ephemeral port."""
    if addr in ("off", DEFAULT_STATUS_ADDR):
        return
    import socket

    host, port = parse_host_port(addr, "--status-addr")
    try:
        for family, kind, proto, _, where in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
                probe.bind(where)
    except OSError as exc:
        raise ConfigError(f"--status-addr {addr} (SIDECAR_STATUS_ADDR): cannot listen there "
                          f"({(exc.strerror or str(exc)).lower()}); give a free address, or "
                          "off; only the default, 127.0.0.1:9620, falls back to a free port"
                          ) from None


LOG_PREFIX_FIELDS = ("node", "rank")


def check_checkpoints_folder(folder: str, source: str) -> None:
    """A --checkpoints folder that is a file is a mistake waiting cannot mend (it was said to
    be awaited, as a folder not there yet is)."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{source} {folder} is a file: give the folder the checkpoints are "
                          f"saved under (here {path.parent}, or the trainer's output_dir)")


def check_tree_pattern(kind: str, tree: str) -> Callable[[str, str], None]:
    """The check of a pattern of the `tree` kind `kind` (a folder searched for files named
    `tree`): a file there of another name is a mistake waiting cannot mend (--tensorboard
    given the trainer's log), where an event file is taken as that one file."""
    def check(pattern: str, source: str) -> None:
        from sidecar.sources.files.discover import names_one_file

        path = Path(pattern)
        if path.exists() and not path.is_dir() and not names_one_file(pattern, kind, tree):
            raise ConfigError(f"{source} {pattern} is a file not named {tree}: give the "
                              f"folder the event files are written to (here {path.parent}) "
                              "or one of them")
    return check


def check_log_prefix(template: str, source: str) -> str:
    """`template` when it formats {node} and {rank} only (docs/commands.md#the-log-prefix)."""
    import string

    fix = "only {node} and {rank} are filled in; write {{ or }} for a literal brace"
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{source}={template!r} is not a valid template ({exc}); {fix}") from None
    for name, spec, conv in fields:
        if name not in LOG_PREFIX_FIELDS or spec or conv:
            shown = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ConfigError(f"{source}={template!r} uses {shown}; {fix}")
    if mask(template) != template:
        # refused rather than masked: a prefix is ours, on every line, and a token in it is a
        # mistake its author should hear of (docs/commands.md#the-log-prefix)
        raise ConfigError(f"{source}={mask(template)!r} holds the ingest token (*** above), "
                          "which would go out on every line; give a prefix without it")
    return template


def check_artifact_uri(mapping: str, source: str) -> str:
    """`mapping` when it is LOCAL=URI; else ConfigError naming `source` and the fix."""
    try:
        parse_artifact_uri(mapping)
    except ValueError as exc:
        raise ConfigError(f"{source}={mapping!r} {exc}; give the local folder and the URI it "
                          "mirrors, as in /mnt/ckpt=s3://bucket/run-1/ckpt") from None
    return mapping


def check_validation_map(mapping: str, source: str) -> str:
    """`mapping` when it is FIELD=NAME with a FIELD samples have (docs/validation.md)."""
    from sidecar.sources.files.validation import parse_map

    try:
        parse_map((mapping,))
    except ValueError as exc:
        raise ConfigError(f"{source}={mapping!r} {exc}, as in reward=score "
                          "(docs/validation.md#fields)") from None
    return mapping
_URI_START = re.compile(r"=([A-Za-z][A-Za-z0-9+.-]*://)")  # RFC 3986's scheme, then ://


def parse_artifact_uri(text: str) -> tuple[str, str]:
    """`LOCAL=URI` (--artifact-uri) as (absolute local prefix, URI); ValueError saying why not.
    The URI is the part from its `scheme://` on, so a local path may hold `=` (a Hydra
    folder `lr=0.1`)."""
    import os

    start = _URI_START.search(text)
    if start is None:
        local, sep, uri = text.partition("=")
        if not sep or not local.strip() or not uri.strip():
            raise ValueError("is not LOCAL=URI")
        raise ValueError(f"names {uri.strip()!r}, which is not a URI (such as s3://bucket/path)")
    local, uri = text[:start.start()], text[start.start() + 1:]
    if not local.strip():
        raise ValueError("is not LOCAL=URI: the local folder is missing")
    return os.path.abspath(os.path.expanduser(local.strip())), uri.strip()


class Option(NamedTuple):
    """One option of `run`/`watch`, settable on the command line, as SIDECAR_<NAME> and in TOML."""

    name: str
    kind: str  # "str", "float", "int", "list", "path", "bool" (a flag)
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    only: str = ""  # "run" when the option belongs to `run` alone
    metavar: str = ""  # what --help shows for the value; empty: the kind's (_METAVARS)
    shown_default: str = ""  # the default in words, where `default` is None and found later
    at_least: float | None = None  # the smallest value taken (a float's must also be finite)
    check: Callable[[Any, str], object] | None = None  # ConfigError on a bad value (or item)
    # ConfigError when what the value names cannot be had on this machine now (an address in
    # use): run by the commands that will take it, `run` and `watch` (probe_options)
    probe: Callable[[Any], object] | None = None
    # the platform's variables, one a family, whose value is the default when set: the
    # platform's own setting, below the sidecar's option, variable and file
    platform: tuple[str, ...] = ()
    # a short flag that gives the option one value: ("-v", "info")
    short: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        return "SIDECAR_" + self.name.upper().replace("-", "_")

    @property
    def attr(self) -> str:
        return self.name.replace("-", "_")

    @property
    def help_line(self) -> str:
        """The --help text: the row's help, then its default and its variable (clap's style)."""
        separator = LIST_SEPARATORS.get(self.name, ":")
        default = self.shown_default or show_default(self.default)
        if self.platform:
            default = f"{' or '.join(self.platform)}, else {default}"
        return help_line(self.help, default,
                         self.env + (f", a {separator}-separated list" if self.kind == "list"
                                     else ""))



# A list option's separator in its SIDECAR_* variable: a URI holds colons.
LIST_SEPARATORS = {"artifact-uri": ","}

OPTIONS: tuple[Option, ...] = (
    *(Option(kind.name, "list", (), kind.help, metavar=kind.metavar,
             check=check_tree_pattern(kind.name, kind.tree) if kind.tree else None)
      for kind in FILE_KINDS),
    Option("hparams", "path", None, "JSON, YAML or TOML config file sent to /hparams",
           metavar="FILE"),
    Option("checkpoints", "list", (), "folder whose model checkpoints, written anywhere under "
           "it, are each registered once complete (repeatable)", metavar="DIR",
           check=check_checkpoints_folder),
    Option("artifact-uri", "list", (), "the object-store URI a local prefix mirrors, posted "
           "instead of the local path (repeatable)", metavar="LOCAL=URI",
           check=check_artifact_uri),
    Option("validation-map", "list", (), "the record field a part of a validation sample is "
           "(user, assistant, reward, step, correct), where the known layouts do not say "
           "(repeatable)", metavar="FIELD=NAME", check=check_validation_map),
    Option("validation-samples", "int", None, "samples of a validation round that keep their "
           "text, spread over its rewards (the rest count in avg_reward and accuracy only); 0: "
           "scores only", shown_default="all of a round of up to 128, else 32", at_least=0,
           platform=("STARFORGE_VAL_UPLOAD_SAMPLES", "TUNEPLANE_JOB_VAL_UPLOAD_SAMPLES")),
    Option("checkpoint-upload", "str", "auto", "upload an unmapped checkpoint through the "
           "ingest's signed URLs and register its object-store URI: auto (in a container), "
           "always, never", choices=("auto", "always", "never")),
    Option("upload-rate", "int", 100_000_000, "bytes a second all checkpoint uploads together "
           "send at most (0.8 Gbit/s: the node's network stays training's); 0: no limit",
           metavar="BYTES/S", at_least=0),
    Option("hardware-interval", "float", 10.0, "seconds between /hardware samples; 0 turns it off",
           at_least=0, check=check_hardware_interval),
    Option("gpus", "str", "", "the job's GPUs to sample: NVML indexes or UUIDs, comma-separated",
           metavar="ID", shown_default="the environment's, else those the job's processes use",
           check=check_gpus),
    Option("state-dir", "path", None, "where offsets and the spool live, one folder per run",
           metavar="DIR", shown_default="$XDG_STATE_HOME/sidecar, else ~/.local/state/sidecar"),
    Option("status-addr", "str", DEFAULT_STATUS_ADDR, "local status endpoint HOST:PORT, or off",
           metavar="HOST:PORT", check=check_status_addr, probe=refuse_busy_status_addr),
    Option("drain-timeout", "float", 20.0, "seconds shutdown may spend delivering what is left",
           at_least=0),
    Option("stall-after", "float", None, "seconds without output or a new metric step before "
           "a stall is said in /logs and on the status endpoint, and the command's stacks are "
           "taken; 0 turns it off", at_least=0,
           shown_default="the run's cadence: 3 x its longest quiet gap, at least 120"),
    Option("time-window", "int", 60, "seconds over which each rank's share of time in "
           "collectives, waiting for data, saving checkpoints and computing is measured, from "
           "outside, and sent to /hardware; 0 turns it off (the stacks at a stall stay)",
           metavar="SECONDS", at_least=0, check=check_time_window),
    Option("token-file", "path", None, "read the token from this file (wins over the variable)"),
    Option("running-when", "str", "spawn", "post running as the child is spawned, or on its marker",
           choices=("spawn", "marker"), only="run"),
    Option("log-prefix", "str", "", "prefix of each forwarded log line; {node}, {rank} filled in",
           metavar="TEMPLATE", check=check_log_prefix),
    Option("log-ansi", "str", "strip", "escape sequences in forwarded text: cursor movement is "
           "applied as a terminal would; strip drops every other one, keep keeps colours",
           choices=("strip", "keep")),
    Option("tty", "bool", False, "run the command on a pseudo-terminal, so that it behaves as at "
           "a terminal (colours, live displays); its stdout and stderr then share it and both "
           "reach the sidecar's stdout", only="run"),
    Option("log-format", "str", "auto", "--log files as plain text or CRI container logs",
           choices=("plain", "cri", "auto")),
    Option("log-rate", "float", 5.0, "run only: MB a second of the command's output forwarded "
           "to /logs at most (beyond, dropped for /logs, counted and marked; the failure "
           "summary and the crash tail still see it); 0: no limit", only="run",
           metavar="MB/S", at_least=0),
    Option("file-watch", "str", "auto", "notice file changes by inotify with a safety poll "
           "(auto), or by polling alone (poll: NFS, FUSE)", choices=("auto", "poll")),
    Option("node-name", "str", None, "this node's name", metavar="NAME",
           shown_default="$NODE_NAME, else the hostname"),
    Option("nodes", "int", None, "the run's node count",
           shown_default="from NNODES, SLURM_NNODES or WORLD_SIZE/LOCAL_WORLD_SIZE, else 1",
           at_least=1),
    Option("python", "path", None, "the trainer's interpreter, for the environment snapshot",
           shown_default="found from the command's PATH and VIRTUAL_ENV"),
    Option("ca-file", "path", None, "extra CA bundle for the ingest endpoint"),
    Option("log-level", "str", "auto", "level of the sidecar's own messages; auto: info, but "
           "at a terminal only warnings, errors, a line at the start and one at the end",
           choices=("auto", "debug", "info", "warning", "error"), short=("-v", "info")),
    Option("message-format", "str", "text", "format of the sidecar's own messages",
           choices=("text", "json")),
)
def help_line(help: str, default: str, env: str = "") -> str:
    """An option's --help text: what it does, its default, its variable (as clap writes them)."""
    return f"{help} [default: {default}]" + (f" [env: {env}]" if env else "")


def show_default(value: Any) -> str:
    """A default as --help writes it."""
    if value in (None, "", ()):
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# What --help shows for an option's value when its row names none.
_METAVARS = {"float": "SECONDS", "int": "N", "path": "PATH", "list": "PATH", "str": "TEXT"}
CONFIG_OPTION = Option("config", "path", None, "TOML file with any of the options", metavar="FILE")


def option(name: str) -> Option:
    """The row of option `name` (as in `state-dir`, without dashes)."""
    return next(opt for opt in (*OPTIONS, CONFIG_OPTION) if opt.name == name)


ALL_OPTIONS_COMMANDS = ("check", "config")  # take every option, `run`'s own included


def options_of(command: str) -> tuple[Option, ...]:
    """The options `command` takes: `check` and `config` take every one, as `run` would."""
    return tuple(opt for opt in OPTIONS
                 if not opt.only or command in (opt.only, *ALL_OPTIONS_COMMANDS))


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Declare the options of `command` (run, watch or check) on its parser, then --config."""
    for opt in options_of(command):
        add_option(parser, opt)
    add_option(parser, CONFIG_OPTION)


def add_option(parser: argparse.ArgumentParser, opt: Option | str) -> None:
    """Declare one row of the table on `parser`, its help derived from the row; unset: None."""
    if isinstance(opt, str):
        opt = option(opt)
    help_text = opt.help_line.replace("%", "%%")
    if opt.kind == "bool":  # a flag: given, it is on; absent, the environment or file decide
        parser.add_argument("--" + opt.name, default=None, action="store_const", const=True,
                            help=help_text)
        return
    parser.add_argument(
        "--" + opt.name, default=None, action="append" if opt.kind == "list" else "store",
        choices=opt.choices or None, help=help_text,
        metavar=None if opt.choices else opt.metavar or _METAVARS.get(opt.kind, "VALUE"))
    if opt.short:
        flag, value = opt.short
        parser.add_argument(flag, dest=opt.attr, action="store_const", const=value,
                            help=f"--{opt.name} {value}")
