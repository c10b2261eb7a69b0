"""The trainer's own writes under `sidecar run`: a command printing small lines fast is never
held to the pump's pace (docs/commands.md#the-wrapped-command).

The pump pauses after a small read to let more output gather (one wake-up of the event loop for
many lines). The pause must end before the pipe could fill: a writer blocks only on a full pipe.
A pause of a fixed tenth of a second held a stream of small writes to about one pipe (1 MiB) per
pause: 40 MiB of 100-B writes took the writer 2.6 s, against 0.5 s with the pause bounded by the
pipe's fill (on this project's 2-core machine, busy).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest

TOTAL_BYTES = 40 << 20
LINE_BYTES = 100
# a write of each line, as print() makes under PYTHONUNBUFFERED=1: a pump that reads faster
# than the command writes finds the pipe nearly empty at each read, so each read is small
PRINTER = """
import json, os, sys, time
line = b"step 000000 loss 0.4321 " + b"x" * 75 + b"\\n"
started = time.monotonic()
for _ in range(int(sys.argv[1]) // len(line)):
    os.write(1, line)
print(json.dumps({"loop_s": time.monotonic() - started}), file=sys.stderr)
"""
# between the two (2.6 s and 0.5 s): room for a loaded machine either way
LOOP_LIMIT_S = 1.2


def test_a_fast_printer_of_small_writes_keeps_its_own_pace(ingest: RunningIngest,
                                                          tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--hardware-interval", "0", "--",
                    *python_child(PRINTER), str(TOTAL_BYTES)],
                   env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert len(done.stdout) == TOTAL_BYTES // LINE_BYTES * LINE_BYTES
    loop_s = next(json.loads(line)["loop_s"] for line in done.stderr.splitlines()
                  if line.startswith(b'{"loop_s"'))
    assert loop_s < LOOP_LIMIT_S, f"the writer's loop took {loop_s:.2f} s"
