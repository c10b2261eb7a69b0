"""`sidecar stacks`: where every process of the command a running `sidecar run` or `watch` looks
after is, now (docs/stalls.md#on-demand).

It asks the daemon's status endpoint (found as `sidecar status` finds it) for `/stacks`: the
daemon, the command's parent, is the process allowed to read its stacks; this shell often is
not. The summary is the one a stall writes to /logs; `--full` adds every thread's frames,
`--json` prints the document. When no daemon answers, the newest dump kept in the state folder
is shown, with when it was taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sidecar.commands import print_out
from sidecar.commands.status import Ambiguous, NoAnswer, _configured, choose
from sidecar.exits import EXIT_AMBIGUOUS, EXIT_CANNOT_LOOK, EXIT_NO_ANSWER, EXIT_OK

# the daemon dumps every process with native frames: seconds for a torch process
FETCH_TIMEOUT_S = 30.0


def stacks_command(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        address, _ = choose(args, environ)
    except Ambiguous as exc:
        print(f"sidecar stacks: {exc}", file=sys.stderr)
        return EXIT_AMBIGUOUS
    except NoAnswer as exc:
        return _from_state_folder(args, environ, str(exc))
    try:
        doc = _fetch(address, "/stacks/last" if args.last else "/stacks")
    except NoAnswer as exc:
        print(f"sidecar stacks: {exc}", file=sys.stderr)
        return EXIT_CANNOT_LOOK
    _show(doc, args, f"taken by the daemon at {address}")
    return EXIT_OK


def _fetch(address: str, path: str, timeout_s: float = FETCH_TIMEOUT_S) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with direct.open(f"http://{address}{path}", timeout=timeout_s) as response:
            doc = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        why = exc.read().decode("utf-8", "replace").strip()
        raise NoAnswer(f"{address}{path} answered HTTP {exc.code}: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise NoAnswer(f"{address}{path} did not answer ({exc})") from None
    if not isinstance(doc, dict):
        raise NoAnswer(f"{address}{path} did not answer with a JSON object")
    return doc


def _from_state_folder(args: argparse.Namespace, environ: Mapping[str, str],
                       problem: str) -> int:
    _, state_dir, _, _ = _configured(args, environ)
    dumps = sorted(state_dir.glob("*/stacks/*.json"), key=_mtime)
    dumps += sorted(state_dir.glob("*/*/stacks/*.json"), key=_mtime)
    if not dumps:
        print(f"sidecar stacks: {problem}", file=sys.stderr)
        return EXIT_NO_ANSWER
    newest = max(dumps, key=_mtime)
    try:
        doc = json.loads(newest.read_text())
    except (OSError, ValueError) as exc:
        print(f"sidecar stacks: {problem}; the newest dump, {newest}, cannot be read ({exc})",
              file=sys.stderr)
        return EXIT_NO_ANSWER
    print(f"sidecar stacks: no daemon answers ({problem.split('. ')[0]}); the newest dump kept "
          f"in the state folder follows", file=sys.stderr)
    _show(doc, args, f"kept in {newest}")
    return EXIT_OK


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _show(doc: Mapping[str, Any], args: argparse.Namespace, where: str) -> None:
    if args.json:
        print_out(json.dumps(doc, indent=2))
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(doc.get("taken_at", 0))))
    print_out(f"stacks of {len(doc.get('processes', ()))} processes ({doc.get('reason')}, {when}, "
              f"{where}), by where they are:")
    if doc.get("refused"):
        print_out(f"  {doc['refused']}")
    for line in doc.get("summary", ()):
        print_out(f"  {line}")
    if not args.full:
        return
    for process in doc.get("processes", ()):
        rank = f" rank {process['rank']}" if process.get("rank") is not None else ""
        print_out(f"\nPID {process['pid']} {process.get('name', '')}{rank}"
                  f"{': ' + process['error'] if process.get('error') else ''}")
        for thread in process.get("threads", ()):
            state = "active" if thread.get("active") else "idle"
            print_out(f"  Thread {thread.get('os_thread_id')} ({state}): "
                      f"{thread.get('thread_name') or ''}")
            for frame in thread.get("frames", ()):
                line = f":{frame['line']}" if frame.get("line") else ""
                print_out(f"    {frame.get('name')} ({frame.get('short_filename')}{line})")


def main(args: argparse.Namespace) -> int:
    """`sidecar stacks`."""
    from sidecar.config import warn_unknown_variables
    from sidecar.log import setup

    setup()
    warn_unknown_variables()
    return stacks_command(args)
