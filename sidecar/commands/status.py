"""`sidecar status`: the running daemon's counters as a table, redrawn in place like `top`.

It reads the daemon's `/status` (sidecar/observe/endpoint.py). The address is `--status-addr`,
else the one the daemon wrote to `<state-dir>/<run>/status-addr` (state dir and run resolved as
`run` resolves them), else the newest such file in the state dir, else the configured
`--status-addr` (default 127.0.0.1:9620). Rates come from the difference between successive
snapshots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sidecar.commands import print_out
from sidecar.config import (
    FAMILIES,
    resolve,
)
from sidecar.exits import EXIT_AMBIGUOUS, EXIT_NO_ANSWER, EXIT_OK, ConfigError
from sidecar.observe.address import DEFAULT_STATUS_ADDR, STATUS_ADDR_FILE, parse_host_port
from sidecar.statefile import Malformed, load_checked

if TYPE_CHECKING:  # the status server's module and what it imports: only once needed
    from sidecar.observe.endpoint import (
        FileSnapshot,
        RouteSnapshot,
        SourceSnapshot,
        StatusSnapshot,
    )


REFRESH_S = 1.0
KEY_MIN_WIDTH = 16  # a table's first column is never cut shorter, to fit a narrow terminal
# A table too wide for the terminal is drawn compact, in one block, before it is split: these
# headers, numbers in at most 5 characters (12345, 123k, 1.23M), sizes without their space and
# "iB" (64.0K, 118M), rates under their "/S" header without their own "/s", times without "ago".
SHORT_HEADERS = {"REQUESTS": "REQS", "ACCEPTED": "ACKED", "RETRIES": "RETRY",
                 "DROPPED": "DROP", "READ/S": "/S", "LINES/S": "/S", "POINTS/S": "/S",
                 "INVALID": "INVAL", "SKIPPED": "SKIP", "LAST READ": "READ"}
FETCH_TIMEOUT_S = 2.0

# ANSI: the alternate screen (the shell's screen comes back on exit), cursor home, clear to the
# end of the line and of the screen (drawing over the last frame does not flicker as a full clear
# would), cursor hidden while drawing.
ENTER_SCREEN = "\x1b[?1049h\x1b[?25l"
LEAVE_SCREEN = "\x1b[?25h\x1b[?1049l"
HOME = "\x1b[H"
CLEAR_LINE = "\x1b[K"
CLEAR_BELOW = "\x1b[J"


class NoAnswer(Exception):
    """Nothing usable answered at the status address; the message says what happened."""


class Ambiguous(Exception):
    """Several daemons answer and nothing says which one is meant; the message lists them."""


def status_command(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Show the daemon's status: as JSON (`--json`), once (`--once`, or stdout not a terminal)
    or live until Ctrl-C; 1 when nothing answers, 2 when several daemons do and nothing says
    which one is meant."""
    environ = os.environ if environ is None else environ
    try:
        address, doc = choose(args, environ)
        snap = _snapshot(address, doc)
    except NoAnswer as exc:
        print(f"sidecar status: {exc}", file=sys.stderr)
        return EXIT_NO_ANSWER
    except Ambiguous as exc:
        print(f"sidecar status: {exc}", file=sys.stderr)
        return EXIT_AMBIGUOUS
    if args.json:
        print_out(json.dumps(doc, indent=2, sort_keys=True))
        return EXIT_OK
    if args.once or not sys.stdout.isatty():
        print_out("\n".join(render(snap, None, address, shutil.get_terminal_size().columns)))
        return EXIT_OK
    return _live(address, snap, sys.stdout)


def choose(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The address of the daemon meant and its /status document: the one at --status-addr, else
    the one of --run-id (or the platform's run id), else the only one answering here."""
    if args.status_addr:
        try:
            parse_host_port(args.status_addr, "--status-addr")
        except ConfigError:
            raise ConfigError(f"--status-addr {args.status_addr!r}: expected HOST:PORT, for "
                              "example 127.0.0.1:9620") from None
        try:
            return args.status_addr, fetch_document(args.status_addr)
        except NoAnswer as exc:
            raise NoAnswer(_not_running(str(exc))) from None
    run_id, state_dir, configured, origin = _configured(args, environ)
    problems: list[str] = []
    answering: dict[str, dict[str, Any]] = {}
    candidates = _candidates(state_dir, configured)
    for address, found_in in candidates.items():
        try:
            answering[address] = fetch_document(address)
        except NoAnswer as exc:
            problems.append(f"{exc}, {found_in}")
    meant = {a: doc for a, doc in answering.items() if not run_id or doc.get("run_id") == run_id}
    if len(meant) == 1:
        return next(iter(meant.items()))
    if len(meant) > 1:
        raise Ambiguous(f"{len(meant)} daemons answer on this node; say which with --run-id ID "
                        "(or --status-addr HOST:PORT):\n" + _listing(meant))
    if answering:
        raise NoAnswer(f"no daemon of run {run_id} answers; these do (--run-id ID picks one):\n"
                       + _listing(answering))
    raise NoAnswer(_none_found("; ".join(problems), state_dir, origin))


def _none_found(problems: str, state_dir: Path, origin: str) -> str:
    """Nothing answered at any address found: which they were (`problems`), and the state
    folder searched for them, since a daemon run with another one (or by another user, under
    their home) writes its address there, not here."""
    given = "the default" if origin == "default" else f"from {origin.removeprefix('file ')}"
    return (f"{problems}. The state folder searched: {state_dir} ({given}), where `sidecar run` "
            f"and `sidecar watch` write their address to <run>/{STATUS_ADDR_FILE}: is one running "
            "on this node? One started with another --state-dir (SIDECAR_STATE_DIR), or by "
            "another user, is found with the same --state-dir; else pass --status-addr HOST:PORT")


def _not_running(problems: str) -> str:
    return (f"{problems}. Is `sidecar run` or `sidecar watch` running on this node? It writes "
            f"its address to <state-dir>/<run>/{STATUS_ADDR_FILE}; else pass --status-addr "
            "HOST:PORT")


def find_addresses(state_dir: Path, configured: str) -> list[str]:
    """Where daemons may listen: every address written in the state dir, newest first, then
    the configured --status-addr (default 127.0.0.1:9620)."""
    return list(_candidates(state_dir, configured))


def _candidates(state_dir: Path, configured: str) -> dict[str, str]:
    """find_addresses's, each with where it was found, in words, for a message."""
    files = sorted([*state_dir.glob(f"*/{STATUS_ADDR_FILE}"),  # <run>/, or <run>/<node>/
                    *state_dir.glob(f"*/*/{STATUS_ADDR_FILE}")], key=_mtime, reverse=True)
    found: dict[str, str] = {}
    for path in files:
        address = _read_addr(path)
        if address:
            found.setdefault(address, f"the address written in {path}")
    fallback = configured if configured != "off" else DEFAULT_STATUS_ADDR
    found.setdefault(fallback, "the configured --status-addr" if configured not in (
        "off", DEFAULT_STATUS_ADDR) else "the default --status-addr")
    return found


def _listing(found: Mapping[str, Mapping[str, Any]]) -> str:
    return "\n".join(f"  --run-id {doc.get('run_id') or '-'}  ({doc.get('mode', '?')} on node "
                     f"{doc.get('node', '?')}, --status-addr {address})"
                     for address, doc in found.items())


def fetch(address: str) -> StatusSnapshot:
    """GET http://ADDRESS/status as a snapshot; NoAnswer says why it failed."""
    return _snapshot(address, fetch_document(address))


def _snapshot(address: str, doc: Mapping[str, Any]) -> StatusSnapshot:
    from sidecar.observe.endpoint import StatusSnapshot

    try:
        return StatusSnapshot.from_json(doc)
    except ValueError as exc:
        raise NoAnswer(f"{address} did not answer with a sidecar status ({exc})") from None


def fetch_document(address: str) -> dict[str, Any]:
    """GET http://ADDRESS/status, the JSON document as served; NoAnswer says why it failed."""
    import urllib.error  # here, not at the top: the daemon imports this module for its
    import urllib.request  # constants and must not carry urllib.request's half a megabyte

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with direct.open(f"http://{address}/status", timeout=FETCH_TIMEOUT_S) as response:
            doc = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise NoAnswer(f"{address} answered HTTP {exc.code}: not a sidecar status "
                       "endpoint") from None
    except urllib.error.URLError as exc:
        raise NoAnswer(f"nothing answers at {address} ({_reason(exc.reason)})") from None
    except (TimeoutError, OSError) as exc:
        raise NoAnswer(f"nothing answers at {address} ({_reason(exc)})") from None
    except ValueError as exc:
        raise NoAnswer(f"{address} did not answer with a sidecar status ({exc})") from None
    if not isinstance(doc, dict):
        raise NoAnswer(f"{address} did not answer with a sidecar status (not an object)")
    return doc


def render(snap: StatusSnapshot, previous: StatusSnapshot | None, address: str,
           width: int = 80) -> list[str]:
    """The table as lines of text at most `width` wide, with rates when a previous snapshot is
    given."""
    elapsed = snap.taken_at - previous.taken_at if previous is not None else 0.0
    routes = {r.route: r for r in previous.routes} if previous is not None else {}
    sources = {(s.name, s.kind): s for s in previous.sources} if previous is not None else {}
    clock = datetime.fromtimestamp(snap.taken_at).strftime("%H:%M:%S")
    state = "offline (ENABLED=0): nothing is posted" if snap.offline else (
        "ready" if snap.ready else "not ready: the ingest has not accepted a request yet")
    lines = [
        *_wrap(width, f"sidecar {snap.mode}", f"run {snap.run_id or '-'}", f"node {snap.node}",
               f"up {_duration(snap.taken_at - snap.started_at)}", state,
               f"[{address} {clock}]"),
        *_wrap(width, f"lifecycle: {', '.join(snap.lifecycle_recorded) or '-'}",
               f" pending: {', '.join(snap.lifecycle_pending) or '-'}",
               *([f" hardware sample: {snap.sampler_duration_s:.2f} s"]
                 if snap.sampler_duration_s is not None else [])),
        "",
    ]
    lines += _table(
        ("ROUTE", "REQUESTS", "REQ/S", "ACCEPTED", "FAILED", "RETRIES", "DROPPED", "QUEUE",
         "SPOOL", "LAST OK"),
        [_route_row(route, routes.get(route.route), elapsed, snap.taken_at)
         for route in snap.routes], "no route has been used yet", left=(0,), width=width)
    lines += [wrapped for route in snap.routes if route.last_failure
              for wrapped in textwrap.wrap(f"{route.route} last error: {route.last_failure}",
                                           width, subsequent_indent="    ")]
    lines.append("")
    lines += _table(
        ("SOURCE", "KIND", "READ", "READ/S", "LINES", "LINES/S", "POINTS", "POINTS/S",
         "INVALID", "SKIPPED"),
        [_source_row(source, sources.get((source.name, source.kind)), elapsed)
         for source in snap.sources], "no source yet", left=(0, 1), width=width)
    if snap.matches:
        lines += ["", "MATCHED", *(wrapped for match in snap.matches for wrapped in textwrap.wrap(
            f"{match.source}: {_files(match.files)}" + (f" ({match.note})" if match.note else ""),
            width, initial_indent="  ", subsequent_indent="      "))]
    if snap.files:
        lines.append("")
        lines += _table(("FILE", "KIND", "OFFSET", "SIZE", "LAG", "LAST READ"),
                        [_file_row(file, snap.taken_at) for file in snap.files], "",
                        left=(0, 1), width=width)
    lines += _checkpoint_lines(snap, width)
    lines += _upload_lines(snap, width)
    lines += _time_lines(snap, width)
    return lines


def _time_lines(snap: StatusSnapshot, width: int) -> list[str]:
    """--time-window's latest window, a row a rank, then the verdicts holding."""
    shares = snap.time_shares
    if not shares:
        return []
    latest = shares.get("latest")
    if latest is None:
        why = shares.get("cannot") or f"the first {shares.get('window_s')}-s window is not over"
        return ["", *textwrap.wrap(f"TIME: nothing yet ({why})", width,
                                   subsequent_indent="    ")]
    lines = ["", f"TIME over the last {latest['window_s']} s (docs/time.md)"]
    lines += _table(
        ("RANK", "SAMPLES", "COMPUTE", "DATA", "COLLECTIVE", "CHECKPOINT", "WORKERS"),
        [(str(r["rank"]), str(r["samples"]),
          *(f"{100 * r['shares'][c]:.0f} %" for c in ("compute", "data", "collective",
                                                     "checkpoint")),
          f"{r['workers_count']} ({r['workers_cores']:.1f} cores)" if r["workers_count"]
          else "-") for r in latest["ranks"] if r["samples"]], "", left=(), width=width)
    lines += [wrapped for verdict in shares.get("verdicts", ())
              for wrapped in textwrap.wrap(verdict, width, initial_indent="  ",
                                           subsequent_indent="      ")]
    return lines


def _upload_lines(snap: StatusSnapshot, width: int) -> list[str]:
    """Each checkpoint upload under way: bytes sent of how many, files, rate, time left."""
    if not snap.uploads:
        return []
    lines = ["", "UPLOADS"]
    for up in snap.uploads:
        eta = "unknown" if up.eta_s is None else f"{up.eta_s:.0f} s"
        lines += textwrap.wrap(
            f"{up.path}: {up.bytes_sent:,} of {up.bytes:,} bytes, {up.files_stored} of "
            f"{up.files} files, {up.rate_bytes_per_s / 1e6:.1f} MB/s, {eta} left", width,
            initial_indent="  ", subsequent_indent="      ")
    return lines


def _checkpoint_lines(snap: StatusSnapshot, width: int) -> list[str]:
    """Each --checkpoints folder: how many registered, and each one waiting or skipped, why."""
    lines = []
    for folder in snap.checkpoints:
        counts = (f"{len(folder.registered)} registered, {len(folder.waiting)} waiting, "
                  f"{len(folder.skipped)} skipped" + (f", {folder.aliases} aliases"
                                                      if folder.aliases else "")
                  + (f", {folder.not_posted} not posted (no --artifact-uri in a container)"
                     if folder.not_posted else ""))
        lines += ["", *textwrap.wrap(f"CHECKPOINTS {folder.folder}: " + (
            folder.note or counts), width, subsequent_indent="    ")]
        for state, entries in (("waiting", folder.waiting), ("skipped", folder.skipped),
                               ("deleted", folder.deleted)):
            lines += [wrapped for path, why in entries for wrapped in textwrap.wrap(
                f"{state} {path}: {why}", width, initial_indent="  ",
                subsequent_indent="      ")]
    return lines


def _wrap(width: int, *pieces: str) -> list[str]:
    """Pieces joined by two spaces, onto as many lines of `width` as they need."""
    lines = [""]
    for piece in pieces:
        joined = f"{lines[-1]}  {piece}" if lines[-1] else piece
        if len(joined) <= width or not lines[-1]:
            lines[-1] = joined
        else:
            lines.append("  " + piece.strip())
    return lines


def _route_row(route: RouteSnapshot, before: RouteSnapshot | None, elapsed: float,
               now: float) -> list[str]:
    last_ok = "-" if route.last_success is None else f"{_duration(now - route.last_success)} ago"
    return [route.route, str(route.requests), _rate(route, before, "requests", elapsed),
            str(route.accepted), str(route.failures), str(route.retries), str(route.dropped),
            str(route.queue_depth), _bytes(route.spool_bytes), last_ok]


def _source_row(source: SourceSnapshot, before: SourceSnapshot | None,
                elapsed: float) -> list[str]:
    byte_rate = _rate(source, before, "bytes_read", elapsed, _bytes)
    return [source.name, source.kind, _bytes(source.bytes_read),
            byte_rate if byte_rate == "-" else byte_rate + "/s", str(source.lines_read),
            _rate(source, before, "lines_read", elapsed), str(source.points),
            _rate(source, before, "points", elapsed), str(source.invalid), str(source.skipped)]


def _file_row(file: FileSnapshot, now: float) -> list[str]:
    last = "-" if file.last_read is None else f"{_duration(now - file.last_read)} ago"
    return [file.path, file.kind, str(file.offset), str(file.size), _bytes(file.lag_bytes), last]


def _files(count: int) -> str:
    return f"{count} file" if count == 1 else f"{count} files"


def _rate(now: object, before: object | None, attr: str, elapsed: float,
          shown: Callable[[float], str] = lambda v: f"{v:.1f}") -> str:
    if before is None or elapsed <= 0:
        return "-"
    return shown(max(getattr(now, attr) - getattr(before, attr), 0) / elapsed)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], empty: str,
           left: Sequence[int], width: int) -> list[str]:
    """Columns padded to their widest cell: those in `left` left-aligned, the rest (numbers)
    right-aligned, two spaces apart. Wider than `width`: one space apart, then the first
    column's cells cut at their start (a path's end tells it apart) down to KEY_MIN_WIDTH, then
    the columns that still do not fit go on in another block of lines, led by the first column
    again."""
    if not rows:
        return [headers[0], f"  ({empty})"]
    if not _fits(headers, rows, width):
        headers = [SHORT_HEADERS.get(h, h) for h in headers]
        rows = [[row[0], *(_compact(cell) for cell in row[1:])] for row in rows]
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    gap = 2 if sum(widths) + 2 * (len(widths) - 1) <= width else 1
    excess = sum(widths) + gap * (len(widths) - 1) - width
    if excess > 0:
        widths[0] = max(widths[0] - excess, min(KEY_MIN_WIDTH, widths[0]), len(headers[0]))
        rows = [[_cut(row[0], widths[0]), *row[1:]] for row in rows]
    blocks: list[list[int]] = [[0]]
    for i in range(1, len(headers)):
        used = sum(widths[j] + gap for j in blocks[-1])
        if used + widths[i] > width and len(blocks[-1]) > 1:
            blocks.append([0])
        blocks[-1].append(i)

    def line(cells: Sequence[str], columns: Sequence[int]) -> str:
        return (" " * gap).join(
            cells[i].ljust(widths[i]) if i in left else cells[i].rjust(widths[i])
            for i in columns).rstrip()

    lines: list[str] = []
    for columns in blocks:
        lines += [*([""] if lines else []), line(headers, columns),
                  *(line(row, columns) for row in rows)]
    return lines


def _fits(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> bool:
    """Whether the table fits `width` in one block, one space apart, its first column cut."""
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    first = min(widths[0], max(KEY_MIN_WIDTH, len(headers[0])))
    return first + sum(widths[1:]) + len(widths) - 1 <= width


_SIZE = re.compile(r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB)(/s)?")
_COUNT = re.compile(r"\d+(?:\.\d+)?")


def _compact(cell: str) -> str:
    """A cell in at most about 5 characters: `123456` 123k, `117.7 MiB` 118M, `2h01m ago` 2h01m."""
    size = _SIZE.fullmatch(cell)
    if size is not None:
        return _short_number(float(size[1]), integer=size[2] == "B") + size[2][0]
    if _COUNT.fullmatch(cell):
        return _short_number(float(cell), integer="." not in cell)
    return cell.removesuffix(" ago")


def _short_number(value: float, *, integer: bool) -> str:
    if value < 100 and not integer:
        return f"{value:.1f}"
    if value < 100_000:
        return f"{value:.0f}"
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        scaled = value / scale
        if scaled < 999.5:
            return f"{scaled:.3g}{unit}"
    return f"{value / 1e12:.3g}T"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def _live(address: str, first: StatusSnapshot, out: TextIO) -> int:
    """Redraw every REFRESH_S until Ctrl-C (or SIGTERM/SIGHUP); keeps the last frame when the
    daemon stops answering, saying since when."""
    snap, previous, trouble = first, None, ""
    deadline = time.monotonic()
    with _screen(out):
        try:
            while True:
                _draw(out, render(snap, previous, address, shutil.get_terminal_size().columns),
                      trouble)
                deadline += REFRESH_S
                time.sleep(max(deadline - time.monotonic(), 0.0))
                try:
                    snap, previous, trouble = fetch(address), snap, ""
                except NoAnswer as exc:
                    clock = datetime.now().strftime("%H:%M:%S")
                    trouble = trouble or f"{exc} since {clock}; retrying (Ctrl-C to quit)"
        except KeyboardInterrupt:
            pass
    return EXIT_OK


def _draw(out: TextIO, lines: list[str], trouble: str) -> None:
    width, height = shutil.get_terminal_size()
    if trouble:
        lines = [f"\x1b[7m{trouble[:width]}\x1b[0m", *lines]
    if len(lines) > height - 1:
        lines = [*lines[:height - 2], f"... {len(lines) - height + 2} more lines"]
    out.write(HOME + "".join(line[:width] + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW)
    out.flush()


@contextmanager
def _screen(out: TextIO) -> Iterator[None]:
    """The alternate screen while drawing; SIGTERM and SIGHUP end it as Ctrl-C does."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    out.write(ENTER_SCREEN)
    try:
        yield
    finally:
        out.write(LEAVE_SCREEN)
        out.flush()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _configured(args: argparse.Namespace,
                environ: Mapping[str, str]) -> tuple[str, Path, str, str]:
    """The run meant (--run-id, else the platform's run id, else ""), the state dir, the
    configured --status-addr, resolved as `run` resolves them, and where the state dir came
    from (`--state-dir`, its variable, `file PATH`, `default`). The platform's run id is its
    variable's whenever one is set, the rest of the platform's variables there or not (a
    node's shell with STARFORGE_RUN_ID alone, an offline run's ENABLED=0)."""
    named = args.run_id or next(
        (environ[f.run_id].strip() for f in FAMILIES if environ.get(f.run_id, "").strip()), "")
    origins: dict[str, str] = {}
    try:
        cfg = resolve(args, "status", environ, origins)
        return (named, cfg.state_dir, cfg.status_addr, origins.get("state-dir", "default"))
    except ConfigError:
        pass
    # A shell without the platform's variables (a node's login shell): resolve the options only.
    platform = {name for f in FAMILIES for name in (f.enabled, f.endpoint, f.run_id, f.token)}
    offline = {k: v for k, v in environ.items() if k not in platform}
    offline[FAMILIES[0].enabled] = "0"
    cfg = resolve(args, "status", offline, origins)  # a mistake in the options themselves is said
    return named, cfg.state_dir, cfg.status_addr, origins.get("state-dir", "default")


def _read_addr(path: Path) -> str:
    """The address a daemon wrote; "" when the file is gone or malformed (set aside)."""
    return load_checked(path, _parse_addr) or ""


def _parse_addr(data: bytes) -> str:
    addr = data.decode("ascii").strip()
    try:
        parse_host_port(addr, str(STATUS_ADDR_FILE))
    except ConfigError:
        raise Malformed(f"{addr!r:.40} is not HOST:PORT") from None
    return addr


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _reason(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    if isinstance(reason, TimeoutError):
        return "timed out"
    return str(reason)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _bytes(size: float) -> str:
    if size < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


def main(args: argparse.Namespace) -> int:
    """`sidecar status`."""
    from sidecar.config import warn_unknown_variables
    from sidecar.log import setup

    setup()
    warn_unknown_variables()
    return status_command(args)
