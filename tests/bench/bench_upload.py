"""Benchmark (not a test): a checkpoint uploaded beside a trainer (docs/checkpoints.md#uploads).

    python tests/bench/bench_upload.py [--quick] [--size-mib 4096] [--rate 100000000]

A checkpoint of 8 files (4 GiB in all; 512 MiB with --quick) is saved into a `--checkpoints`
folder beside a stand-in trainer that prints a line and writes a JSONL record every step, each
step a fixed piece of CPU work; `sidecar watch --checkpoint-upload always --upload-rate RATE`
uploads it through the checking ingest's signed URLs to an S3 server on loopback (moto's server
mode; tests/ingest_server.py's S3Store). Measured: the upload's MB/s against the cap, the
sidecar's CPU-seconds per GB uploaded (all its threads), and the trainer's mean step time while
the upload runs against the same trainer's before it started (same run).

Targets: MB/s within 10 % under the cap (and at most 5 % over it); trainer step time while
uploading <= 1.05x the time without. moto is a Python server: on a small machine it, not the
cap, may bound the rate; the table then says so.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests.ingest_server

from _harness import (
    Row,
    bench_arguments,
    finish,
    info_row,
    limit_row,
    parse,
    sidecar_env,
    start_sidecar,
    stop,
    thread_cpu,
)

from tests.ingest_server import S3Store, running_ingest

BENCH = "checkpoint upload"
FILES = 8
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
        print(f"step {step} loss {total % 97}", flush=True)
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


def main() -> None:
    options = bench_arguments(__doc__ or "")
    options.add_argument("--size-mib", type=int, default=4096)
    options.add_argument("--rate", type=int, default=100_000_000, help="--upload-rate")
    args = parse(options)
    size_mib = 512 if args.quick else args.size_mib
    s3 = S3Store()
    with tempfile.TemporaryDirectory(prefix="bench-upload-") as scratch:
        work = Path(scratch)
        folder = work / "ckpt"
        folder.mkdir()
        with running_ingest(work / "received", signer=s3.sign) as ingest:
            env = sidecar_env(ingest.base_url, work / "state")
            proc = start_sidecar(["watch", "--checkpoints", str(folder), "--checkpoint-upload",
                                  "always", "--upload-rate", str(args.rate)], env, work)
            trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(work / "m.jsonl"),
                                        str(work / "steps")], stdout=subprocess.DEVNULL)
            try:
                time.sleep(10)  # the trainer's steps without an upload
                quiet_end = time.time()
                staging = work / "writing"
                staging.mkdir()
                for i in range(FILES):  # an 8-shard save (not safetensors: no header needed)
                    with open(staging / f"__{i}_0.distcp", "wb") as fh:
                        for _ in range(size_mib // FILES):
                            fh.write(os.urandom(1 << 20))
                (staging / ".metadata").write_bytes(b"dcp")
                os.rename(staging, folder / "step-100")
                cpu_before = sum(thread_cpu(proc.pid).values())
                store_before = time.process_time()  # moto and the ingest: this process
                while not ingest.records("artifact/upload-url"):
                    time.sleep(0.05)
                began = time.time()
                while not ingest.records("artifact"):
                    time.sleep(0.05)
                ended = time.time()
                cpu_s = sum(thread_cpu(proc.pid).values()) - cpu_before
                store_cpu_s = time.process_time() - store_before
            finally:
                trainer.kill()
                trainer.wait()
                stop(proc)
            total = size_mib << 20
            stored = [key for key in s3.object_keys() if key.endswith(".distcp")]
            assert len(stored) == FILES and all(
                len(s3.read(f"s3://{S3Store.BUCKET}/{key}")) == total // FILES for key in stored)
            without = statistics.mean(_steps(work / "steps", quiet_end - 8, quiet_end))
            during = statistics.mean(_steps(work / "steps", began, ended))
    s3.stop()
    rate_mb = total / (ended - began) / 1e6
    cap_mb = args.rate / 1e6
    rows: list[Row] = [
        info_row(BENCH, f"{size_mib} MiB in {FILES} files: MB/s", rate_mb, "MB/s",
                 cap_mb or None, "the cap"),
        info_row(BENCH, "sidecar CPU-s per GB uploaded", cpu_s / (total / 1e9), "CPU-s/GB"),
        # on the same cores as the trainer: what the step time ratio also pays for
        info_row(BENCH, "S3 server (moto) CPU-s per GB", store_cpu_s / (total / 1e9),
                 "CPU-s/GB"),
        info_row(BENCH, "trainer step while uploading", during * 1e3, "ms", without * 1e3,
                 "without"),
        limit_row(BENCH, "trainer step ratio", during / without, "x", "<=", 1.05),
    ]
    if cap_mb:
        rows.append(limit_row(BENCH, "MB/s over the cap", rate_mb / cap_mb, "x", "<=", 1.05))
    finish(rows, args.json)


if __name__ == "__main__":
    main()
