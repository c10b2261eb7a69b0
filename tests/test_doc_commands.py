"""The shell commands of the README and of every docs/ page run as a user pastes them: each
page's ```sh blocks, in order, in one bash session, in a copy of this repository.

A block that cannot run here says so on the line above it, `<!-- not run: why -->` (a cluster,
root, docker, your own trainer, the test suite itself), and is only parsed; one that runs until
stopped (a receiver in its own terminal) is `<!-- run in the background: why -->`, started
before the blocks after it and stopped at the end. What the session changes is the machine, not
the commands: `/tmp/` is a folder of the test's own, the port 8080 a free one, the home and the
state folder private, the platform's and the sidecar's variables unset; `python3 -m venv` makes
a virtualenv that takes its packages from the test's own, and pip installs without an index or
build isolation (nothing is downloaded); the README's test command is what .ci/run runs."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!-- (not run|run in the background): (.+?) -->\s*\Z")
SHELL = {"sh", "bash", "shell"}
# What a page's output must show besides its exit status 0: what arrived.
ARRIVED = {"README.md": ["succeeded"], "docs/running.md": ['"event":"succeeded"']}
# Stands in for `python3 -m venv DIR`: a virtualenv without pip of its own that takes its
# packages, pip and setuptools included, from the test's environment (no index is reachable).
PRELUDE = r"""
set -euo pipefail
fresh_venv() {
    python3 -m venv --without-pip "$1"
    local site
    site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$OUTER_SITE" > "$site/outer.pth"
    printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n' > "$1/bin/pip"
    chmod +x "$1/bin/pip"
}
await_port() {
    python3 -c '
import socket, sys, time
deadline = time.monotonic() + 60
while socket.socket().connect_ex(("127.0.0.1", int(sys.argv[1]))) != 0:
    if time.monotonic() > deadline:
        sys.exit(f"nothing listens on port {sys.argv[1]} after 60 s")
    time.sleep(0.05)
' "$1"
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
# Whatever a page installs goes into a virtualenv of its own, never the test's.
fresh_venv "$SESSION/venv" && . "$SESSION/venv/bin/activate"
"""


class Block:
    """One fenced shell block of a page, and what the line above it says of it."""

    def __init__(self, page: Path, line: int, code: str, mark: str, why: str) -> None:
        self.page, self.line, self.code, self.mark, self.why = page, line, code, mark, why

    def __repr__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for fence in FENCE.finditer(text):
        if fence.group(1) not in SHELL:
            continue
        mark = MARK.search(text[:fence.start()].rsplit("\n\n", 1)[-1])
        found.append(Block(page, text.count("\n", 0, fence.start()) + 1, fence.group(2),
                           mark.group(1) if mark else "run", mark.group(2) if mark else ""))
    return found


def test_every_mark_stands_above_a_shell_block() -> None:
    """A mark is read only on the line above a block: one anywhere else marks nothing."""
    wrong = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for mark in re.finditer(r"<!-- (?:not run|run in the background)[^>]*-->", text):
            after = text[mark.end():].lstrip(" ")
            fence = re.match(r"\n```(\w*)\n", after)
            if not (fence and fence.group(1) in SHELL and re.fullmatch(MARK, mark.group(0))):
                wrong.append(f"{page.relative_to(ROOT)}: {mark.group(0)}")
    assert wrong == []


def test_blocks_not_run_are_still_shell() -> None:
    """What cannot run here still parses, and a reason says why it is not run."""
    marked = [b for page in PAGES for b in blocks(page) if b.mark == "not run"]
    assert marked, "the pages mark what they do not run"
    for block in marked:
        assert block.why.strip(), block
        parsed = subprocess.run(["bash", "-n"], input=block.code, text=True,
                                capture_output=True, timeout=30)
        assert parsed.returncode == 0, (block, parsed.stderr)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """Each command of the README's test line is a line of .ci/run (`pip` as `python -m pip`,
    `-q` aside)."""
    [line] = [b.code for b in blocks(ROOT / "README.md") if "pytest" in b.code]

    def plain(command: str) -> str:
        words = [w for w in shlex.split(command) if w != "-q"]
        return " ".join(words[2:] if words[:2] == ["python", "-m"] else words)

    ci = {plain(row) for row in (ROOT / ".ci" / "run").read_text().splitlines()
          if row.strip() and not row.lstrip().startswith("#")}
    commands = [plain(part) for part in line.replace("\\\n", " ").split("&&")]
    assert "pytest" in commands and "pip install -e .[test]" in commands
    assert [c for c in commands if c not in ci] == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script(page: Path, tmp: Path, port: int) -> str:
    """The page's blocks to run, as one bash script, with the machine's changes made."""
    parts = [PRELUDE]
    for n, block in enumerate(blocks(page)):
        code = block.code
        if block.mark == "not run":
            continue
        code = re.sub(r"(?<![\w/.])/tmp/", f"{tmp}/", code)
        code = re.sub(r"\b8080\b", str(port), code)
        code = re.sub(r"\bpython3 -m venv ", "fresh_venv ", code)
        parts.append(f"# {block!r}")
        if block.mark == "run in the background":
            parts.append(f"{{\n{code}}} > {tmp}/background-{n}.log 2>&1 &")
            if re.search(rf"\b{port}\b", code):
                parts.append(f"await_port {port}")
        else:
            parts.append(code)
    return "\n".join(parts) + "\n"


def runnable_pages() -> list[Path]:
    return [page for page in PAGES if any(b.mark != "not run" for b in blocks(page))]


def test_the_pages_run_their_commands() -> None:
    assert {p.name for p in runnable_pages()} >= {"README.md", "running.md", "install.md"}


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_s_commands_run(page: Path, tmp_path: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    repo = tmp_path / "repo"
    for name in filter(None, files.split("\0")):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_bytes(source.read_bytes())
            (repo / name).chmod(source.stat().st_mode)
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STARFORGE_", "TUNEPLANE_", "SIDECAR_", "PIP_", "VIRTUAL_ENV"))}
    env.update(HOME=str(tmp_path / "home"), XDG_STATE_HOME=str(tmp_path / "state"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT), SESSION=str(tmp_path),
               OUTER_SITE=sysconfig.get_paths()["purelib"],
               PIP_NO_INDEX="1", PIP_NO_DEPS="1", PIP_NO_BUILD_ISOLATION="0",
               PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_QUIET="1")
    text = script(page, tmp_path, free_port())
    # A session of its own, so that what it left running (a receiver) is stopped with it.
    session = subprocess.Popen(["bash", "-c", text], cwd=repo, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        out, err = session.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session.pid, signal.SIGTERM)
        session.wait()
    shown = f"{text}\n--- stdout\n{out[-6000:]}\n--- stderr\n{err[-6000:]}"
    assert session.returncode == 0, shown
    for expected in ARRIVED.get(str(page.relative_to(ROOT)), []):
        assert expected in out, shown
