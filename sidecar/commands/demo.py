"""`sidecar demo`: a local receiver, the bundled example trainer under `sidecar run`, and what
arrived, so a new user sees the whole path work in one command: its checkpoint too, uploaded
to the receiver's own object folder through signed URLs and registered."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from sidecar.commands.receive import IngestServer

RUN_ID = "demo-run"
TOKEN = "demo-token"
TRAINER = Path(__file__).parents[1] / "examples" / "trainer.py"  # sidecar/examples/


def demo(workdir: Path) -> int:
    """Run the demo in `workdir`; returns the wrapped trainer's exit status."""
    return asyncio.run(_demo(workdir))


async def _demo(workdir: Path) -> int:
    server = IngestServer(workdir / "received", token=TOKEN, run_id=RUN_ID)
    await server.start()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STARFORGE_", "TUNEPLANE_", "SIDECAR_"))}
    env.update(STARFORGE_ENABLED="1", STARFORGE_ENDPOINT=server.base_url,
               STARFORGE_RUN_ID=RUN_ID, STARFORGE_TOKEN=TOKEN,
               SIDECAR_STATE_DIR=str(workdir / "state"), SIDECAR_STATUS_ADDR="off")
    print(f"== receiver on {server.base_url}; running the example trainer under `sidecar run`")
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar", "run", "--checkpoints", str(checkpoints),
        "--checkpoint-upload", "always", "--", sys.executable, str(TRAINER), str(checkpoints),
        env=env)
    status = await proc.wait()
    await server.stop()
    _report(server, status)
    return status


def _report(server: IngestServer, status: int) -> None:
    print(f"\n== sidecar run exited with {status}; the receiver accepted:")
    print("lifecycle:")
    for record in server.records("lifecycle"):
        print(f"  {record['ts']}  {record['event']}")
    text = "".join(chunk for record in server.records("logs") for chunk in record["chunks"])
    lines = text.splitlines()
    print(f"logs: {len(server.records('logs'))} request(s), {len(lines)} line(s), "
          f"{len(text)} characters:")
    for line in lines:
        print(f"  | {line}")
    print("artifacts (uploaded through artifact/upload-url, then registered):")
    for record in server.records("artifact"):
        print(f"  {record['kind']} step {record.get('step', '?')}, {record['size_bytes']} "
              f"bytes: {record['path']}")


def main(args: argparse.Namespace) -> int:
    """`sidecar demo`, in a folder of its own that is removed after."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sidecar-demo-") as tmp:
        return demo(Path(tmp))
