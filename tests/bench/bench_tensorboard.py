"""Benchmark (not a test): TensorBoard scalar points decoded per second, our EventFileParser
against the `tensorboard` package's EventFileLoader, on the same ~100 MB event file.

    python tests/bench/bench_tensorboard.py [--mb 100] [--chunk-mib 8]

The file is written by tensorboardX: its RecordWriter (framing and CRCs) and its protos, with
events exactly as `SummaryWriter.add_scalar` makes them (one simple_value per event, 16 tags).
SummaryWriter itself is not used to write them because its per-call numpy checks would take
five minutes for 100 MB. The file is written by a child process, so that our parser runs in a
process like the sidecar's, without tensorboardX, numpy or tensorboard loaded (a bigger heap
makes Python's cycle collector slower for every object allocated); the loader runs after it.
Our parser is fed the file in chunks as the follower reads it; the loader reads it its own way.
Times are CPU times of this process, so that other work on the machine skews them less. Needs:
tensorboardX, tensorboard (test extras).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sidecar.sources.files.tensorboard import EventFileParser

TAGS = [f"{group}/{name}" for group in ("train", "val", "gpu0", "gpu1")
        for name in ("loss", "accuracy", "learning_rate", "grad_norm")]
TARGET_RATIO = 30.0  # issue 17 (issue 8: 20)


def write_event_file(path: Path, target_bytes: int) -> None:
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import RecordWriter

    writer = RecordWriter(str(path))
    writer.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
    written, step, wall_time = 0, 0, 1.7e9
    while written < target_bytes:
        for index, tag in enumerate(TAGS):
            value = Summary.Value(tag=tag, simple_value=1.0 / (step + index + 1))
            data = Event(wall_time=wall_time, step=step,
                         summary=Summary(value=[value])).SerializeToString()
            writer.write(data)
            written += len(data) + 16
        step += 1
        wall_time += 0.25
    writer.close()


def ours(path: Path, chunk_bytes: int) -> tuple[int, float]:
    """(points, seconds): the file read in chunks as the follower reads it, and parsed."""
    start = time.process_time()
    parser, points, pending = EventFileParser("run/"), 0, b""
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            data = pending + chunk
            decoded = parser.parse(data)
            points += len(decoded.points)
            pending = data[decoded.consumed:]
    return points, time.process_time() - start


def loader(path: Path) -> tuple[int, float]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    start = time.process_time()
    points = sum(len(event.summary.value) for event in EventFileLoader(str(path)).Load())
    return points, time.process_time() - start


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--mb", type=float, default=100.0, help="event file size, MB")
    options.add_argument("--chunk-mib", type=float, default=8.0, help="our read size, MiB")
    options.add_argument("--runs", type=int, default=3, help="runs of our parser (median)")
    options.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child's job
    args = options.parse_args()
    if args.write:
        write_event_file(args.write, int(args.mb * 1e6))
        return

    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        path = Path(tmp) / "events.out.tfevents.1700000000.bench"
        subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--write", str(path)],
                       check=True)
        size_mb = path.stat().st_size / 1e6
        print(f"wrote {size_mb:.1f} MB with tensorboardX in {time.monotonic() - start:.1f} s")

        runs = [ours(path, int(args.chunk_mib * 2**20)) for _ in range(args.runs)]
        our_points = runs[0][0]
        our_s = statistics.median(seconds for _, seconds in runs)
        their_points, their_s = loader(path)
        if our_points != their_points:
            raise SystemExit(f"the readers disagree: {our_points} vs {their_points} points")

    ours_rate, theirs_rate = our_points / our_s, their_points / their_s
    print(f"points in the file:            {our_points}")
    print(f"EventFileParser (ours):        {ours_rate:12,.0f} points/s  ({our_s:.2f} s, "
          f"{size_mb / our_s:.0f} MB/s)")
    print(f"tensorboard EventFileLoader:   {theirs_rate:12,.0f} points/s  ({their_s:.2f} s)")
    ratio = ours_rate / theirs_rate
    print(f"ratio: {ratio:.1f}x (target {TARGET_RATIO:.0f}x: "
          f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")


if __name__ == "__main__":
    main()
