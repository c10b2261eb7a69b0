"""Benchmark (not a test): log throughput of `sidecar watch --log FILE` against Fluent Bit and the
floor loop, on the same file and the same receiver in one run.

    python tests/bench/bench_throughput.py [--quick] [--lines N] [--line-bytes B ...] [--repeat N]
                                           [--letter L] [--against REF]

A file of N lines of B bytes of random text (default 2,000,000 of 100 B, then 200,000 of 1 KiB,
then 200,000 of 1 KiB whose text is one repeated letter, `x`: with a token holding an `8`, a line
of `x`s was CPython's substring search's slow case, when masking used it) is forwarded from its
start to a counting receiver on loopback (_receiver.py, its own process), each run until the
receiver counted every line:
- by the floor loop (_floor.py: 1 MiB blocks cut at the last newline, one chunk a POST encoded
  with orjson, aiohttp, one kept-alive connection);
- by Fluent Bit 5.1.1, the C forwarder operators run today (shared/anchors/fluent-bit beside
  the checkout, with the configuration of its README; skipped with a line saying why where it
  is missing or cannot start);
- by `sidecar watch`, once with each of TOKENS (masking is on the path; its cost must not depend
  on the token's letters).
The clock and the CPU reading start when the work can start: for the floor when it is told to
go; for Fluent Bit when it is started, the file already there (its start-up, a few milliseconds
of C, is counted); for the sidecar when the file appears under the name it follows (hard-linked
there once the sidecar had started and gone quiet, so that its start-up is not counted; it then
reads the file from its start). CPU is the process's user + system time, all threads.
Every run reads the file from the page cache: it is read through once, unmeasured, right before
each run. Fluent Bit's tail drops what it read from the cache (posix_fadvise DONTNEED: its
File_Cache_Advise, on by default), so without that the run after it read the file from disk:
the sidecar right after Fluent Bit measured up to twice the CPU-s/GB of the next one, all of
it system time, whichever its token. With --repeat N the runs alternate N times and the median
run of each is reported.

With --against REF the package as it was at REF (`git archive`) and this one forward the same
warm file alternately, --repeat times each (8 if not given), one token a pair and the two in
turn, with no floor or Fluent Bit: the medians of their seconds and CPU-seconds, side by side
(shown, no target): whether a change kept the bulk path's speed.

Targets (issue 17), against Fluent Bit: at 100 B lines at least 2.5x its lines/s at no more than
0.4x its CPU-s/GB; at 1 KiB lines at least 2x its lines/s at no more than its CPU-s/GB; at 1 KiB
lines of a repeated letter (issue 25) at least 2x its lines/s with either token. The floor's
figures are shown beside them.
"""

from __future__ import annotations

import base64
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _harness import (
    HERE,
    RUN_ID,
    TOKEN,
    Receiver,
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    fluent_bit,
    info_row,
    limit_row,
    parse,
    profiled,
    ratio_row,
    receiver,
    show_warnings,
    sidecar_env,
    start_sidecar,
    stop,
    wait_quiet,
    wait_until_posted,
)
from bench_startup import baseline_package

BENCH = "log throughput"
TIMEOUT_S = 300.0
STALL_S = 10.0  # no new line for this long: what is missing is not coming
LETTER = "x"  # the one repeated letter of the third file
SIZES = ((2_000_000, 100, ""), (200_000, 1024, ""), (200_000, 1024, LETTER))
QUICK_SIZES = ((500_000, 100, ""), (50_000, 1024, ""), (50_000, 1024, LETTER))
TOKENS = ("tok-bench-0123456789", "tok-3f9c2a7e51b08d46")  # issue 17: the first one made
#   CPython's substring search (masking) three times slower than the second
# line bytes -> (lines/s at least, CPU-s/GB at most), as multiples of Fluent Bit's
TARGETS = {100: (2.5, 0.4), 1024: (2.0, 1.0)}
LETTER_TARGET = 2.0  # lines/s, as a multiple of Fluent Bit's, on lines of a repeated letter
FLUENT_BIT_CONFIG = """\
[SERVICE]
    Flush        0.2
    Grace        1
    Log_Level    warn
    storage.path {dir}/storage
[INPUT]
    Name              tail
    Path              {path}
    Read_from_Head    true
    DB                {dir}/tail.db
    Buffer_Chunk_Size 256k
    Buffer_Max_Size   256k
    Mem_Buf_Limit     64M
[OUTPUT]
    Name         http
    Match        *
    Host         127.0.0.1
    Port         {port}
    URI          /api/ingest/logs
    Format       json
    Workers      2
    Retry_Limit  no_limits
"""


def write_log(path: Path, lines: int, line_bytes: int, seed: int = 17, letter: str = "") -> None:
    """`lines` lines of exactly `line_bytes` bytes (newline included), numbered, each ending in
    random words (letters, digits, `+`, `.`: no quote, backslash or control character), or in
    `letter` repeated."""
    head = b"2025-01-01T00:00:00.000Z INFO train step=%09d loss=0.4321 "
    pad = line_bytes - len(head % 0) - 1
    rng = random.Random(seed)
    spaces = bytes.maketrans(b"/=", b" .")
    with path.open("wb") as f:
        for start in range(0, lines, 100_000):
            count = min(start + 100_000, lines) - start
            noise = letter.encode() * (pad * count) if letter else \
                base64.b64encode(rng.randbytes(pad * count * 3 // 4 + 3)).translate(spaces)
            f.write(b"".join(head % (start + i) + noise[i * pad:(i + 1) * pad] + b"\n"
                             for i in range(count)))


def cache(path: Path) -> None:
    """Read the file through once, so that the next run reads it from the page cache (Fluent
    Bit's tail drops the pages it read)."""
    with path.open("rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


class Measured:
    """Rates over what arrived: lines counted by the receiver, their share of the file's bytes."""

    def __init__(self, lines: int, arrived: int, size: int, wall_s: float, cpu_s: float) -> None:
        self.lines, self.arrived = lines, arrived
        self.lines_per_s = arrived / wall_s
        self.mb_per_s = size * arrived / lines / 1e6 / wall_s
        self.cpu_s_per_gb = cpu_s / (size * arrived / lines / 1e9)
        self.wall_s, self.cpu_s = wall_s, cpu_s

    def __str__(self) -> str:
        missing = "" if self.arrived == self.lines else \
            f"  ONLY {self.arrived:,} OF {self.lines:,} LINES ARRIVED"
        return (f"{self.lines_per_s:12,.0f} lines/s {self.mb_per_s:7.1f} MB/s  "
                f"{self.cpu_s_per_gb:6.2f} CPU-s/GB  ({self.wall_s:.2f} s, {self.cpu_s:.2f} CPU-s)"
                + missing)


def _until_counted(rec: Receiver, lines: int, started_at: float) -> tuple[int, float]:
    """(lines arrived, seconds to the last arrival): all of them, or what came before a stall."""
    deadline = time.monotonic() + TIMEOUT_S
    seen, seen_at = -1, time.monotonic()
    while True:
        stats = rec.stats()
        if stats["lines"] >= lines or time.monotonic() > deadline or \
                time.monotonic() - seen_at > STALL_S:
            break
        if stats["lines"] != seen:
            seen, seen_at = stats["lines"], time.monotonic()
        time.sleep(0.01)
    if not stats["lines"]:
        raise RuntimeError(f"no line arrived in {time.monotonic() - seen_at:.0f} s")
    return stats["lines"], float(stats["last_log_at"]) - started_at


def floor(path: Path, lines: int) -> Measured:
    with receiver("count") as rec:
        proc = subprocess.Popen([sys.executable, str(HERE / "_floor.py"), str(path),
                                 rec.endpoint, TOKEN, RUN_ID],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the floor loop did not start")
            ps = psutil.Process(proc.pid)
            cpu0, started_at = cpu_seconds(ps), time.time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            arrived, wall_s = _until_counted(rec, lines, started_at)
            cpu_s = cpu_seconds(ps) - cpu0
        finally:
            proc.stdin.close()
            proc.wait(30)
    return Measured(lines, arrived, path.stat().st_size, wall_s, cpu_s)


def fluent_bit_unavailable() -> str | None:
    """Why Fluent Bit cannot be run here, or None when it can."""
    binary = fluent_bit()
    if binary is None:
        return "no shared/anchors/fluent-bit/fluent-bit beside the checkout or above it"
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} does not start: {exc}"
    if done.returncode != 0:
        return f"{binary} --version exited {done.returncode}: {done.stderr.strip()[:200]}"
    return None


def fluent_bit_run(path: Path, lines: int, work: Path) -> Measured:
    """Fluent Bit tailing the file from its head into the counting receiver."""
    binary = fluent_bit()
    assert binary is not None
    with receiver("count") as rec, tempfile.TemporaryDirectory(dir=work) as state:
        config = Path(state) / "fluent-bit.conf"
        config.write_text(FLUENT_BIT_CONFIG.format(dir=state, path=path, port=rec.port))
        with (Path(state) / "fluent-bit.log").open("wb") as messages:
            started_at = time.time()
            proc = subprocess.Popen([str(binary), "-c", str(config)], stdout=messages,
                                    stderr=subprocess.STDOUT)
        try:
            ps = psutil.Process(proc.pid)
            arrived, wall_s = _until_counted(rec, lines, started_at)
            cpu_s = cpu_seconds(ps)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return Measured(lines, arrived, path.stat().st_size, wall_s, cpu_s)


def sidecar(path: Path, lines: int, work: Path, token: str, profile: Path | None,
            name: str, package_root: Path | None = None) -> Measured:
    """`sidecar watch` forwarding the file; `package_root`: another copy of the package."""
    size = path.stat().st_size
    followed = work / "logs" / "train.log"
    followed.parent.mkdir(exist_ok=True)
    with receiver("count") as rec, tempfile.TemporaryDirectory(dir=work) as state:
        env = sidecar_env(rec.endpoint, Path(state), token)
        if package_root is not None:
            env["PYTHONPATH"] = str(package_root)
        proc = start_sidecar(["watch", "--log", str(followed)], env, work)
        try:
            wait_until_posted(rec, "/environment")
            ps = psutil.Process(proc.pid)
            wait_quiet(ps)
            with profiled(proc.pid, profile, name):
                cpu0, started_at = cpu_seconds(ps), time.time()
                os.link(path, followed)  # appears at once, whole, under the followed name
                arrived, wall_s = _until_counted(rec, lines, started_at)
                cpu_s = cpu_seconds(ps) - cpu0
        finally:
            stop(proc)
            followed.unlink(missing_ok=True)
            show_warnings(work)
            (work / "sidecar.log").unlink(missing_ok=True)
    return Measured(lines, arrived, size, wall_s, cpu_s)


def measure(lines: int, line_bytes: int, profile: Path | None, repeat: int,
            letter: str = "") -> list[Row]:
    label = _label(line_bytes, letter)
    skipped = fluent_bit_unavailable()
    floors: list[Measured] = []
    anchors: list[Measured] = []
    ours: dict[str, list[Measured]] = {token: [] for token in TOKENS}
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        work = Path(tmp)
        path = work / "input.log"
        write_log(path, lines, line_bytes, letter=letter)
        print(f"{label}: {lines:,} lines, {path.stat().st_size / 1e6:.0f} MB")
        if skipped:
            print(f"  Fluent Bit:     SKIPPED: {skipped}")
        for _ in range(repeat):  # alternated, so that a slow spell of the machine hits all
            cache(path)
            floors.append(floor(path, lines))
            print(f"  floor loop:     {floors[-1]}")
            if not skipped:
                cache(path)
                anchors.append(fluent_bit_run(path, lines, work))
                print(f"  Fluent Bit:     {anchors[-1]}")
            for token in TOKENS:
                name = f"throughput-{line_bytes}{letter}-token{TOKENS.index(token) + 1}"
                cache(path)
                ours[token].append(sidecar(path, lines, work, token, profile, name))
                print(f"  sidecar watch, token {token}:  {ours[token][-1]}")
    base = _median(floors)
    anchor = _median(anchors) if anchors else None
    more_lines, less_cpu = TARGETS.get(line_bytes, TARGETS[1024])
    rows: list[Row] = []
    if anchor is not None:
        rows += [info_row(BENCH, f"{label}: Fluent Bit lines/s", anchor.lines_per_s, "lines/s",
                          base.lines_per_s, "floor"),
                 info_row(BENCH, f"{label}: Fluent Bit CPU-s/GB", anchor.cpu_s_per_gb,
                          "CPU-s/GB", base.cpu_s_per_gb, "floor")]
    for token in TOKENS:
        run = _median(ours[token])
        what = f"{label}, token {token}"
        rows.append(limit_row(BENCH, f"{what}: share of lines delivered",
                              100 * run.arrived / lines, "%", ">=", 100.0))
        if anchor is not None and letter:
            rows += [ratio_row(BENCH, f"{what}: lines/s", run.lines_per_s, anchor.lines_per_s,
                               "lines/s", "Fluent Bit", ">=", LETTER_TARGET),
                     info_row(BENCH, f"{what}: CPU-s/GB", run.cpu_s_per_gb, "CPU-s/GB",
                              anchor.cpu_s_per_gb, "Fluent Bit")]
        elif anchor is not None:
            rows += [ratio_row(BENCH, f"{what}: lines/s", run.lines_per_s, anchor.lines_per_s,
                               "lines/s", "Fluent Bit", ">=", more_lines),
                     ratio_row(BENCH, f"{what}: CPU-s/GB", run.cpu_s_per_gb,
                               anchor.cpu_s_per_gb, "CPU-s/GB", "Fluent Bit", "<=", less_cpu)]
        rows += [info_row(BENCH, f"{what}: lines/s", run.lines_per_s, "lines/s",
                          base.lines_per_s, "floor"),
                 info_row(BENCH, f"{what}: CPU-s/GB", run.cpu_s_per_gb, "CPU-s/GB",
                          base.cpu_s_per_gb, "floor")]
    return rows


def against(lines: int, line_bytes: int, letter: str, ref: str, repeat: int) -> list[Row]:
    """This package and the one at `ref`, alternately on one warm file: medians, side by side."""
    label = _label(line_bytes, letter)
    runs: dict[str, list[Measured]] = {"this": [], ref: []}
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        work = Path(tmp)
        baseline = work / "baseline"
        baseline.mkdir()
        baseline_package(ref, baseline)
        path = work / "input.log"
        write_log(path, lines, line_bytes, letter=letter)
        print(f"{label}: {lines:,} lines, {path.stat().st_size / 1e6:.0f} MB, this package "
              f"against {ref}")
        for round_ in range(repeat):
            token = TOKENS[round_ // 2 % len(TOKENS)]
            pair: list[tuple[str, Path | None]] = [("this", None), (ref, baseline)]
            for who, root in pair[::-1] if round_ % 2 else pair:
                cache(path)
                runs[who].append(sidecar(path, lines, work, token, None, "", root))
                print(f"  {who:>12}, token {token}:  {runs[who][-1]}")
    rows: list[Row] = []
    ours, theirs = (statistics.median(m.wall_s for m in runs[who]) for who in ("this", ref))
    rows.append(info_row(BENCH, f"{label}: seconds, median", ours, "s", theirs, ref))
    ours, theirs = (statistics.median(m.cpu_s for m in runs[who]) for who in ("this", ref))
    rows.append(info_row(BENCH, f"{label}: CPU-seconds, median", ours, "CPU-s", theirs, ref))
    return rows


def _label(line_bytes: int, letter: str) -> str:
    label = f"{line_bytes} B lines" if line_bytes < 1024 else f"{line_bytes // 1024} KiB lines"
    return label + (f" of {letter!r} repeated" if letter else "")


def _median(runs: list[Measured]) -> Measured:
    """The run with the median lines/s (its other figures with it)."""
    return sorted(runs, key=lambda m: m.lines_per_s)[(len(runs) - 1) // 2]


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--lines", type=int, help="lines in the file (one size only)")
    options.add_argument("--line-bytes", type=int, help="bytes a line, newline included")
    options.add_argument("--repeat", type=int, help="runs of each (median; 1, or 8 with "
                         "--against)")
    options.add_argument("--against", metavar="REF",
                         help="compare with the package at this commit instead")
    options.add_argument("--letter", help="lines of this letter repeated (one size only)")
    args = parse(options)
    sizes: tuple[tuple[int, int, str], ...] = QUICK_SIZES if args.quick else SIZES
    if args.lines or args.line_bytes or args.letter:
        sizes = ((args.lines or sizes[0][0], args.line_bytes or 100, args.letter or ""),)
    rows: list[Row] = []
    for lines, line_bytes, letter in sizes:
        if args.against:
            rows += against(lines, line_bytes, letter, args.against, args.repeat or 8)
        else:
            rows += measure(lines, line_bytes, args.profile, args.repeat or 1, letter)
    finish(rows, args.json)


if __name__ == "__main__":
    main()
