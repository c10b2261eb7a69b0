"""`sidecar completion bash|zsh`: a completion script made from the command line's own parser,
so that it names every command, option and choice the installed version has."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import NamedTuple

FILE_METAVARS = ("PATH", "DIR", "FILE")  # values completed as file names; others as nothing


class _Option(NamedTuple):
    flags: tuple[str, ...]
    takes_value: bool
    choices: tuple[str, ...]
    help: str
    files: bool  # the value is a file or folder name
    repeatable: bool  # given more than once, each adds (--log, --jsonl)


class _Command(NamedTuple):
    name: str
    help: str
    options: tuple[_Option, ...]
    positional_choices: tuple[str, ...]  # `lifecycle EVENT`, `completion SHELL`
    takes_command: bool  # `run -- COMMAND`


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for `shell` (bash or zsh) of the commands `parser` holds."""
    commands = _commands(parser)
    return _bash(commands) if shell == "bash" else _zsh(commands)


def _commands(parser: argparse.ArgumentParser) -> list[_Command]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    found = []
    for name, sub in action.choices.items():
        options: list[_Option] = []
        positional: tuple[str, ...] = ()
        takes_command = False
        for arg in sub._actions:
            if arg.option_strings:
                if arg.help == argparse.SUPPRESS:
                    continue
                options.append(_Option(tuple(arg.option_strings), arg.nargs != 0,
                                       tuple(str(c) for c in arg.choices or ()),
                                       _short(arg.help or ""), arg.metavar in FILE_METAVARS,
                                       isinstance(arg, argparse._AppendAction)))
            elif arg.nargs == argparse.REMAINDER:
                takes_command = True
            elif arg.choices:
                positional = tuple(str(c) for c in arg.choices)
        found.append(_Command(name, _short(helps.get(name, "")), tuple(options), positional,
                              takes_command))
    return found


def _short(help_text: str) -> str:
    """An option's help without its default and variable, on one line."""
    return re.sub(r"\s*\[(default|env): [^]]*\]", "", help_text).replace("%%", "%").strip()


def _bash(commands: list[_Command]) -> str:
    names = " ".join(c.name for c in commands)
    value_cases, option_cases = [], []
    for command in commands:
        flags = " ".join([*(f for o in command.options for f in o.flags),
                          *(["--"] if command.takes_command else [])])
        option_cases.append(f"        {command.name}) opts={shlex.quote(flags)}; "
                            f"words_={shlex.quote(' '.join(command.positional_choices))} ;;")
        for option in (o for o in command.options if o.takes_value):
            pattern = "|".join(f"'{command.name} {f}'" for f in option.flags)
            if option.choices:
                words = shlex.quote(" ".join(option.choices))
                reply = f'($(compgen -W {words} -- "$cur"))'
            else:
                reply = '($(compgen -f -- "$cur"))' if option.files else "()"
            value_cases.append(f"        {pattern}) COMPREPLY={reply}; return ;;")
    return f"""# bash completion for sidecar: source <(sidecar completion bash)
_sidecar() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local cmd="${{COMP_WORDS[1]}}" opts="" words_="" i
    if [[ $COMP_CWORD -eq 1 ]]; then
        COMPREPLY=($(compgen -W "{names} -h --help -V --version" -- "$cur"))
        return
    fi
    for ((i = 2; i < COMP_CWORD; i++)); do
        if [[ ${{COMP_WORDS[i]}} == -- ]]; then  # the wrapped command's own words
            if [[ $i -eq $((COMP_CWORD - 1)) ]]; then
                COMPREPLY=($(compgen -c -- "$cur"))
            else
                COMPREPLY=($(compgen -f -- "$cur"))
            fi
            return
        fi
    done
    case "$cmd $prev" in
{chr(10).join(value_cases)}
    esac
    case "$cmd" in
{chr(10).join(option_cases)}
        *) return ;;
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif [[ -n $words_ ]]; then
        COMPREPLY=($(compgen -W "$words_" -- "$cur"))
    fi
}}
complete -o default -F _sidecar sidecar
"""


def _zsh_escape(text: str) -> str:
    """Text inside a single-quoted _arguments spec: no quote, bracket or colon left to break it."""
    return text.replace("'", "").replace("[", "(").replace("]", ")").replace(":", " -")


def _zsh(commands: list[_Command]) -> str:
    described = "\n".join(f"    '{c.name}:{_zsh_escape(c.help)}'" for c in commands)
    cases = []
    for command in commands:
        specs = []
        for option in command.options:
            exclusive = f"({' '.join(option.flags)})" if len(option.flags) > 1 else ""
            names = ",".join(option.flags) if len(option.flags) > 1 else option.flags[0]
            names = "{" + names + "}" if len(option.flags) > 1 else names
            value = ""
            if option.choices:
                value = f":value:({' '.join(option.choices)})"
            elif option.takes_value:
                value = ":value:_files" if option.files else ":value: "
            many = "*" if option.repeatable else ""
            specs.append(f"'{exclusive}'{names}'[{_zsh_escape(option.help)}]{value}'"
                         if exclusive else f"'{many}{names}[{_zsh_escape(option.help)}]{value}'")
        if command.positional_choices:
            specs.append(f"'1:argument:({' '.join(command.positional_choices)})'")
        if command.takes_command:
            specs.append("'*::command:_normal'")
        joined = " \\\n        ".join(specs)
        cases.append(f"    {command.name})\n      _arguments -s \\\n        {joined} ;;")
    return f"""#compdef sidecar
# zsh completion for sidecar: sidecar completion zsh > "${{fpath[1]}}/_sidecar"
_sidecar() {{
  local -a commands
  commands=(
{described}
  )
  if (( CURRENT == 2 )); then
    _describe 'command' commands
    _arguments '(- *)'{{-V,--version}}'[print the version]' '(- *)'{{-h,--help}}'[show help]'
    return
  fi
  local cmd=$words[2]
  shift words
  (( CURRENT-- ))
  case $cmd in
{chr(10).join(cases)}
  esac
}}
_sidecar "$@"
"""


def main(args: argparse.Namespace) -> int:
    """`sidecar completion SHELL`: the script for every command of `args.build_parser()`."""
    print(script(args.build_parser(), args.shell), end="")
    return 0
