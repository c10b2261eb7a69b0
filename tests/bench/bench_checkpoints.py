"""Benchmark (not a test): what `--checkpoints` costs at rest: 10,000 files in 50 checkpoints.

    python tests/bench/bench_checkpoints.py [--quick] [--seconds 120]

A folder holds 50 HF Trainer checkpoints (`checkpoint-N/`: `trainer_state.json`, a safetensors
file and 198 small zip files, torch.save's format), 10,000 files in all, and one more cut short
by a crash (half a safetensors file, no `trainer_state.json`), which stays waiting. `sidecar watch
--checkpoints` (no other source, no hardware sampling, the status endpoint off) registers each
with a receiver that answers at once; once all 50 are registered and its start-up is over, its
CPU time over 120 s (60 s with --quick: either spans at least one of the walks it makes without
events) is read from the scheduler's nanosecond account of every thread, as bench_idle.py does.

Then a save streams writes into a new checkpoint (4 KiB every 10 ms, for the same time): the
CPU share again, while file events arrive all along.

Targets: under 1 % of one core at rest; under 5 % while a save is written.
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
import zipfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import psutil
from _harness import (
    Row,
    bench_arguments,
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
    wait_quiet,
)

BENCH = "checkpoints at rest"
CHECKPOINTS = 50
FILES_EACH = 200
TARGET_CPU_PERCENT = 1.0
TARGET_SAVING_PERCENT = 5.0
WRITE_EVERY_S = 0.01


def _zip_bytes() -> bytes:
    buffer = BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00." * 16)
    return buffer.getvalue()


def _safetensors_bytes() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(64)


def write_checkpoints(root: Path) -> int:
    """50 complete checkpoint-N folders of 200 files each; returns the number of files."""
    small, weights = _zip_bytes(), _safetensors_bytes()
    count = 0
    for n in range(1, CHECKPOINTS + 1):
        folder = root / f"checkpoint-{n * 100}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(weights)
        for i in range(FILES_EACH - 2):
            (folder / f"rng_state_{i}.pth").write_bytes(small)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": n * 100}))
        count += FILES_EACH
    crashed = root / f"checkpoint-{(CHECKPOINTS + 1) * 100}"  # a save cut short: never complete
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return count + 1


def measure(seconds: float, profile: Path | None) -> list[Row]:
    with receiver("count") as rec, tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        work = Path(tmp)
        root = work / "out"
        files = write_checkpoints(root)
        env = sidecar_env(rec.endpoint, work / "state")
        proc = start_sidecar(["watch", "--checkpoints", str(root), "--artifact-uri",
                              f"{root}=s3://bench/out"], env, work)
        try:
            registered = rec.wait_for(
                lambda s: s["routes"].get("/artifact", 0) >= CHECKPOINTS, 120)["routes"]
            if registered.get("/artifact", 0) < CHECKPOINTS:
                raise RuntimeError(f"only {registered} were posted")
            ps = psutil.Process(proc.pid)
            wait_quiet(ps)
            with profiled(proc.pid, profile, "checkpoints"):
                rest_percent, wall_s = _cpu_percent(proc.pid, seconds, lambda: None)
                saving = root / "checkpoint-99999"
                saving.mkdir()
                with open(saving / "model.safetensors", "wb") as fh:
                    def write() -> None:
                        fh.write(bytes(4096))
                        fh.flush()

                    saving_percent, _ = _cpu_percent(proc.pid, seconds, write)
            posted = rec.stats()["routes"].get("/artifact", 0)
        finally:
            stop(proc)
            show_warnings(work)
    print(f"  {files} files in {CHECKPOINTS} checkpoints and a partial one: at rest "
          f"{rest_percent:.3f} % of a core over {wall_s:.1f} s, while a save is written "
          f"{saving_percent:.3f} %; /artifact posts: {posted}")
    if posted != CHECKPOINTS:
        raise RuntimeError(f"{posted} registrations for {CHECKPOINTS} checkpoints")
    return [
        limit_row(BENCH, f"CPU over {wall_s:.0f} s, {files} files in {CHECKPOINTS} checkpoints",
                  rest_percent, "% of a core", "<", TARGET_CPU_PERCENT),
        limit_row(BENCH, "CPU while a save streams writes", saving_percent, "% of a core", "<",
                  TARGET_SAVING_PERCENT),
        info_row(BENCH, "registrations posted (one per checkpoint)", posted, "posts"),
    ]


def _cpu_percent(pid: int, seconds: float, step: Callable[[], None]) -> tuple[float, float]:
    """The sidecar's CPU share of one core over `seconds`, `step` called every WRITE_EVERY_S."""
    threads0, started = thread_cpu(pid), time.monotonic()
    while time.monotonic() - started < seconds:
        step()
        time.sleep(WRITE_EVERY_S)
    threads, wall_s = thread_cpu(pid), time.monotonic() - started
    cpu_s = sum(t - threads0.get(tid, 0.0) for tid, t in threads.items())
    return 100 * cpu_s / wall_s, wall_s


def main() -> None:
    options = bench_arguments(__doc__.splitlines()[0])
    options.add_argument("--seconds", type=float, help="how long to measure (120, quick 60)")
    args = parse(options)
    seconds = args.seconds or (60.0 if args.quick else 120.0)
    finish(measure(seconds, args.profile), args.json)


if __name__ == "__main__":
    main()
