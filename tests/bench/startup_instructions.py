"""Instructions `sidecar watch --log FILE` executes until its first POST to /logs (valgrind).

    python tests/bench/startup_instructions.py [ROOT ...]

A tool for working on start-up, beside bench_startup.py's target: CPU-seconds on a shared
virtual machine moved from 0.16 to 0.25 between identical runs, while valgrind's count of
instructions is the same to 0.2 %, so a change of 2 % shows in one run. Each ROOT is a folder
holding a `sidecar` package (default: this checkout); it is byte-compiled first, as
`pip install` does. The sidecar runs with the bench's environment (no status endpoint, no
hardware sampling) against the counting receiver, in one process that ends at the first /logs
request: what comes after is not counted, nor the receiver. `python -c "import asyncio"` is
shown beside, the part no change of ours can remove.
"""

from __future__ import annotations

import argparse
import compileall
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import REPO, receiver, sidecar_env

# `sidecar watch`, ended (os._exit: no drain, no atexit) as its first /logs request goes out.
_UNTIL_FIRST_LOGS = """
import os, sys
from sidecar.delivery import transport
from sidecar.cli import main

post = transport.Transport.post

async def first_logs_ends_it(self, path, *args, **kwargs):
    if path == "/logs":
        os._exit(0)
    return await post(self, path, *args, **kwargs)

transport.Transport.post = first_logs_ends_it
sys.exit(main(["watch", "--log", sys.argv[1]]))
"""


def instructions(code: list[str], env: dict[str, str], cwd: Path) -> int:
    """Instructions valgrind counts for `python CODE...`."""
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                           sys.executable, *code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"valgrind counted nothing: {done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("roots", nargs="*", type=Path, default=[REPO], metavar="ROOT",
                         help="a folder holding a sidecar package (default: this checkout)")
    args = options.parse_args()
    if shutil.which("valgrind") is None:
        print("startup_instructions: skipped, valgrind is not installed (apt-get install valgrind)")
        return
    with tempfile.TemporaryDirectory(prefix="startup-instructions-") as tmp, \
            receiver("count") as rec:
        work = Path(tmp)
        log = work / "train.log"
        log.write_text("the first line\n")
        floor = instructions(["-c", "import asyncio"], sidecar_env(rec.endpoint, work), work)
        print(f"{floor / 1e6:8.1f} M  python -c 'import asyncio'")
        for root in args.roots:
            compileall.compile_dir(root / "sidecar", quiet=1)
            state = work / f"state-{len(list(work.iterdir()))}"
            env = sidecar_env(rec.endpoint, state)
            env["PYTHONPATH"] = str(root.resolve())
            count = instructions(["-c", _UNTIL_FIRST_LOGS, str(log)], env, work)
            print(f"{count / 1e6:8.1f} M  {root}: sidecar watch --log, to its first /logs POST")


if __name__ == "__main__":
    main()
