"""`sidecar run` and terminals: `--tty` gives the command a pseudo-terminal; at a terminal, the
command gets its foreground (input(), pdb, Ctrl-C), as under a shell."""

from __future__ import annotations

import io
import json
import re
import signal
import sys
from pathlib import Path

import pexpect
import pytest

from tests.conftest import RUN_ID, SIDECAR, Sidecar, platform_env, python_child, sidecar
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest
from tests.test_terminal import arrived, assert_in_order, screen_lines

REPORT_TERMINAL = """
import json, os, sys
print(json.dumps({"isatty": [sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty()],
                  "size": list(os.get_terminal_size(1))}), flush=True)
print("on stderr", file=sys.stderr, flush=True)
code = int(sys.argv[1])
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

RICH_LIVE = """
import time
from rich.console import Console
from rich.progress import Progress
console = Console()  # no force_terminal: rich decides from isatty
print("color" if console.is_terminal else "no terminal", flush=True)
with Progress(console=console, refresh_per_second=50) as progress:
    task = progress.add_task("epoch", total=30)
    for _ in range(30):
        progress.update(task, advance=1)
        time.sleep(0.01)
console.print("[bold]finished[/bold]")
"""


@pytest.mark.parametrize(("code", "status"), [(0, 0), (3, 3), (-signal.SIGKILL, 137)])
def test_tty_child_sees_a_terminal_and_its_status_is_kept(ingest: RunningIngest, tmp_path: Path,
                                                          code: int, status: int) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--tty", "--", *python_child(REPORT_TERMINAL), str(code)], env,
                   tmp_path / "sc")
    assert done.status == status, done.stderr
    first, second = done.stdout.splitlines()[:2]  # stdout and stderr share the terminal
    report = json.loads(first)
    assert report["isatty"][1:] == [True, True]
    assert report["size"] == [80, 24]  # the sidecar has no terminal here
    assert second == b"on stderr"
    assert b"\r\n" not in done.stdout  # the child's bytes, unchanged
    text = arrived(ingest)
    assert '"isatty": [false, true, true]' in text and "on stderr\n" in text


def test_tty_lets_rich_draw_and_what_arrives_is_what_it_shows(ingest: RunningIngest,
                                                              tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--tty", "--", *python_child(RICH_LIVE)], env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert done.stdout.startswith(b"color\n")
    assert b"\x1b[" in done.stdout  # rich drew: colours, its live display
    text = arrived(ingest)
    assert_in_order(screen_lines(done.stdout), text)
    assert "\x1b" not in text and "finished\n" in text


def test_tty_forwards_sigterm_to_the_command(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    code = "import time; print('up', flush=True); time.sleep(60)"
    run = Sidecar(["run", "--tty", "--", *python_child(code)], env, tmp_path / "sc")
    ingest.wait_for(lambda: "up" in arrived(ingest), what="the command started")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait().status == 128 + signal.SIGTERM


# --- at a terminal: the command in the foreground ---------------------------------------------


def at_terminal(ingest: RunningIngest, tmp_path: Path, code: str, *args: str,
                **variables: str) -> pexpect.spawn:
    """`sidecar run` on a terminal of its own, as a user at a shell starts it."""
    env = platform_env(ingest, tmp_path / "state", **variables)
    (tmp_path / "sc").mkdir()
    child = pexpect.spawn(SIDECAR[0], [*SIDECAR[1:], "run", "--", sys.executable, "-c", code,
                                       *args],
                          env=env, cwd=str(tmp_path / "sc"), timeout=20, encoding="utf-8")
    child.logfile_read = io.StringIO()  # everything the terminal was sent
    return child


def test_command_reads_its_terminal(ingest: RunningIngest, tmp_path: Path) -> None:
    """input() under `sidecar run` at a terminal gets the typed line (it was stopped for good
    by SIGTTIN, from a process group in the terminal's background)."""
    child = at_terminal(ingest, tmp_path, "print('got', repr(input('name? ')))")
    child.expect_exact("name? ")
    child.sendline("ada")
    child.expect_exact("got 'ada'")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_at_the_terminal_ends_a_command_waiting_for_input(ingest: RunningIngest,
                                                                 tmp_path: Path) -> None:
    child = at_terminal(ingest, tmp_path, "input('ready> ')")
    child.expect_exact("ready> ")
    child.sendintr()
    child.expect_exact("KeyboardInterrupt")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 128 + signal.SIGINT


# The command leaves its line open until it is told to go on: the sidecar's message about the
# /logs 401 (its partial line is posted after a quiet second) comes while the line is open.
MID_LINE_UNTIL_TOLD = """
print("4/60", end="", flush=True)
input()
print(" 5/60", flush=True)
"""


def test_our_message_starts_a_line_of_its_own_while_a_bar_is_mid_line(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Our message while the command's bar is mid-line starts on a new line instead of
    continuing the bar's (it gave `4/602026-12-01T07:23:12.767Z sidecar ...`)."""
    ingest.add_fault(Fault(route="logs", status=401, times=1))
    child = at_terminal(ingest, tmp_path, MID_LINE_UNTIL_TOLD)
    child.expect_exact("4/60")
    child.expect(r"Z sidecar (ERROR|WARNING) /logs")
    child.sendline("")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    shown = child.logfile_read.getvalue()
    assert re.search(r"4/60\r\n[0-9T:.-]+Z sidecar [A-Z]+ ", shown), shown
    assert not re.search(r"[^\n][0-9]{4}-[0-9T:.-]+Z sidecar ", shown), shown


# --- the sidecar's own lines at a terminal ------------------------------------------------------

HEALTHY_3S = """
import time
for step in range(3):
    print(f"step {step} loss 0.{step}", flush=True)
    time.sleep(1)
"""
OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[0-9:.]+Z sidecar ")


def own_lines_around(shown: list[str]) -> tuple[list[str], list[str], list[str]]:
    """The sidecar's lines before the command's first, between, and after its last."""
    first = next(i for i, line in enumerate(shown) if line.startswith("step "))
    last = max(i for i, line in enumerate(shown) if line.startswith("step "))
    ours = [i for i, line in enumerate(shown) if OWN_LINE.match(line)]
    return ([shown[i] for i in ours if i < first], [shown[i] for i in ours if first < i < last],
            [shown[i] for i in ours if i > last])


@pytest.mark.parametrize("verbose", [[], ["-v"]], ids=["default", "-v"])
def test_at_a_terminal_a_healthy_run_says_one_line_before_the_output_and_one_at_the_end(
        ingest: RunningIngest, tmp_path: Path, verbose: list[str]) -> None:
    """A healthy 3-s run printed 7 of the sidecar's lines at a terminal, two of them before the
    command's first line; now one says where the run is reported and one what was delivered,
    and `-v` gives the rest back."""
    env = platform_env(ingest, tmp_path / "state")
    (tmp_path / "sc").mkdir()
    child = pexpect.spawn(SIDECAR[0], [*SIDECAR[1:], "run", *verbose, "--hardware-interval",
                                       "0", "--", sys.executable, "-c", HEALTHY_3S],
                          env=env, cwd=str(tmp_path / "sc"), timeout=30, encoding="utf-8")
    child.logfile_read = io.StringIO()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    before, between, after = own_lines_around(screen_lines(
        child.logfile_read.getvalue().replace("\r\n", "\n").encode()))
    assert before[0].endswith(f"sidecar INFO reporting run {RUN_ID} to {ingest.base_url} "
                              "from node " + before[0].rsplit("from node ", 1)[1])
    assert after[-1].split(" sidecar INFO ")[1].startswith("the command succeeded after 3s; "
                                                           "the ingest took ")
    assert after[-1].endswith("; nothing is left to deliver")
    if verbose:
        assert len(before + between + after) > 4
        assert "(-v: all of the sidecar's messages)" not in before[0]
        return
    assert len(before) == 1 and before[0].endswith("(-v: all of the sidecar's messages)")
    assert between == [] and len(after) == 1, (between, after)


def test_in_a_pod_the_sidecar_s_messages_stay_as_operators_read_them(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """stderr to a file, as in a pod: the lifecycle's lines are there, and the end's."""
    done = sidecar(["run", "--hardware-interval", "0", "--", *python_child(HEALTHY_3S)],
                   platform_env(ingest, tmp_path / "state"), tmp_path / "sc")
    assert done.status == 0
    said = done.stderr.decode()
    assert "lifecycle: succeeded accepted by the ingest" in said
    assert said.rstrip().splitlines()[-1].endswith("; nothing is left to deliver")
    assert "-v: all" not in said


def test_at_a_terminal_a_warning_is_said_as_it_happens(ingest: RunningIngest,
                                                       tmp_path: Path) -> None:
    """What is wrong is not held back: a token the ingest refuses is said at once, and the end
    line says what was not delivered."""
    ingest.add_fault(Fault(status=401))
    child = at_terminal(ingest, tmp_path, HEALTHY_3S)
    child.expect(pexpect.EOF)
    child.close()
    shown = child.logfile_read.getvalue()
    assert " sidecar ERROR " in shown or " sidecar WARNING " in shown, shown
    assert "not delivered (said above): lifecycle starting, running, succeeded" in shown, shown
