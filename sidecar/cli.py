"""Commands and options -> Config -> run, watch, operator commands (docs/commands.md#commands).

Each command's module is imported when that command runs, so a daemon never carries the code of
the commands it is not running."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from sidecar import __version__
from sidecar.config import closest, command_of, learn_secrets, log_context
from sidecar.delivery.lifecycle import EVENTS
from sidecar.exits import EXIT_CONFIG, ConfigError
from sidecar.log import log, setup
from sidecar.options import OPTIONS, add_option, add_options, help_line, option, show_default

CHECK_TIMEOUT_S = 10.0  # how long each step of `sidecar check` may take


class _Formatter(argparse.HelpFormatter):
    """Descriptions wrapped to the terminal as usual; indented lines (examples, exit statuses)
    kept as written."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        # argparse makes a formatter for every option it adds and, without a width, imports
        # shutil (with bz2 and lzma) to ask the terminal: 3 % of a daemon's start-up, for help
        # it never prints. os answers the same question.
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n".join(line if line.startswith(" ") or not line else fill(line, width, indent)
                         for line in text.splitlines())


def _columns() -> int:
    """The terminal's width as shutil.get_terminal_size() finds it: a positive $COLUMNS, else
    the terminal's, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):  # no stdout (None), closed, not a terminal
        return 80


def build_parser(for_command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given `for_command`, only that command is added: a daemon's
    start-up does not pay for a hundred options and nine parsers it never uses (the other
    commands' parsers alone were 2 % of it). A name that is no command builds them all, for the
    usage message."""
    parser = _Parser(
        prog="sidecar", description="Forward a training job's output, metrics, telemetry and "
        "lifecycle to the platform's ingest API.", epilog=_epilog(HELP_TAILS["sidecar"]),
        formatter_class=_Formatter, allow_abbrev=False)
    parser.add_argument("-V", "--version", action="version", version=f"sidecar {__version__}")
    commands = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    every = for_command not in HELP_TAILS or for_command == "sidecar"
    for command in SUBCOMMANDS:
        if every or command.name == for_command:
            # allow_abbrev off: `status --onc` is a typo to name, not --once silently
            sub = commands.add_parser(command.name, help=command.help, description=command.help,
                                      usage=command.usage,
                                      epilog=_epilog(HELP_TAILS[command.name]),
                                      formatter_class=_Formatter, allow_abbrev=False)
            for adds in command.arguments:
                adds(sub)
    return parser


# What a row's `arguments` are made of: each adds its argument to the command's parser, so a
# command's arguments are written in its row alone.
Adder = Callable[[argparse.ArgumentParser], None]


def _options(command: str) -> Adder:
    """Every option of the table that `command` takes (options.py)."""
    return lambda parser: add_options(parser, command)


def _option(*names: str) -> Adder:
    """The options of the table named."""
    def adds(parser: argparse.ArgumentParser) -> None:
        for name in names:
            add_option(parser, name)
    return adds


def _flag(flag: str, help: str) -> Adder:
    def adds(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(flag, action="store_true", help=help)
    return adds


def _value(flag: str, default: object, help: str, *, metavar: str,
           type: Callable[[str], object] = str, shown: str = "", env: str = "") -> Adder:
    """An option outside the table, its help ending as the table's rows do."""
    return lambda parser: _add(parser, flag, default, help, metavar=metavar, type=type,
                               shown=shown, env=env)


def _repeated(flag: str, help: str, *, metavar: str) -> Adder:
    """An option outside the table given any number of times, its help as the rows'."""
    text = help_line(help, "none").replace("%", "%%")

    def adds(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(flag, action="append", default=[], metavar=metavar, help=text)
    return adds


def _positional(name: str, help: str, **how: Any) -> Adder:
    def adds(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(name, help=help, **how)
    return adds


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


# `status` and `stacks`: which daemon's to show
_DAEMON = (
    _value("--run-id", None, "the run whose daemon to show, when several run on this node",
           metavar="ID", shown="the platform's run id variable, else the only daemon"),
    _value("--status-addr", None, "the daemon's status endpoint", metavar="HOST:PORT",
           shown="the address the daemon wrote to the state dir, else 127.0.0.1:9620",
           env="SIDECAR_STATUS_ADDR"),
    _option("state-dir", "config"),
)


def _add(parser: argparse.ArgumentParser, flag: str, default: object, help: str, *,
         metavar: str, type: Callable[[str], object] = str, shown: str = "",
         env: str = "") -> None:
    """An option outside the table, its help ending as the table's rows do."""
    text = help_line(help, shown or show_default(default), env)
    parser.add_argument(flag, default=default, type=type, metavar=metavar,
                        help=text.replace("%", "%%"))


def _epilog(tail: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    examples, exit_codes = tail
    return ("examples:\n" + "".join(f"  {line}\n" for line in examples)
            + "\nexit status:\n" + "".join(f"  {line}\n" for line in exit_codes))


def _early_context() -> dict[str, str]:
    """The run and node as the environment names them, for a message said before (or because)
    the configuration could not be resolved."""
    import socket

    from sidecar.config import FAMILIES

    run_id = next((os.environ[f.run_id] for f in FAMILIES if os.environ.get(f.run_id)), "")
    return log_context(run_id, os.environ.get("NODE_NAME") or socket.gethostname())


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether the command line or SIDECAR_MESSAGE_FORMAT asks for JSON messages, read before
    parsing: an error in parsing is said in the format asked for."""
    given = os.environ.get(option("message-format").env, "")
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg.startswith("--message-format="):
            given = arg.partition("=")[2]
        elif arg == "--message-format" and i + 1 < len(argv):
            given = argv[i + 1]
    return given.strip().lower() == "json"


def _json_error(command: str, message: str, concerns: Mapping[str, str] | None = None) -> None:
    """`message`, an error that stops `command` before it starts, as one JSON message with the
    option or variable it `concerns`."""
    setup("info", "json", _early_context())
    log.error("%s", message, extra={"command": command, **(concerns or {})})


class _StoreOnce(argparse._StoreAction):
    """An option that takes one value: given again, a usage error. argparse keeps the last
    value, so `--drain-timeout 5 --drain-timeout 9` ran with 9 and never said so; which one was
    meant is for the user to say (the repeatable options append instead)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None,
                 option_string: str | None = None) -> None:
        given = parser._given if isinstance(parser, _Parser) else {}
        if self.dest in given:
            parser.error(f"{option_string} is given twice ({given[self.dest]!r}, then "
                         f"{values!r}) and takes one value: give it once")
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, saying its errors as a JSON message when those are asked for, and
    refusing an option that takes one value given twice (`_StoreOnce`)."""

    json_errors = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "store", _StoreOnce)
        self.register("action", None, _StoreOnce)
        self._given: dict[str, object] = {}  # this parse's values of the options taking one

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        self._given = {}
        return super().parse_known_args(args, namespace)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """An option of the table's choices is checked when the configuration is resolved,
        with every other mistake of it (argparse stopped at the first, quoting the value)."""
        if action.option_strings and _TABLE_CHOICES.get(action.dest) == action.choices:
            return
        super()._check_value(action, value)

    def error(self, message: str) -> NoReturn:
        from sidecar.masking import mask  # a value pasted in the wrong place may be the token

        message = mask(message)
        if not self.json_errors:
            super().error(message)
        _json_error(self.prog.removeprefix("sidecar").strip() or "sidecar", message)
        sys.exit(EXIT_CONFIG)


# the options of the table with choices, by dest: checked by the configuration (_check_value)
_TABLE_CHOICES = {opt.attr: opt.choices for opt in OPTIONS if opt.choices}


def main(argv: Sequence[str] | None = None) -> int:
    _reserve_standard_descriptors()
    learn_secrets(os.environ)  # before anything is parsed: a message may quote a value
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.json_errors = _wants_json(argv)
    parser = build_parser(argv[0] if argv else None)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; "
                     + closest(argv[0], list(COMMANDS), otherwise="`sidecar --help` lists them"))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.cmd, unknown)
    if args.cmd in ("run", "check"):
        try:
            args.command = command_of(args.command, argv)
        except ValueError as exc:
            subparser(parser, args.cmd).error(str(exc))
    args.build_parser = build_parser  # what `completion` describes: every command
    try:
        code = _main_of(COMMANDS[args.cmd])(args)
    except ConfigError as exc:
        if _Parser.json_errors:
            _json_error(args.cmd, exc.said, exc.concerns)
        else:
            print(f"sidecar {args.cmd}: {exc.said}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        sys.stdout.flush()  # here, not in the interpreter's exit, where a failure costs status 120
    except BrokenPipeError:
        from sidecar.commands import discard

        discard(sys.stdout)
    return code


def _main_of(command: Subcommand) -> Callable[[argparse.Namespace], int]:
    """The `main` of the command's module, imported now: only the command that runs is loaded."""
    import importlib

    run: Callable[[argparse.Namespace], int] = importlib.import_module(command.module).main
    return run


def _reserve_standard_descriptors() -> None:
    """Descriptors 0-2 that we were started without (`1>&-`, as some schedulers start a job) are
    opened on /dev/null, before anything of ours opens one: else the event loop's epoll or a
    socket takes the number, the command's output is copied into it, and a `sys.stdout` of None
    fails the exit with status 1 whatever the command did."""
    for fd, mode, name in ((0, os.O_RDONLY, "stdin"), (1, os.O_WRONLY, "stdout"),
                           (2, os.O_WRONLY, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, mode)
            if opened != fd:  # a lower one was closed too and took it: this one is next
                os.dup2(opened, fd)
                os.close(opened)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115 (open for the process's life)


def _refuse_unknown(parser: argparse.ArgumentParser, command: str,
                    unknown: Sequence[str]) -> None:
    """Exit 2 with the command's own usage, naming the first unknown option and the closest
    one the command has (argparse would print the top-level usage, naming neither)."""
    sub = subparser(parser, command)
    flag = unknown[0].partition("=")[0]
    flags = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
    lists = f"`sidecar {command} --help` lists what it takes"
    if "--" in unknown:  # a command after --, as `run` takes it
        words = " ".join(unknown[unknown.index("--") + 1:]) or "COMMAND"
        does = ("`watch` follows files and runs no command" if command == "watch"
                else f"`sidecar {command}` runs no command")
        sub.error(f"{does}; to run one, use `sidecar run [OPTIONS] -- {words}`")
    if not flag.startswith("-"):
        sub.error(f"unexpected argument {flag!r}; {lists}")
    sub.error(f"unknown option {flag}; {closest(flag, flags, otherwise=lists)}")


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `command` inside the command line's `parser`."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = action.choices[command]
    return found


class Subcommand(NamedTuple):
    """One command of the command line, its one row: what --help says of it, its arguments,
    the module whose `main(args)` runs it (imported only then), and the end of its --help (its
    examples and exit statuses)."""

    name: str
    help: str
    arguments: tuple[Adder, ...]
    module: str
    examples: tuple[str, ...]
    exits: tuple[str, ...]
    usage: str | None = None  # None: the one argparse writes


# In the order `sidecar --help` lists them.
SUBCOMMANDS = (
    Subcommand(
        "run", "wrap a training command and report it",
        (_options("run"), _positional("command", "the command to run, after --",
                                      nargs=argparse.REMAINDER)),
        "sidecar.wrapper",
        ("sidecar run -- python train.py --lr 3e-4",
         "sidecar run --jsonl 'out/metrics*.jsonl' --tensorboard runs/ -- ./train.sh",
         "sidecar run --running-when marker -- ./train.sh  # see: sidecar lifecycle -h"),
        ("the command's own (128+N when a signal N ended it)",
         "127  the command could not be started",
         "2    configuration error: nothing was started"),
        usage="sidecar run [OPTIONS] -- COMMAND [ARG...]"),
    Subcommand(
        "watch", "follow log, JSONL and TensorBoard files until SIGTERM", (_options("watch"),),
        "sidecar.watch",
        ("sidecar watch --log '/shared/*.log' --jsonl /shared/metrics.jsonl",
         "sidecar watch --tensorboard /shared/tb --hardware-interval 30"),
        ("0  SIGTERM or SIGINT, then a clean drain",
         "2  configuration error, or the run's state folder is held by another sidecar"),
        usage="sidecar watch [OPTIONS]"),
    Subcommand(
        "check", "validate the configuration, probe the endpoint from this node, explain what "
        "is wrong; takes the options of run and watch",
        (_flag("--json", "print one JSON document"),
         _value("--timeout", CHECK_TIMEOUT_S, "how long each step may take, in seconds",
                type=_seconds, metavar="SECONDS"),
         _options("check"),
         _positional("command", "the command `run` would wrap, after --: which Python the "
                     "environment snapshot would describe", nargs=argparse.REMAINDER)),
        "sidecar.commands.check",
        ("sidecar check",
         "sidecar check --jsonl /shared/m.jsonl -- torchrun --nproc-per-node 8 train.py",
         "sidecar check --json | jq .steps"),
        ("0  the ingest accepted the probe (or reporting is off)",
         "1  a step failed: its line names the likely cause and the fix",
         "2  configuration error")),
    Subcommand(
        "config", "print the configuration `run` would start with, each value with where it "
        "came from; contacts nothing, starts nothing",
        (_flag("--json", "print one JSON document"), _options("config")),
        "sidecar.commands.config",
        ("sidecar config --config deploy/sidecar.toml",
         "sidecar config --jsonl 'out/*.jsonl' --json | jq .options.jsonl"),
        ("0  `run` would start with this configuration",
         "2  configuration error: `run` would refuse it")),
    Subcommand(
        "status", "counters of the running daemon",
        (_flag("--json", "print the daemon's /status document once, as JSON"),
         _flag("--once", "print the table once and exit (for scripts)"), *_DAEMON),
        "sidecar.commands.status",
        ("sidecar status", "sidecar status --once --run-id run-4f2a91",
         "sidecar status --json --status-addr 127.0.0.1:9620"),
        ("0  the daemon answered", "1  nothing answered at the address",
         "2  several daemons run here and no --run-id picks one, or a bad --status-addr")),
    Subcommand(
        "stacks", "where every process of the running daemon's command is, now",
        (_flag("--full", "every thread's frames after the summary"),
         _flag("--json", "print the dump as JSON"),
         _flag("--last", "the stacks taken at the stall or the SIGTERM, not new ones"),
         *_DAEMON),
        "sidecar.commands.stacks",
        ("sidecar stacks", "sidecar stacks --full --run-id run-4f2a91", "sidecar stacks --last"),
        ("0  the stacks were printed (from the state folder when no daemon answers)",
         "1  nothing answered and no dump is kept",
         "2  several daemons run here and no --run-id picks one",
         "3  the daemon cannot take them (no py-spy)")),
    Subcommand(
        "profile", "sample every rank of the running daemon's command for a few seconds: "
        "where each one's time goes, and its hottest frames",
        (_value("--seconds", 10, "how long to sample, in seconds (1 to 300)", type=int,
                metavar="N"),
         _flag("--json", "print the profile as JSON"), *_DAEMON),
        "sidecar.commands.profile",
        ("sidecar profile", "sidecar profile --seconds 30 --run-id run-4f2a91"),
        ("0  the profile was printed",
         "1  nothing answered at the address",
         "2  several daemons run here and no --run-id picks one; --seconds out of range",
         "3  the daemon cannot sample (no py-spy, no process in view)")),
    Subcommand(
        "lifecycle", "post one lifecycle event, strictly",
        (_positional("event", "the event to post", choices=EVENTS),
         _value("--timeout", 60.0, "give up (exit 1, event kept for replay) after this many "
                "seconds", type=_seconds, metavar="SECONDS"),
         _option("state-dir", "token-file", "config")),
        "sidecar.commands.lifecycle",
        ("sidecar lifecycle running   # in a `run --running-when marker` child",
         "sidecar lifecycle failed --timeout 10"),
        ("0  acknowledged (or recorded already), handed to the wrapper, or reporting off",
         "1  refused (by the ingest, or after the run's end), or not acknowledged in",
         "   time (kept for `sidecar replay`)",
         "2  configuration error, or another sidecar (named) writes the run's lifecycle")),
    Subcommand(
        "replay", "deliver what an earlier run left spooled",
        (_value("--timeout", 300.0, "give up (exit 1, data kept) after this many seconds",
                type=_seconds, metavar="SECONDS"),
         _option("state-dir", "token-file", "config")),
        "sidecar.commands.replay",
        ("sidecar replay", "sidecar replay --state-dir /var/lib/sidecar --timeout 60"),
        ("0  everything was delivered (or nothing was left)",
         "1  something is still undelivered; it stays in the state folder",
         "2  configuration error")),
    Subcommand(
        "receive", "a local ingest server that checks every request as docs/ingest.md "
        "describes it and stores what it accepts",
        (_value("--host", "127.0.0.1", "the address to listen on", metavar="HOST"),
         _value("--port", 8080, "the port to listen on; 0: any free one", type=int,
                metavar="PORT"),
         _value("--dir", Path("received"), "folder for one JSONL file per route", type=Path,
                metavar="DIR"),
         _value("--token", None, "accept only this token", metavar="TOKEN", shown="any"),
         _value("--run-id", None, "accept only this run id", metavar="ID", shown="any"),
         _value("--ready-file", None, "write the base URL here once listening", type=Path,
                metavar="PATH"),
         _flag("--quiet", "no live summary")),
        "sidecar.commands.receive",
        ("sidecar receive --dir /tmp/ingest --port 8080",
         "sidecar receive --port 0 --ready-file /tmp/url --token tok --run-id run-1"),
        ("0  stopped by SIGTERM or Ctrl-C", "1  cannot listen on HOST:PORT")),
    Subcommand(
        "inject", "the Kubernetes admission webhook that adds the sidecar to training pods "
        "(docs/webhook.md)",
        (_value("--listen", "0.0.0.0:8443", "the address to serve HTTPS on; port 0: any free "
                "one", metavar="HOST:PORT"),
         _value("--tls-cert", None, "the serving certificate (PEM), read again when it "
                "changes", type=Path, metavar="FILE", shown="required"),
         _value("--tls-key", None, "its private key (PEM)", type=Path, metavar="FILE",
                shown="required"),
         _value("--image", "sidecar", "the image the injected container runs", metavar="IMAGE"),
         _repeated("--select", "a label or annotation, KEY or KEY=VALUE, that asks for the "
                   "sidecar too, beside the training operators' labels (repeatable)",
                   metavar="LABEL"),
         _value("--ready-file", None, "write the base URL here once listening", type=Path,
                metavar="PATH")),
        "sidecar.commands.inject",
        ("sidecar inject --tls-cert tls.crt --tls-key tls.key --image sidecar:1.4",),
        ("0  stopped by SIGTERM or Ctrl-C",
         "2  the certificate cannot be loaded, or the address cannot be had")),
    Subcommand(
        "demo", "run a bundled example trainer against a local receiver", (),
        "sidecar.commands.demo",
        ("sidecar demo",),
        ("the example trainer's exit status under `sidecar run` (0)",)),
    Subcommand(
        "completion", "print a shell completion script for bash or zsh",
        (_positional("shell", "the shell to complete in", choices=("bash", "zsh")),),
        "sidecar.commands.completion",
        ("sidecar completion bash > ~/.local/share/bash-completion/completions/sidecar",
         "sidecar completion zsh > \"${fpath[1]}/_sidecar\"  # then: compinit"),
        ("0  the script was printed",)),
)
COMMANDS = {command.name: command for command in SUBCOMMANDS}
# Each command's examples, then its exit statuses: the end of its --help, `sidecar --help`'s too.
HELP_TAILS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sidecar": (
        ("sidecar run --jsonl 'out/*.jsonl' -- python train.py  # wrap a training run",
         "sidecar check                  # why do the charts stay empty?",
         "sidecar COMMAND --help         # each command's options"),
        ("that of the command run; 2 for a configuration error",)),
    **{command.name: (command.examples, command.exits) for command in SUBCOMMANDS},
}
