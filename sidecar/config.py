"""One frozen Config, resolved at start from the command line, SIDECAR_*, TOML and defaults.

Precedence (docs/commands.md#where-options-come-from): flags, environment, `--config` file, default.
The platform's variables too (docs/ingest.md#the-platforms-variables): every error a user can make
in configuration surfaces before anything is started, as one ConfigError naming every culprit.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import SplitResult, urlsplit

from sidecar.delivery.handoff import WRAPPER_SOCKET_VARIABLE
from sidecar.exits import ConfigError
from sidecar.masking import MIN_SECRET_CHARS, add_secret, mask
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


def _split_list(name: str, text: str) -> list[str]:
    """A list option's SIDECAR_* value, split at its separator. For --artifact-uri a comma
    ends an item only where what follows holds a mapping of its own: a piece without a URI
    belongs to its neighbour (a Hydra folder `lr=0.1,bs=8`, a URI `s3://b/a,b`)."""
    parts = [p for p in text.split(LIST_SEPARATORS.get(name, ":")) if p]
    if name != "artifact-uri":
        return parts
    items: list[str] = []
    carried = ""  # pieces of a local folder that holds the separator
    for part in parts:
        if "://" in part:
            items.append(carried + part)
            carried = ""
        elif "=" in part or not items:
            carried += part + ","
        else:  # a piece of the URI before it
            items[-1] += "," + part
    if carried:  # no URI after it: the option's check names it
        items.append(carried.rstrip(","))
    return items


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
        return help_line(self.help, self.shown_default or show_default(self.default),
                         self.env + (f", a {separator}-separated list" if self.kind == "list"
                                     else ""))



# A list option's separator in its SIDECAR_* variable: a URI holds colons.
LIST_SEPARATORS = {"artifact-uri": ","}

OPTIONS: tuple[Option, ...] = (
    *(Option(kind.name, "list", (), kind.help, metavar=kind.metavar) for kind in FILE_KINDS),
    Option("hparams", "path", None, "JSON, YAML or TOML config file sent to /hparams",
           metavar="FILE"),
    Option("checkpoints", "list", (), "folder whose model checkpoints, written anywhere under "
           "it, are each registered once complete (repeatable)", metavar="DIR"),
    Option("artifact-uri", "list", (), "the object-store URI a local prefix mirrors, posted "
           "instead of the local path (repeatable)", metavar="LOCAL=URI",
           check=check_artifact_uri),
    Option("validation-map", "list", (), "the record field a part of a validation sample is "
           "(user, assistant, reward, step, correct), where the known layouts do not say "
           "(repeatable)", metavar="FIELD=NAME", check=check_validation_map),
    Option("validation-samples", "int", None, "samples of a validation round that keep their "
           "text, spread over its rewards (the rest count in avg_reward and accuracy only); 0: "
           "scores only", shown_default="all of a round of up to 128, else 32", at_least=0),
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
    Option("log-level", "str", "info", "level of the sidecar's own messages",
           choices=("debug", "info", "warning", "error")),
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


class Family(NamedTuple):
    """One brand of the platform's injected variables (docs/ingest.md#the-platforms-variables)."""

    name: str
    enabled: str
    endpoint: str
    run_id: str
    token: str
    header: str


FAMILIES: tuple[Family, ...] = (
    Family("StarForge", "STARFORGE_ENABLED", "STARFORGE_ENDPOINT", "STARFORGE_RUN_ID",
           "STARFORGE_TOKEN", "X-StarForge-Token"),
    Family("TunePlane", "TUNEPLANE_JOB_ENABLED", "TUNEPLANE_JOB_ENDPOINT", "TUNEPLANE_JOB_RUN_ID",
           "TUNEPLANE_JOB_TOKEN", "X-TunePlane-Token"),
)


class Platform(NamedTuple):
    """What the platform injected: whether to report, where, for which run, with which headers."""

    enabled: bool
    endpoint: str = ""
    run_id: str = ""
    token_headers: tuple[str, ...] = ()
    token_variable: str = ""


class Config(NamedTuple):
    """Everything `run` and `watch` need, fixed at start. A NamedTuple, as immutable as a frozen
    dataclass: one of 29 fields generated its methods at every start, 2 % of a daemon's.
    No field has a default: `resolve` fills each option's from its row in OPTIONS, the one
    place its default is written (test_config checks that the two agree)."""

    platform: Platform
    token: str  # never in repr() (below)
    # the patterns of each file-source kind given, by its name (sources/files/kinds.py)
    files: Mapping[str, tuple[str, ...]]
    hparams: Path | None
    checkpoints: tuple[str, ...]
    artifact_uri: tuple[str, ...]
    validation_map: tuple[str, ...]
    validation_samples: int | None
    checkpoint_upload: str
    upload_rate: int
    hardware_interval: float
    gpus: str
    # the option's default, None, is found by `resolve`: a Config always has a folder
    state_dir: Path
    status_addr: str
    drain_timeout: float
    stall_after: float | None  # None: judged against the run's cadence
    token_file: Path | None
    running_when: str
    log_prefix: str
    log_ansi: str
    tty: bool
    log_format: str
    log_rate: float
    file_watch: str
    node_name: str | None
    nodes: int | None
    python: Path | None
    ca_file: Path | None
    log_level: str
    message_format: str
    state_dir_is_default: bool  # no --state-dir given: a home folder, maybe shared
    node_folder: str  # with the default state dir, this node's own subfolder of the run's

    @property
    def run_dir(self) -> Path:
        """This run's own folder inside the state dir (and this node's, inside the default one,
        which a home shared by every node of a run may hold: docs/commands.md#the-state-folder)."""
        folder = self.state_dir / _safe_name(self.platform.run_id or "offline")
        return folder / self.node_folder if self.node_folder else folder

    def __repr__(self) -> str:
        shown = (f"{name}={value!r}" for name, value in self._asdict().items() if name != "token")
        return f"Config({', '.join(shown)})"

    def read_token(self) -> str:
        """The current token: the token file's content when one is given (re-read each call)."""
        if self.token_file is None:
            return self.token
        return read_token_file(self.token_file)


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


def resolve(args: argparse.Namespace, command: str, environ: Mapping[str, str],
            origins: dict[str, str] | None = None, problems: list[str] | None = None) -> Config:
    """Resolve one Config for `command`, raising one ConfigError naming every mistake found,
    worst first: the platform's variables (without them nothing is reported), then the options.
    Given `problems` (`sidecar check`), the mistakes go there instead and a Config is returned
    all the same: each bad option at its default, the platform's fields found left empty.
    Given `origins`, it is filled with where each option's value came from (`sidecar config`):
    `--name`, the variable's name, `file PATH` or `default`."""
    found: list[str] = []
    options_found: list[str] = []  # said after the platform's: without it nothing is reported
    config_file = getattr(args, "config", None) or environ.get("SIDECAR_CONFIG")
    file_values = _read_config_file(config_file, options_found) if config_file else {}
    _learn_secrets(args, environ, file_values)
    # an option `command` does not take (`run`'s own, for `watch`) keeps its default
    values: dict[str, Any] = {opt.attr: opt.default for opt in OPTIONS}
    sources: dict[str, str] = {}
    for opt in options_of(command):
        cli = getattr(args, opt.attr, None)
        picked = _collected(options_found, _pick, opt, cli, environ, file_values, config_file)
        if picked is not None and _collected(options_found, _check, opt, *picked) is not None:
            values[opt.attr], sources[opt.attr] = picked
        else:
            sources[opt.attr] = "--" + opt.name
        if origins is not None:
            origins[opt.name] = _origin(opt, cli, environ, file_values, config_file)
    platform = _platform(environ, found, values.get("token_file") is not None)
    token = ""
    if platform.enabled:
        token = _collected(found, _resolve_token, values.get("token_file"),
                           sources.get("token_file", ""), platform, environ) or ""
    found += options_found
    values.update(state_dir_is_default=values["state_dir"] is None, node_folder="")
    if values["state_dir"] is None:
        values["state_dir"] = default_state_dir(environ)
        if platform.enabled:
            from sidecar.node import resolve_node

            node = resolve_node(values.get("node_name"), environ, values.get("nodes"))
            values["node_folder"] = _safe_name(node.name)
    if found and problems is None:
        raise ConfigError(*found)
    if problems is not None:
        problems += found
    files = {kind.name: values.pop(option(kind.name).attr) for kind in FILE_KINDS}
    return Config(platform=platform, token=token, files=files, **values)


def _collected(problems: list[str], function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` (True from a check, which returns nothing), or None with each mistake
    of the ConfigError it raised added to `problems`."""
    try:
        result = function(*args)
    except ConfigError as exc:
        problems += exc.problems
        return None
    return True if result is None else result


def _check(opt: Option, value: Any, source: str) -> None:
    """The row's range, then its check (on each item of a list); None (no value) passes."""
    if value is None:
        return
    if opt.at_least is not None and (
            value < opt.at_least or (opt.kind == "float" and not math.isfinite(value))):
        at_least = (f"a number, {opt.at_least:g} or more" if opt.kind == "float"
                    else f"at least {opt.at_least:g}")
        raise ConfigError(f"{source}={value} must be {at_least}")
    if opt.check is not None:
        for item in value if opt.kind == "list" else (value,):
            opt.check(item, source)


def probe_options(cfg: Config) -> None:
    """Each row's probe on its value in `cfg`: ConfigError when what it names cannot be had
    here now. For `run` and `watch` alone, which are about to take it; `check` and `config`
    describe a configuration and hold nothing."""
    for opt in OPTIONS:
        if opt.probe is not None:
            opt.probe(getattr(cfg, opt.attr))


def resolve_platform(environ: Mapping[str, str], token_file: bool = False) -> Platform:
    """Either family, never two that disagree (docs/ingest.md#the-platforms-variables);
    ConfigError naming every variable that is missing or wrong (the token's unless a
    `token_file` gives it)."""
    problems: list[str] = []
    platform = _platform(environ, problems, token_file)
    if problems:
        raise ConfigError(*problems)
    return platform


def _platform(environ: Mapping[str, str], problems: list[str], token_file: bool) -> Platform:
    """The platform the variables describe, each mistake in them added to `problems`: reporting
    asked for with its endpoint or run id missing is still Platform(enabled=True), those fields
    empty, so that what else is missing (the token) is found in the same pass."""
    present = [f for f in FAMILIES if any(v in environ for v in _family_vars(f))]
    for a, b in itertools.pairwise(present):
        for var_a, var_b in zip(_family_vars(a), _family_vars(b), strict=True):
            if var_a in environ and var_b in environ and environ[var_a] != environ[var_b]:
                problems.append(f"{var_a} and {var_b} are both set and disagree: "
                                "unset one family of platform variables")
                return Platform(enabled=False)
    names = " or ".join(f.enabled for f in FAMILIES)
    family = next((f for f in present if f.enabled in environ), None)
    if family is None:
        # What reporting would need too, so that setting ENABLED=1 is not met by the next error.
        needed = (present or FAMILIES)[0]
        missing = [v for v in (needed.endpoint, needed.run_id, needed.token)
                   if not environ.get(v, "").strip() and not (token_file and v == needed.token)]
        also = (f", which also needs {_and(missing)}, not set either (the platform injects "
                "them)" if missing else "")
        problems.append(f"{names} is not set: set it to 0 to run offline, or to 1 to report to "
                        f"the platform{also}")
        return Platform(enabled=False)
    enabled = environ[family.enabled]
    if enabled == "0":
        return Platform(enabled=False)
    if enabled != "1":
        problems.append(f"{family.enabled}={enabled!r} is neither 1 (report) nor 0 (offline)")
        return Platform(enabled=False)
    missing = [v for v in (family.endpoint, family.run_id) if not environ.get(v, "").strip()]
    endpoint = ""
    if family.endpoint not in missing:
        endpoint = _collected(problems, check_endpoint,
                              environ[family.endpoint].strip().rstrip("/"), family.endpoint) or ""
    if not token_file and not environ.get(family.token, "").strip():
        missing.append(family.token)
    if missing:
        problems.append(_not_set(missing, family.token))
    return Platform(
        enabled=True,
        endpoint=endpoint,
        run_id=environ.get(family.run_id, "").strip(),
        token_headers=tuple(f.header for f in present),
        token_variable=family.token,
    )


def _and(names: Sequence[str]) -> str:
    """"A", "A and B", "A, B and C"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _not_set(names: Sequence[str], token_variable: str) -> str:
    verb = "is" if len(names) == 1 else "are"
    file = (" (or give the token in a file with --token-file)"
            if token_variable in names else "")
    return (f"{_and(names)} {verb} not set{file}; the platform injects "
            f"{'it' if len(names) == 1 else 'them'} when reporting is enabled")


def read_token_file(path: Path, source: str = "--token-file") -> str:
    """The token in `path`, surrounding whitespace stripped (docs/commands.md#the-token-file)."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source} {path}: cannot read it ({exc.__class__.__name__}); "
                          "mount the token Secret there or drop the option") from None
    if not token:
        raise ConfigError(f"{source} {path} is empty; it should hold the run's ingest token")
    add_secrets(token)
    return check_token(token, f"{source} {path}")


INGEST_PATH = "/api/ingest"  # every endpoint ends with it (docs/ingest.md#the-platforms-variables)
EXAMPLE_ENDPOINT = "https://platform.example.com/api/ingest"


def check_endpoint(endpoint: str, variable: str) -> str:
    """`endpoint` when it is an http(s) URL ending in /api/ingest with a valid port and no
    credentials; else ConfigError naming `variable`, the URL shown without any credentials."""
    parts = urlsplit(endpoint)
    shown = _strip_credentials(parts)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{variable}={shown!r} is not an http(s) URL; it should look like "
                          f"{EXAMPLE_ENDPOINT}")
    if "@" in parts.netloc:
        raise ConfigError(f"{variable}={shown!r} carries credentials (user:password@) in the URL; "
                          "remove them: the token alone authenticates, and a URL is printed in "
                          "logs")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ConfigError(f"{variable}={shown!r}: the port is not a number from 1 to 65535; "
                          f"it should look like {EXAMPLE_ENDPOINT} or http://host:8080/api/ingest")
    if not parts.path.endswith(INGEST_PATH) or parts.query or parts.fragment:
        raise ConfigError(f"{variable}={shown!r} does not end in {INGEST_PATH} (see "
                          "docs/ingest.md); "
                          f"give the base URL the platform shows, as in {EXAMPLE_ENDPOINT}: the "
                          "routes (/lifecycle, /metrics, ...) are added to it")
    return endpoint


def _strip_credentials(parts: SplitResult) -> str:
    netloc = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=netloc).geturl()


def check_token(token: str, source: str) -> str:
    """`token` when an HTTP header can carry it (visible ASCII, one line) and it is long enough
    to be masked; else ConfigError naming `source` and the fault, never the token."""
    if "\n" in token or "\r" in token:
        raise ConfigError(f"{source} holds more than one line; it should hold the token alone "
                          "(a trailing newline is fine)")
    bad = next((i for i, c in enumerate(token) if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        what = ("a non-ASCII character" if ord(token[bad]) >= 0x80
                else "a space or a control character")
        raise ConfigError(f"{source}: the token holds {what} at position {bad + 1}, which an "
                          "HTTP header cannot carry; it should be the token exactly as issued")
    if len(token) < MIN_SECRET_CHARS:
        raise ConfigError(f"{source}: the token is {len(token)} characters long, too short to be "
                          "masked in the output (a token of fewer than "
                          f"{MIN_SECRET_CHARS} would blank pieces of ordinary words); it should "
                          "be the token exactly as issued")
    return token


def _learn_secrets(args: argparse.Namespace, environ: Mapping[str, str],
                   file_values: Mapping[str, Any]) -> None:
    """Register every token this configuration may hold before anything is checked, so that a
    message quoting a value never shows one, even one pasted into the wrong variable."""
    for family in FAMILIES:
        add_secrets(environ.get(family.token, ""))
    token_file = (getattr(args, "token_file", None) or environ.get(option("token-file").env)
                  or file_values.get("token-file"))
    if isinstance(token_file, str):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            add_secrets(Path(token_file).expanduser().read_text(encoding="utf-8"))


WORD_SECRET_CHARS = 8  # a word of a file that is more than a token is masked from this length


def add_secrets(text: str) -> None:
    """Mask `text` stripped, and each of its longer words: a token file with a second line
    holds the token on its first (the other words of such a file, short ones, are not masked
    in the message that says so)."""
    add_secret(text.strip())
    for word in text.split():
        if len(word) >= WORD_SECRET_CHARS:
            add_secret(word)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning for each SIDECAR_* variable no option reads (a typo is otherwise silently
    ignored), naming the closest known one."""
    prefix = "SIDECAR_"
    known = [opt.env for opt in (*OPTIONS, CONFIG_OPTION)] + [WRAPPER_SOCKET_VARIABLE]
    warnings = []
    for name in sorted(n for n in environ if n.startswith(prefix) and n not in known):
        hint = _platform_variable_hint(name[len(prefix):]) or closest(
            name[len(prefix):], [k[len(prefix):] for k in known], prefix=prefix,
            otherwise="`sidecar run --help` lists them")
        warnings.append(f"{name} is set but no sidecar option reads it, so it is ignored; {hint}")
    return warnings


def closest(name: str, known: Sequence[str], prefix: str = "", otherwise: str = "") -> str:
    """"did you mean PREFIXNAME?" for the known name closest to `name`, else `otherwise`.
    Names are compared without the `prefix` they all share, which would make any two alike."""
    import difflib  # here, not above: every start asks, few have a typo to name

    close = difflib.get_close_matches(name, known, 1)
    return f"did you mean {prefix}{close[0]}?" if close else otherwise


def _platform_variable_hint(suffix: str) -> str:
    """Where the platform's own variable is for a SIDECAR_ one that mimics it (SIDECAR_TOKEN):
    those the platform injects are read under its names alone."""
    field = {"ENABLED": "enabled", "ENDPOINT": "endpoint", "RUN_ID": "run_id",
             "TOKEN": "token", "URL": "endpoint", "INGEST_URL": "endpoint"}.get(suffix)
    if field is None:
        return ""
    names = " or ".join(getattr(family, field) for family in FAMILIES)
    also = "; a token in a file: --token-file (SIDECAR_TOKEN_FILE)" if field == "token" else ""
    return f"the platform's own variable is read instead: {names}{also}"


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """$XDG_STATE_HOME/sidecar, else ~/.local/state/sidecar (docs/commands.md#the-state-folder)."""
    xdg = environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path(environ.get("HOME") or Path.home()) / ".local" / "state"
    return base / "sidecar"


def _family_vars(family: Family) -> tuple[str, str, str, str]:
    return (family.enabled, family.endpoint, family.run_id, family.token)


def _resolve_token(token_file: Path | None, source: str, platform: Platform,
                   environ: Mapping[str, str]) -> str:
    """The token from --token-file, else from the platform's variable; "" when neither holds
    one (`_platform` has said so, with whatever else is missing)."""
    if token_file is not None:
        return read_token_file(token_file, source)
    token = environ.get(platform.token_variable, "").strip()
    return check_token(token, platform.token_variable) if token else ""


def _read_config_file(path: str, problems: list[str]) -> dict[str, Any]:
    """The file's options by name; an unknown one is added to `problems` and the rest kept."""
    import tomllib  # only with --config: most runs never need it

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        problems.append(f"--config {path}: cannot read it ({exc.strerror})")
        return {}
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"--config {path}: not valid TOML ({exc})")
        return {}
    known = {opt.name for opt in OPTIONS} | {opt.attr for opt in OPTIONS}
    names = [o.name for o in OPTIONS]
    for key in sorted(set(data) - known):
        hint = closest(key.replace("_", "-"), names,
                       otherwise=f"known options are {', '.join(names)}")
        problems.append(f"--config {path}: unknown option {key!r}; {hint}")
    return {key.replace("_", "-"): value for key, value in data.items() if key in known}


def _flag(raw: Any) -> bool:
    """A flag's value: True from the command line or TOML, 1/0, true/false, yes/no, on/off."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


# What a value of each kind is, in a message that says a value is not one.
_KIND_WORDS = {"str": "text", "float": "a number", "int": "a whole number", "path": "a path",
               "list": "a list of patterns", "bool": "on or off (1/0, true/false, yes/no)"}

_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "str": str,
    "float": float,
    "int": int,
    "path": lambda v: Path(str(v)).expanduser(),
}


def _origin(opt: Option, cli: Any, environ: Mapping[str, str], file_values: Mapping[str, Any],
            config_file: str | None) -> str:
    """Where `_pick` takes the option's value from, as `sidecar config` shows it."""
    if cli is not None:
        return "--" + opt.name
    if opt.env in environ:
        return opt.env
    return f"file {config_file}" if opt.name in file_values else "default"


def _pick(opt: Option, cli: Any, environ: Mapping[str, str], file_values: Mapping[str, Any],
          config_file: str | None = None) -> tuple[Any, str]:
    """The option's value by precedence, converted, and where it came from (for messages: a
    file's value is named by the file and its key, `--config run.toml: drain-timeout`)."""
    if cli is not None:
        source, raw = "--" + opt.name, cli
    elif opt.env in environ:
        source, raw = opt.env, environ[opt.env]
        if opt.kind == "list":
            raw = _split_list(opt.name, raw)
    elif opt.name in file_values:
        source, raw = f"--config {config_file or 'file'}: {opt.name}", file_values[opt.name]
    else:
        return opt.default, "--" + opt.name
    try:
        value = _convert(opt, raw)
    except (TypeError, ValueError):
        word = _KIND_WORDS[opt.kind]
        default = ("" if opt.default in (None, "", ())
                   else f", such as the default, {show_default(opt.default)}")
        raise ConfigError(f"{source}={raw!r} is not {word}; give {word}{default}") from None
    if opt.choices:
        value = value.lower()
        if value not in opt.choices:
            raise ConfigError(f"{source}={raw!r} must be one of {', '.join(opt.choices)}")
    return value, source


def _convert(opt: Option, raw: Any) -> Any:
    if opt.kind == "list":
        items = [raw] if isinstance(raw, str) else list(raw)
        return tuple(str(item) for item in items)
    if opt.kind == "bool":
        return _flag(raw)
    if isinstance(raw, (bool, list | dict)):
        raise TypeError(raw)
    if opt.kind == "int" and isinstance(raw, float) and not raw.is_integer():
        raise ValueError(raw)
    return _CONVERTERS[opt.kind](raw)


def _safe_name(run_id: str) -> str:
    """A run id as one path component: path separators and leading dots cannot escape."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return cleaned.lstrip(".") or "_"


def command_of(words: Sequence[str], argv: Sequence[str]) -> list[str]:
    """The child's command: `words`, what `run`'s parser left after its options from the
    command line `argv`, without the `--` they must start with. ValueError, its message naming
    the cause and the fix, when they start before it: a word of the sidecar's own taken for the
    command (a glob the shell expanded for a list option: `--jsonl out/*.jsonl`) would post
    `starting` and `failed` for a command nobody meant, and use up the run."""
    if not words or words[0] == "--":
        return list(words[1:])
    stray = words[0]
    where = "before --" if "--" in words else "where -- belongs"
    message = (f"{stray!r} stands {where}: the command goes after --, as in "
               "`sidecar run [OPTIONS] -- COMMAND [ARG...]`")
    flag = _list_option_before(argv, len(argv) - len(words))
    if flag:
        pattern = str(Path(stray).parent / f"*{Path(stray).suffix}")
        message += (f"; {flag} takes one pattern each time it is given, so a glob the shell "
                    f"expanded leaves its other matches here: quote it ({flag} '{pattern}') "
                    "and the sidecar expands it")
    raise ValueError(message)


def _list_option_before(argv: Sequence[str], index: int) -> str:
    """The repeatable option whose value stands just before `argv[index]` (`--jsonl a.jsonl`,
    `--jsonl=a.jsonl`), or ""."""
    lists = {"--" + opt.name for opt in OPTIONS if opt.kind == "list"}
    if index >= 1 and argv[index - 1].partition("=")[0] in lists and "=" in argv[index - 1]:
        return argv[index - 1].partition("=")[0]
    if index >= 2 and argv[index - 2] in lists:
        return argv[index - 2]
    return ""


def fallback_state_dir(cfg: Config) -> tuple[Config, str]:
    """`cfg` with a private folder under the temporary directory for its state when the default
    state folder cannot be written (a read-only home), and the reason; `cfg` itself and "" when
    it can, or when --state-dir was given (then an unwritable one stays an error)."""
    if not cfg.state_dir_is_default:
        return cfg, ""
    existing = cfg.run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return cfg, ""
    why = (f"{existing} is not a writable folder" if existing != cfg.run_dir
           else f"{existing} cannot be written")
    import tempfile  # only here: a writable home never pays for it

    private = Path(tempfile.gettempdir()) / f"sidecar-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        private.mkdir(mode=0o700)
    st = private.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        private = Path(tempfile.mkdtemp(prefix="sidecar-"))  # that name is someone else's
    return cfg._replace(state_dir=private), why
