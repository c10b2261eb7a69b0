"""`sidecar ... --help`: what a new user reads first says each option's default and variable,
ends with examples and exit statuses, and fits an 80-column terminal."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest

from sidecar.cli import build_parser
from sidecar.options import OPTIONS, options_of
from tests.conftest import SIDECAR, clean_environ

COMMANDS = ("run", "watch", "check", "config", "status", "stacks", "profile", "lifecycle",
            "replay",
            "receive", "inject", "demo", "completion")
# The words a value is shown as: one vocabulary for every command (argparse's {a,b} aside).
METAVARS = {"PATH", "DIR", "FILE", "IMAGE", "LABEL", "SECONDS", "N", "HOST:PORT", "HOST", "PORT",
            "TEMPLATE",
            "MB/S", "NAME", "ID", "TOKEN", "COMMAND", "LOCAL=URI", "FIELD=NAME",
            "BYTES/S"}


def help_of(command: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    if not command:
        return parser.format_help()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


def entries(help_text: str) -> dict[str, str]:
    """Each option's entry in the `options:` section, its wrapped lines joined: --flag -> text."""
    found: dict[str, str] = {}
    section = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    current = ""
    for line in section.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            found[current] = line.strip()
        else:
            found[current] += " " + line.strip()
    return found


@pytest.mark.parametrize("command", ["run", "watch", "check"])
def test_every_table_option_shows_its_default_and_variable(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shown = entries(help_of(command, monkeypatch))
    for opt in options_of(command):
        entry = shown["--" + opt.name]
        assert f"[env: {opt.env}" in entry, entry
        assert re.search(r"\[default: [^]]+\]", entry), entry
    if command != "watch":
        assert "--running-when" in shown


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_with_a_value_shows_its_default(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    valued = {a.option_strings[0] for a in sub.choices[command]._actions
              if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS}
    shown = entries(help_of(command, monkeypatch))
    for flag in valued:
        assert "[default: " in shown[flag], shown[flag]


def test_defaults_are_the_real_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = entries(help_of("run", monkeypatch))
    assert "[default: 10]" in shown["--hardware-interval"]
    assert "[default: 127.0.0.1:9620]" in shown["--status-addr"]
    assert "[default: spawn]" in shown["--running-when"]
    assert "SIDECAR_LOG, a :-separated list" in shown["--log"]
    receive = entries(help_of("receive", monkeypatch))
    assert "[default: 8080]" in receive["--port"]
    assert "[default: 127.0.0.1]" in receive["--host"]


@pytest.mark.parametrize("command", COMMANDS)
def test_metavars_come_from_one_vocabulary(command: str, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    usage = help_of(command, monkeypatch).split("\n\n", 1)[0]
    words = set(re.findall(r"--[a-z-]+ ([^\s\]{]+)", usage))
    assert words <= METAVARS, words - METAVARS


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_ends_with_examples_and_exit_statuses(command: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    text = help_of(command, monkeypatch)
    examples = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert 1 <= len(examples) <= 3
    assert all(line.strip().startswith("sidecar") for line in examples)
    statuses = text.split("\nexit status:\n", 1)[1].strip().splitlines()
    assert statuses and text.rstrip().endswith(statuses[-1].strip())


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_fits_80_columns(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    too_wide = [line for line in help_of(command, monkeypatch).splitlines() if len(line) > 80]
    assert not too_wide


def test_the_receiver_ships_no_test_only_option(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Faults are injected by tests/faulty_ingest.py, around the receiver, not by an option of it.
    assert "--faults" not in help_of("receive", monkeypatch)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["receive", "--faults"])
    assert "unrecognized arguments: --faults" in capsys.readouterr().err


def test_each_command_is_one_row_naming_the_module_that_runs_it() -> None:
    """A command is declared in one row of SUBCOMMANDS: its help, its arguments, its examples
    and exit statuses, and the module whose `main(args)` runs it; cli.py holds no function of
    its own for any command."""
    import importlib
    import inspect

    import sidecar.cli as cli
    from sidecar.cli import COMMANDS as ROWS
    from sidecar.cli import HELP_TAILS, SUBCOMMANDS

    assert tuple(command.name for command in SUBCOMMANDS) == COMMANDS == tuple(ROWS)
    for command in SUBCOMMANDS:
        main = importlib.import_module(command.module).main
        assert list(inspect.signature(main).parameters) == ["args"], command.module
    functions = {name for name, value in vars(cli).items() if inspect.isfunction(value)
                 and value.__module__ == "sidecar.cli"}
    assert not {f"_{name}" for name in COMMANDS} & functions
    assert not {f"_{name}_arguments" for name in COMMANDS} & functions
    assert set(HELP_TAILS) == {"sidecar", *COMMANDS}
    for command in SUBCOMMANDS:  # a command's own parser holds it alone
        sub = next(a for a in build_parser(command.name)._actions
                   if isinstance(a, argparse._SubParsersAction))
        assert list(sub.choices) == [command.name]


def test_every_row_reaches_a_command() -> None:
    assert {opt.name for opt in OPTIONS} == {opt.name for opt in options_of("check")}


def test_the_real_process_prints_it() -> None:
    env = {**clean_environ(), "COLUMNS": "80"}
    done = subprocess.run([*SIDECAR, "watch", "--help"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "[env: SIDECAR_HARDWARE_INTERVAL]" in " ".join(done.stdout.split())
    assert "exit status:" in done.stdout


def test_a_new_row_of_any_kind_gets_its_help_and_parsing_derived(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.config import _pick
    from sidecar.options import Option, add_option

    rows = (Option("tty", "bool", False, "run the command on a pseudo-terminal", only="run"),
            Option("stall-after", "float", 1800.0, "seconds of silence before a stall is said"),
            Option("log-ansi", "str", "strip", "escape sequences in forwarded text",
                   choices=("strip", "keep")))
    monkeypatch.setenv("COLUMNS", "80")
    parser = argparse.ArgumentParser(prog="sidecar run")
    for row in rows:
        add_option(parser, row)
    shown = entries(parser.format_help())
    assert shown["--tty"].endswith("[default: off] [env: SIDECAR_TTY]")
    assert shown["--stall-after"].startswith("--stall-after SECONDS")
    assert "[default: 1800] [env: SIDECAR_STALL_AFTER]" in shown["--stall-after"]
    assert shown["--log-ansi"].startswith("--log-ansi {strip,keep}")
    args = parser.parse_args(["--tty", "--stall-after", "5"])
    assert args.tty is True and args.stall_after == "5" and args.log_ansi is None
    assert parser.parse_args([]).tty is None  # absent: the environment or the file decide
    assert _pick(rows[0], None, {"SIDECAR_TTY": "yes"}, {}) == (True, "SIDECAR_TTY")
    assert _pick(rows[0], None, {}, {"tty": False}, "run.toml") == (False, "--config run.toml: tty")
    assert _pick(rows[0], None, {}, {}) == (False, "--tty")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_parser_built_for_one_command_parses_it_as_the_whole_one(command: str) -> None:
    """main() builds only the invoked command (a daemon's start-up skips a hundred add_argument
    calls and nine parsers); its help and its options must be the whole parser's."""
    def sub(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices[command]

    whole, alone = sub(build_parser()), sub(build_parser(command))
    assert [a.option_strings or a.dest for a in alone._actions] == [
        a.option_strings or a.dest for a in whole._actions]
    assert alone.format_help() == whole.format_help()
    assert list(next(a for a in build_parser(command)._actions
                     if isinstance(a, argparse._SubParsersAction)).choices) == [command]


@pytest.mark.parametrize("columns", ["50", "132", "0", "wide", None])
def test_help_is_as_wide_as_argparse_makes_it(columns: str | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The formatter asks os for the terminal's width instead of importing shutil (3 % of a
    start-up): the answer must be argparse's own, whatever $COLUMNS holds."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    ours = build_parser().formatter_class("sidecar")
    theirs = argparse.HelpFormatter("sidecar")
    assert ours._width == theirs._width  # type: ignore[attr-defined]
