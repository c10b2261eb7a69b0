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
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import SplitResult, urlsplit

from sidecar.delivery.handoff import WRAPPER_SOCKET_VARIABLE
from sidecar.exits import ConfigError
from sidecar.masking import MIN_SECRET_CHARS, add_secret
from sidecar.options import (
    CONFIG_OPTION,
    LIST_SEPARATORS,
    OPTIONS,
    Option,
    option,
    options_of,
    show_default,
)
from sidecar.sources.files.kinds import FILE_KINDS


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
    time_window: int  # 0: the ranks' time is not sampled
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
        endpoint = _collected(problems, valid_endpoint,
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


def valid_endpoint(endpoint: str, variable: str) -> str:
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


def learn_secrets(environ: Mapping[str, str]) -> None:
    """Register the tokens the platform's variables hold: before the command line is parsed,
    whose messages quote what was given."""
    for family in FAMILIES:
        add_secrets(environ.get(family.token, ""))


def _learn_secrets(args: argparse.Namespace, environ: Mapping[str, str],
                   file_values: Mapping[str, Any]) -> None:
    """Register every token this configuration may hold before anything is checked, so that a
    message quoting a value never shows one, even one pasted into the wrong variable."""
    learn_secrets(environ)
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
    if opt.name in file_values:
        return f"file {config_file}"
    return next((name for name in opt.platform if name in environ), "default")


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
    elif given := {name: environ[name] for name in opt.platform if name in environ}:
        if len(set(given.values())) > 1:
            raise ConfigError(" and ".join(f"{k}={v!r}" for k, v in given.items())
                              + f" disagree; unset one, or give --{opt.name}")
        source, raw = next(iter(given.items()))
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


def log_context(run_id: str, node: str) -> dict[str, str]:
    """The fields every JSON message carries: the run (when there is one) and the node."""
    return {"run_id": run_id, "node": node} if run_id else {"node": node}


def configured(args: argparse.Namespace, command: str) -> Config:
    """`command`'s Config, resolved from its parsed `args`, with the sidecar's own messages set
    up as it says: what every command that runs with a configuration does first."""
    from sidecar.log import log, setup
    from sidecar.node import resolve_node

    cfg = resolve(args, command, os.environ)
    node = resolve_node(cfg.node_name, os.environ, cfg.nodes).name
    setup(cfg.log_level, cfg.message_format, log_context(cfg.platform.run_id, node))
    add_secret(cfg.token)
    warn_unknown_variables()
    default_state_dir = cfg.state_dir
    cfg, why = fallback_state_dir(cfg)
    if why:
        log.warning("the default state folder %s cannot be used (%s); this run's state (spool, "
                    "journal, offsets) is kept in %s instead, which a reboot may clear: give "
                    "--state-dir a lasting writable folder (in a pod, an emptyDir volume)",
                    default_state_dir, why, cfg.state_dir)
    if command in ("run", "watch"):
        probe_options(cfg)
    return cfg


def warn_unknown_variables() -> None:
    """A SIDECAR_* or platform variable no option reads (a typo), one WARNING each."""
    from sidecar.log import log

    for warning in unknown_variables(os.environ):
        log.warning("%s", warning)
