"""Benchmark (not a test): a checkpoint uploaded beside a trainer (docs/checkpoints.md#uploads).

    python tests/bench/bench_upload.py [--quick] [--size-mib 4096] [--rate 100000000]

A stand-in trainer prints a line and writes a JSONL record every step, each step a fixed piece
of CPU work, under `sidecar run --jsonl ... --checkpoints DIR --checkpoint-upload always
--upload-rate RATE` (its prints go through the sidecar's pipes, its records to /metrics). A
checkpoint of 8 files (4 GiB in all; 512 MiB with --quick) is saved into DIR and uploaded
through the checking ingest's signed URLs to an S3 server on loopback (moto's server mode;
tests/ingest_server.py's S3Store). Measured: the upload's MB/s against the cap, the sidecar's
CPU-seconds per GB uploaded (the whole process, its exited threads too), and the trainer's mean
step time while the upload runs against the same trainer's in the 10 s before the save and the
10 s after the upload (same run: a drift of the machine's load is in both).

The S3 server stands for a store across the network, whose CPU is not the node's: it runs in
this process, whose threads are set to nice 19 once the sidecar and trainer are started, so that
on a small machine it takes only CPU they leave (on 2 cores it may then, not the cap, bound the
rate; the table says so). The sidecar itself runs at its normal priority.

--loaders N starts N busy processes beside the trainer, as its data loaders would be: with as
many as there are cores, no core is idle, and what the upload takes is the trainer's.

Targets: MB/s within 10 % under the cap (and at most 5 % over it); trainer step time while
uploading <= 1.05x the time without.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests.ingest_server

import psutil
from _harness import (
    SIDECAR,
    Row,
    bench_arguments,
    finish,
    info_row,
    limit_row,
    parse,
    show_warnings,
    sidecar_env,
    stop,
)

from tests.ingest_server import S3Store, running_ingest

BENCH = "checkpoint upload"
FILES = 8
LOADER = "while True: sum(i * i for i in range(100_000))"  # a data loader's CPU, at nice 0
QUIET_S = 10.0  # the trainer measured without an upload, before the save and after it
TRAINER = r"""
import json, sys, time
out, steps = sys.argv[1], sys.argv[2]
with open(out, "a") as log, open(steps, "w") as times:
    step = 0
    while True:
        started = time.perf_counter()
        total = 0
        for i in range(200_000):  # a fixed piece of CPU work: the step
            total += i * i
        print(f"step {step} loss {total % 97}", flush=True)  # through the sidecar
        log.write(json.dumps({"step": step, "loss": total % 97}) + "\n")
        log.flush()
        times.write(f"{time.time()} {time.perf_counter() - started}\n")
        times.flush()
        step += 1
"""


def _steps(path: Path, start: float, end: float) -> list[float]:
    result = []
    for line in path.read_text().splitlines():
        at, took = line.split()
        if start <= float(at) <= end:
            result.append(float(took))
    return result


def _nice_this_process() -> None:
    """Every thread of this process (the S3 server, the ingest) to nice 19: a remote store's
    CPU is not the node's. Threads started later inherit it from these."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)


def _cpu_s(pid: int) -> float:
    """The process's CPU seconds, its exited threads included (each file is sent by a thread
    of its own)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def main() -> None:
    options = bench_arguments(__doc__ or "")
    options.add_argument("--size-mib", type=int, default=4096)
    options.add_argument("--rate", type=int, default=100_000_000, help="--upload-rate")
    options.add_argument("--loaders", type=int, default=0,
                         help="busy processes beside the trainer (its data loaders): with one "
                              "a core, the upload has no idle core to take")
    args = parse(options)
    size_mib = 512 if args.quick else args.size_mib
    s3 = S3Store()
    with tempfile.TemporaryDirectory(prefix="bench-upload-") as scratch:
        work = Path(scratch)
        folder = work / "ckpt"
        folder.mkdir()
        with running_ingest(work / "received", signer=s3.sign) as ingest:
            env = sidecar_env(ingest.base_url, work / "state")
            with (work / "sidecar.log").open("ab") as messages:
                proc = subprocess.Popen(
                    [*SIDECAR, "run", "--jsonl", str(work / "m.jsonl"), "--checkpoints",
                     str(folder), "--checkpoint-upload", "always", "--upload-rate",
                     str(args.rate), "--", sys.executable, "-c", TRAINER,
                     str(work / "m.jsonl"), str(work / "steps")],
                    env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=messages)
            loaders = [subprocess.Popen([sys.executable, "-c", LOADER])
                       for _ in range(args.loaders)]
            _nice_this_process()
            try:
                time.sleep(5 + QUIET_S)  # the trainer's steps without an upload, after its start
                quiet_end = time.time()
                staging = work / "writing"
                staging.mkdir()
                for i in range(FILES):  # an 8-shard save (not safetensors: no header needed)
                    with open(staging / f"__{i}_0.distcp", "wb") as fh:
                        for _ in range(size_mib // FILES):
                            fh.write(os.urandom(1 << 20))
                (staging / ".metadata").write_bytes(b"dcp")
                os.rename(staging, folder / "step-100")
                cpu_before = _cpu_s(proc.pid)
                store_before = time.process_time()  # moto and the ingest: this process
                while not ingest.records("artifact/upload-url"):
                    time.sleep(0.05)
                began = time.time()
                while not ingest.records("artifact"):
                    time.sleep(0.05)
                ended = time.time()
                cpu_s = _cpu_s(proc.pid) - cpu_before
                store_cpu_s = time.process_time() - store_before
                time.sleep(QUIET_S)  # and after it: the machine's drift is in both
            finally:
                stop(proc)
                for loader in loaders:
                    loader.kill()
                    loader.wait()
            show_warnings(work)
            total = size_mib << 20
            stored = [key for key in s3.object_keys() if key.endswith(".distcp")]
            assert len(stored) == FILES and all(
                len(s3.read(f"s3://{S3Store.BUCKET}/{key}")) == total // FILES for key in stored)
            points = sum(len(r["points"]) for r in ingest.records("metrics"))
            without = statistics.mean(_steps(work / "steps", quiet_end - QUIET_S, quiet_end)
                                      + _steps(work / "steps", ended + 1, ended + QUIET_S))
            during = statistics.mean(_steps(work / "steps", began, ended))
    s3.stop()
    rate_mb = total / (ended - began) / 1e6
    cap_mb = args.rate / 1e6
    rows: list[Row] = [
        info_row(BENCH, f"{size_mib} MiB in {FILES} files: MB/s", rate_mb, "MB/s",
                 cap_mb or None, "the cap"),
        info_row(BENCH, "sidecar CPU-s per GB uploaded", cpu_s / (total / 1e9), "CPU-s/GB"),
        # at nice 19 on the same cores: what it takes is what the trainer left
        info_row(BENCH, "S3 server (moto) CPU-s per GB", store_cpu_s / (total / 1e9),
                 "CPU-s/GB"),
        info_row(BENCH, "trainer's JSONL points received", points, "points"),
        info_row(BENCH, "trainer step while uploading", during * 1e3, "ms", without * 1e3,
                 "without"),
        limit_row(BENCH, "trainer step ratio", during / without, "x", "<=", 1.05),
    ]
    if cap_mb:
        rows.append(limit_row(BENCH, "MB/s over the cap", rate_mb / cap_mb, "x", "<=", 1.05))
    finish(rows, args.json)


if __name__ == "__main__":
    main()
