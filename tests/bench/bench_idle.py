"""Benchmark (not a test): what an idle `sidecar watch` costs: CPU share of one core and memory.

    python tests/bench/bench_idle.py [--quick] [--seconds 60]

`sidecar watch` follows three quiet sources (a log file, a JSONL file and a TensorBoard folder,
each holding a little data that is delivered at the start and then never grows) and samples the
hardware every 10 s, reporting to a receiver that answers at once; its status endpoint is on (as
by default, on an ephemeral port). Once its start-up is over (the environment snapshot arrived
and the sources were read), its CPU time over 60 s (15 s with --quick) is read from the
scheduler's nanosecond account of every thread (/proc/PID/task/*/schedstat; psutil's
tick-sampled user+system time is printed too, and overstates timer-driven wake-ups), and its
resident memory (RSS, and USS: the pages only it holds) once a second; the largest is reported.

Targets: under 0.1 % of one core (issue 8), at most 36 MB RSS (issue 17; issue 8: under 45).
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
from pathlib import Path

import google_crc32c
import psutil
from _harness import (
    Row,
    bench_arguments,
    cpu_seconds,
    finish,
    info_row,
    limit_row,
    parse,
    profiled,
    receiver,
    show_warnings,
    sidecar_env,
    start_sidecar,
    stop,
    thread_cpu,
    thread_names,
    wait_quiet,
    wait_until_posted,
)

BENCH = "idle cost"
HARDWARE_INTERVAL_S = "10"
TARGET_CPU_PERCENT = 0.1
TARGET_RSS_MB = 36.0


def _masked_crc(data: bytes) -> int:
    crc = int(google_crc32c.value(data))
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", _masked_crc(header)) + data
            + struct.pack("<I", _masked_crc(data)))


def _scalar_event(tag: str, step: int, value: float) -> bytes:
    """An Event{wall_time, step, summary{value{tag, simple_value}}} in protobuf wire format."""
    tag_bytes = tag.encode()
    summary_value = b"\x0a" + bytes([len(tag_bytes)]) + tag_bytes + b"\x15" + struct.pack(
        "<f", value)
    summary = b"\x0a" + bytes([len(summary_value)]) + summary_value
    return (b"\x09" + struct.pack("<d", 1.7e9 + step) + b"\x10" + bytes([step])
            + b"\x2a" + bytes([len(summary)]) + summary)


def write_sources(work: Path) -> tuple[Path, Path, Path]:
    log, jsonl, tensorboard = work / "train.log", work / "metrics.jsonl", work / "tb"
    log.write_text("".join(f"epoch 0 step {i} loss {1 / (i + 1):.4f}\n" for i in range(100)))
    jsonl.write_text("".join(json.dumps({"step": i, "loss": 1 / (i + 1)}) + "\n"
                             for i in range(100)))
    (tensorboard / "train").mkdir(parents=True)
    version = b"\x09" + struct.pack("<d", 1.7e9) + b"\x1a\x0dbrain.Event:2"
    events = [version] + [_scalar_event("loss", i, 1 / (i + 1)) for i in range(100)]
    (tensorboard / "train" / "events.out.tfevents.1700000000.bench").write_bytes(
        b"".join(_record(e) for e in events))
    return log, jsonl, tensorboard


def measure(seconds: float, profile: Path | None) -> list[Row]:
    with receiver("count") as rec, tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        work = Path(tmp)
        log, jsonl, tensorboard = write_sources(work)
        env = sidecar_env(rec.endpoint, work / "state", hardware_interval=HARDWARE_INTERVAL_S,
                          status_addr="127.0.0.1:0")
        proc = start_sidecar(["watch", "--log", str(log), "--jsonl", str(jsonl),
                              "--tensorboard", str(tensorboard)], env, work)
        try:
            wait_until_posted(rec, "/environment")
            rec.wait_for(lambda s: {"/logs", "/metrics"} <= set(s["routes"]), 10)
            ps = psutil.Process(proc.pid)
            wait_quiet(ps)  # its start-up work is over
            rss = uss = 0
            names = thread_names(proc.pid)
            with profiled(proc.pid, profile, "idle"):
                threads0, started = thread_cpu(proc.pid), time.monotonic()
                ticks0 = cpu_seconds(ps)
                while time.monotonic() - started < seconds:
                    time.sleep(1.0)
                    memory = ps.memory_full_info()
                    rss, uss = max(rss, memory.rss), max(uss, memory.uss)
                threads, wall_s = thread_cpu(proc.pid), time.monotonic() - started
                ticks_s = cpu_seconds(ps) - ticks0
            routes = rec.stats()["routes"]
        finally:
            stop(proc)
            show_warnings(work)
    cpu_s = sum(t - threads0.get(tid, 0.0) for tid, t in threads.items())
    percent = 100 * cpu_s / wall_s
    print(f"  {cpu_s:.4f} CPU-s in {wall_s:.1f} s = {percent:.3f} % of a core (tick-sampled "
          f"user+system: {100 * ticks_s / wall_s:.3f} %); largest RSS {rss / 1e6:.1f} MB, "
          f"USS {uss / 1e6:.1f} MB; posts: {routes}")
    for tid, total in sorted(threads.items(), key=lambda t: threads0.get(t[0], 0) - t[1]):
        used = total - threads0.get(tid, 0)
        print(f"    thread {names.get(tid, tid)!s:24} {used:7.4f} CPU-s "
              f"({100 * used / wall_s:.3f} % of a core)")
    return [
        limit_row(BENCH, f"CPU over {wall_s:.0f} s, 3 quiet sources, 10 s sampling", percent,
                  "% of a core", "<", TARGET_CPU_PERCENT),
        limit_row(BENCH, "largest RSS", rss / 1e6, "MB", "<=", TARGET_RSS_MB),
        info_row(BENCH, "largest USS (pages only it holds)", uss / 1e6, "MB"),
    ]


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--seconds", type=float, help="how long to measure (60, quick 15)")
    args = parse(options)
    seconds = args.seconds or (15.0 if args.quick else 60.0)
    finish(measure(seconds, args.profile), args.json)


if __name__ == "__main__":
    main()
