"""`sidecar config`: the configuration `run` would start with, each value with where it came from
(a flag, a variable, the --config file, the default), as TOML that --config reads back.

Nothing is started and nothing is contacted: it resolves what `run` resolves and stops there,
exiting 2 on what `run` would refuse."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sidecar.commands import print_out
from sidecar.config import Config, resolve, unknown_variables
from sidecar.exits import EXIT_CONFIG, EXIT_OK, ConfigError
from sidecar.masking import MASK, add_secret, mask, mask_doc
from sidecar.options import option, options_of

VALUE_COLUMN = 40  # where the `# from` comments start, for a table that reads down


def show_config(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Print the effective configuration; 2 (with the reason) when `run` would refuse it."""
    origins: dict[str, str] = {}
    try:
        cfg = resolve(args, "config", environ, origins)
    except ConfigError as exc:
        if not args.json:
            raise  # said on stderr as every command's configuration error, exit status 2
        # every mistake, each on its own too, for a script that shows them one a line
        print_out(json.dumps({"ok": False, "error": str(exc),
                              "errors": [mask(problem) for problem in exc.problems]},
                             indent=2, ensure_ascii=False))
        return EXIT_CONFIG
    add_secret(cfg.token)
    warnings = unknown_variables(environ)
    if args.json:
        print_out(json.dumps(mask_doc(_document(cfg, origins, warnings)), indent=2,
                             ensure_ascii=False))
    else:
        for line in _text(cfg, origins, warnings):
            print_out(mask(line))
    return EXIT_OK


def _platform(cfg: Config) -> dict[str, Any]:
    """What the platform's variables say, and which variable said each."""
    platform = cfg.platform
    if not platform.enabled:
        return {"enabled": False}
    token_from = (f"--token-file {cfg.token_file}" if cfg.token_file
                  else platform.token_variable)
    family = platform.token_variable.rsplit("_", 1)[0]
    return {"enabled": True, "endpoint": platform.endpoint, "run_id": platform.run_id,
            "token": f"{MASK} ({len(cfg.token)} characters)", "token_from": token_from,
            "variables": f"{family}_*", "run_dir": str(cfg.run_dir)}


def _options(cfg: Config, origins: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    # a file-source kind's patterns are in `files`, by the name of its option
    values = {**cfg._asdict(), **{option(name).attr: paths for name, paths in cfg.files.items()}}
    return {opt.name: {"value": _plain(values[opt.attr]), "from": origins[opt.name],
                       **({"default": opt.shown_default}
                          if values[opt.attr] is None and opt.shown_default else {})}
            for opt in options_of("config")}


def _document(cfg: Config, origins: Mapping[str, str], warnings: list[str]) -> dict[str, Any]:
    return {"ok": True, "platform": _platform(cfg), "options": _options(cfg, origins),
            "warnings": warnings}


def _text(cfg: Config, origins: Mapping[str, str], warnings: list[str]) -> list[str]:
    platform = _platform(cfg)
    lines = ["# The configuration `sidecar run` would start with (nothing was started or "
             "contacted).", "# Each value says where it came from; --config reads this back."]
    if platform["enabled"]:
        lines += [f"# reporting: on ({platform['variables']})",
                  f"# endpoint: {platform['endpoint']}", f"# run id: {platform['run_id']}",
                  f"# token: {platform['token']}, from {platform['token_from']}",
                  f"# this run's folder: {platform['run_dir']}"]
    else:
        lines.append("# reporting: off (ENABLED=0): `run` passes the output through and posts "
                     "nothing")
    lines += [f"# warning: {warning}" for warning in warnings]
    lines.append("")
    for name, entry in _options(cfg, origins).items():
        value = entry["value"]
        where = f"# {entry['from']}"
        if value is None:
            shown = f"# {name} = (not set: {entry.get('default') or 'none'})"
            lines.append(f"{shown:<{VALUE_COLUMN}} {where}")
            continue
        lines.append(f"{name} = {_toml(value):<{VALUE_COLUMN - len(name) - 3}} {where}")
    return lines


def _plain(value: Any) -> Any:
    """A value as JSON and TOML hold it: paths as strings, tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def _toml(value: Any) -> str:
    """`value` as a TOML value (a JSON string is a TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def main(args: argparse.Namespace) -> int:
    """`sidecar config`."""
    import os

    from sidecar.log import setup

    setup()
    return show_config(args, os.environ)
