"""`sidecar run` end to end: a real sidecar process, a real child, real HTTP over loopback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import (
    RUN_ID,
    SIDECAR,
    TOKEN,
    Sidecar,
    clean_environ,
    platform_env,
    python_child,
    sidecar,
)
from tests.faulty_ingest import Fault
from tests.ingest_server import RunningIngest, running_ingest, wait_until

# A child that stamps its first and last line with its own clock, so the test can check that
# `running` was stamped before the first line and the end event after the last.
STAMPED = """
import os, sys, time
print("first", time.time(), flush=True)
print("working", flush=True)
print("last", time.time(), flush=True)
code = int(sys.argv[1])
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def epoch(ts: str) -> float:
    return datetime.fromisoformat(ts).timestamp()


def stamp(text: str, word: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(word + " "))
    return float(line.split()[1])


@pytest.mark.parametrize(("code", "status", "end"), [
    (0, 0, "succeeded"), (3, 3, "failed"), (-signal.SIGKILL, 137, "failed")])
def test_exit_status_and_lifecycle_in_order(ingest: RunningIngest, tmp_path: Path, code: int,
                                            status: int, end: str) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child(STAMPED), str(code)], env, tmp_path / "sc")
    assert done.status == status, done.stderr
    assert ingest.events() == ["starting", "running", end]
    text = ingest.log_text()
    assert "working\n" in text
    times = {r["event"]: epoch(r["ts"]) for r in ingest.records("lifecycle")}
    assert times["starting"] <= times["running"] <= stamp(text, "first")
    assert times[end] >= stamp(text, "last")
    assert b"working\n" in done.stdout  # passed through for kubectl logs


def _close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize(("code", "end"), [(0, "succeeded"), (3, "failed")])
def test_started_with_stdout_closed_the_exit_status_is_the_commands(
        ingest: RunningIngest, tmp_path: Path, code: int, end: str) -> None:
    """`sidecar run ... 1>&-`, as some schedulers start a job: descriptor 1 is reserved on
    /dev/null at start, so neither the event loop nor the exit takes it for the command's
    output, and the wrapper's exit status is the command's (it was 1 after posting the end)."""
    env = platform_env(ingest, tmp_path / "state")
    run = Sidecar(["run", "--", *python_child(f"print('working'); raise SystemExit({code})")],
                  env, tmp_path / "sc", preexec_fn=_close_stdout)
    done = run.wait(60)
    assert done.status == code, done.stderr
    assert b"Traceback" not in done.stderr
    assert ingest.events() == ["starting", "running", end]
    assert "working\n" in ingest.log_text()


def test_output_written_the_instant_the_command_starts_reaches_logs(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """The /logs buffer exists before the spawn: what a command prints while the sidecar is
    still importing its pipeline is kept, not skipped for want of a shipper."""
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", "/bin/sh", "-c", "echo at once; echo to stderr >&2"], env,
                   tmp_path / "sc")
    assert done.status == 0, done.stderr
    text = ingest.log_text()
    assert "at once\n" in text and "to stderr\n" in text
    assert "dropped" not in text


FLOOD_THEN_QUIET = """
import sys, time
sys.stdout.buffer.write((b"x" * 99 + b"\\n") * 20000)
sys.stdout.flush()
time.sleep(2.0)  # a trainer's quiet spell, long enough for the budget to refill
print("the last line", flush=True)
"""


def test_log_rate_caps_a_flood_and_forwards_what_follows_it(ingest: RunningIngest,
                                                             tmp_path: Path) -> None:
    """--log-rate 0.1 (MB/s): of a 2 MB burst about its first 0.1 MB reaches /logs, the gap is
    marked, the line after the quiet spell arrives, and the wrapper's own stdout has it all."""
    env = platform_env(ingest, tmp_path / "state", SIDECAR_LOG_RATE="0.1")
    done = sidecar(["run", "--", *python_child(FLOOD_THEN_QUIET)], env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert done.stdout == (b"x" * 99 + b"\n") * 20000 + b"the last line\n"
    text = ingest.log_text()
    forwarded = text.count("x" * 99)
    assert 0 < forwarded < 20000 // 4, forwarded  # 0.1 MB of 2 MB, and a little refill
    marked = re.findall(r"\[sidecar\] (\d+) characters of output were dropped here: the "
                        r"command writes faster than --log-rate forwards\n", text)
    assert sum(map(int, marked)) == (20000 - forwarded) * 100
    assert text.endswith("the last line\n")


def test_offline_passes_output_through_byte_for_byte(ingest: RunningIngest,
                                                     tmp_path: Path) -> None:
    payload = b"plain\r\nbar 1\rbar 2\r\xff\xfe not utf-8 \xe2\x82\n" + TOKEN.encode() + b"\n"
    code = (f"import sys; sys.stdout.buffer.write({payload!r}); sys.stdout.flush(); "
            f"sys.stderr.buffer.write({payload!r}[::-1])")
    env = platform_env(ingest, tmp_path / "state", STARFORGE_ENABLED="0")
    done = sidecar(["run", "--", *python_child(code)], env, tmp_path / "sc")
    assert done.status == 0
    assert done.stdout == payload
    assert payload[::-1] in done.stderr
    assert ingest.stats.total_requests == 0
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("enabled", [None, "yes", ""])
def test_enabled_unset_or_invalid_exits_2_before_the_child(ingest: RunningIngest, tmp_path: Path,
                                                          enabled: str | None) -> None:
    env = platform_env(ingest, tmp_path / "state")
    if enabled is None:
        del env["STARFORGE_ENABLED"]
    else:
        env["STARFORGE_ENABLED"] = enabled
    marker = tmp_path / "child-ran"
    child = python_child(f"open({str(marker)!r}, 'w').close()")
    done = sidecar(["run", "--", *child], env, tmp_path / "sc")
    assert done.status == 2
    assert not marker.exists()
    message = done.stderr.decode()
    assert "STARFORGE_ENABLED" in message
    assert len(message.strip().splitlines()) == 1
    assert TOKEN not in message
    assert ingest.stats.total_requests == 0


def test_endpoint_down_at_start_does_not_delay_the_child(ingest: RunningIngest,
                                                         tmp_path: Path) -> None:
    ingest.stop_listening()
    env = platform_env(ingest, tmp_path / "state")
    child = python_child("import time; print('started', time.time(), flush=True)")
    started = time.time()
    run = Sidecar(["run", "--", *child], env, tmp_path / "sc")
    # the whole line: with PYTHONUNBUFFERED set, print() writes its pieces one by one
    wait_until(lambda: b"\n" in (tmp_path / "sc" / "stdout").read_bytes(), 10,
               "the child printed its line")
    child_started = stamp((tmp_path / "sc" / "stdout").read_text(), "started")
    assert child_started - started < 3.0  # interpreter start-ups only, no network wait
    back = time.time()
    ingest.start_listening()
    done = run.wait()
    assert done.status == 0, done.stderr
    assert ingest.events() == ["starting", "running", "succeeded"]
    times = [epoch(r["ts"]) for r in ingest.records("lifecycle")]
    assert times == sorted(times)
    assert times[1] <= child_started < back  # original times, not delivery times


def test_logs_failing_never_fails_a_good_run(ingest: RunningIngest, tmp_path: Path) -> None:
    ingest.add_fault(Fault(route="logs", status=500))
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child("print('hello')")], env, tmp_path / "sc")
    assert done.status == 0
    assert ingest.events() == ["starting", "running", "succeeded"]
    assert ingest.records("logs") == []
    assert ingest.stats.routes["logs"].rejected  # it really tried


WRITER = """
import sys, time
line = b"x" * 99 + b"\\n"
block = line * 10486
t0 = time.monotonic()
for _ in range(100):
    sys.stdout.buffer.write(block)
sys.stdout.flush()
sys.stderr.write(f"took {time.monotonic() - t0}\\n")  # one write: the wrapper's own lines
#   share this stderr, and print() writes its pieces one by one to an unbuffered one
"""


def test_hung_ingest_does_not_slow_a_fast_writer(ingest: RunningIngest, tmp_path: Path) -> None:
    """100 MB as fast as the child can write: as fast with the ingest hung as with none."""
    child = python_child(WRITER)
    offline = platform_env(ingest, tmp_path / "s0", STARFORGE_ENABLED="0")
    base = sidecar(["run", "--", *child], offline, tmp_path / "base")
    ingest.add_fault(Fault(route="logs", latency_s=600))
    hung = platform_env(ingest, tmp_path / "s1", SIDECAR_DRAIN_TIMEOUT="4")
    slow = sidecar(["run", "--", *child], hung, tmp_path / "hung")
    assert base.status == slow.status == 0
    assert len(slow.stdout) == len(base.stdout) == 100 * 10486 * 100
    took_base, took_hung = stamp(base.stderr.decode(), "took"), stamp(slow.stderr.decode(), "took")
    print(f"child write time: no ingest {took_base:.2f} s, hung ingest {took_hung:.2f} s")
    assert took_hung < 2 * took_base + 1.0
    assert ingest.events() == ["starting", "running", "succeeded"]


TRAPS_TERM = """
import signal, sys, time
def bye(signum, frame):
    print("cleaning up", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("child", "status", "end"), [
    (TRAPS_TERM, 0, "succeeded"),
    ("import time; print('ready', flush=True); time.sleep(60)", 143, "failed")])
def test_sigterm_reaches_the_child(ingest: RunningIngest, tmp_path: Path, child: str,
                                   status: int, end: str) -> None:
    env = platform_env(ingest, tmp_path / "state")
    run = Sidecar(["run", "--", *python_child(child)], env, tmp_path / "sc")
    wait_until(lambda: b"ready" in (tmp_path / "sc" / "stdout").read_bytes(), 10, "child ready")
    run.proc.send_signal(signal.SIGTERM)
    done = run.wait()
    assert done.status == status
    assert ingest.events() == ["starting", "running", end]
    if status == 0:
        assert b"cleaning up" in done.stdout


def test_token_never_printed_or_stored(ingest: RunningIngest, tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = platform_env(ingest, state, SIDECAR_LOG_LEVEL="debug")
    child = python_child(f"print('my token is {TOKEN}!'); import sys; sys.exit(1)")
    done = sidecar(["run", "--", *child], env, tmp_path / "sc")
    assert done.status == 1
    assert TOKEN.encode() in done.stdout  # the child's own output stays as it wrote it
    assert TOKEN.encode() not in done.stderr
    assert "my token is ***!\n" in ingest.log_text(), done.stderr.decode()[-3000:]
    for path in state.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


ROTATED_CHILD = """
import os, sys, time
print("old token", sys.argv[1], flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
print("new token", sys.argv[2], flush=True)
"""


def test_token_reread_after_a_401_is_masked_too(ingest: RunningIngest, tmp_path: Path) -> None:
    """The token file is re-read on 401: from then on the new token is masked as well as the
    one it replaced."""
    old = "tok-OLD-rotated-away-0000"
    token_file = tmp_path / "token"
    token_file.write_text(old + "\n")
    go = tmp_path / "go"
    env = platform_env(ingest, tmp_path / "state", SIDECAR_TOKEN_FILE=str(token_file))
    del env["STARFORGE_TOKEN"]
    run = Sidecar(["run", "--", *python_child(ROTATED_CHILD), old, TOKEN, str(go)], env,
                  tmp_path / "sc")
    ingest.wait_for(lambda: ingest.stats.rejected_total() > 0, what="a 401 for the old token")
    token_file.write_text(TOKEN + "\n")
    ingest.wait_for(lambda: bool(ingest.records("lifecycle")), timeout=30,
                    what="the new token accepted")
    go.touch()
    done = run.wait()
    assert done.status == 0, done.stderr
    assert TOKEN.encode() in done.stdout  # the child's own output stays as it wrote it
    text = ingest.log_text()
    assert "new token ***\n" in text
    assert TOKEN not in text and old not in text


def test_redirect_is_never_followed(ingest: RunningIngest, tmp_path: Path) -> None:
    with running_ingest(tmp_path / "elsewhere") as elsewhere:
        ingest.add_fault(Fault(redirect=elsewhere.base_url + "/lifecycle"))
        env = platform_env(ingest, tmp_path / "state", SIDECAR_DRAIN_TIMEOUT="2")
        done = sidecar(["run", "--", *python_child("print('hi')")], env, tmp_path / "sc")
        assert done.status == 0
        assert elsewhere.stats.total_requests == 0
        assert ingest.stats.total_requests > 0
        assert b"redirect" in done.stderr
        assert TOKEN.encode() not in done.stderr


TQDM_CHILD = """
import time
from tqdm import tqdm
print("before", flush=True)
for _ in tqdm(range(400), mininterval=0, miniters=1, desc="epoch"):
    time.sleep(0.01)
print("after", flush=True)
"""


def test_progress_bar_arrives_as_a_handful_of_lines(ingest: RunningIngest,
                                                     tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child(TQDM_CHILD)], env, tmp_path / "sc")
    assert done.status == 0
    assert done.stderr.count(b"\r") >= 400  # the terminal still sees every update
    bar_lines = [line for line in ingest.log_text().splitlines() if line.startswith("epoch")]
    assert 1 <= len(bar_lines) <= 6, bar_lines
    assert "400/400" in bar_lines[-1]
    assert "\r" not in ingest.log_text()


MARKED = """
import subprocess, sys, time
print("setup", time.time(), flush=True)
time.sleep(0.5)
assert subprocess.call([sys.executable, "-m", "sidecar", "lifecycle", "running"]) == 0
print("training", time.time(), flush=True)
refused = subprocess.call([sys.executable, "-m", "sidecar", "lifecycle", "succeeded"])
print("refused", refused, flush=True)
"""


def test_running_when_marker(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--running-when", "marker", "--", *python_child(MARKED)], env,
                   tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert ingest.events() == ["starting", "running", "succeeded"]
    running = epoch(ingest.records("lifecycle")[1]["ts"])
    text = done.stdout.decode()
    assert stamp(text, "setup") < running < stamp(text, "training")
    assert stamp(text, "refused") == 1


FORGED = """
import json, os, socket, subprocess, sys, time
name = os.environ["SIDECAR_WRAPPER_SOCKET"].partition("#")[0]  # all another user can learn
for ts in (0, float("nan")):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect("\\0" + name[1:])
        sock.sendall(json.dumps({"event": "running", "ts": ts}).encode() + b"\\n")
        print("forged", json.loads(sock.makefile().readline())["ok"], flush=True)
print("setup", time.time(), flush=True)
assert subprocess.call([sys.executable, "-m", "sidecar", "lifecycle", "running"]) == 0
print("training", time.time(), flush=True)
"""


def test_only_the_wrapped_command_hands_over_running_and_at_the_wrappers_time(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """As user `nobody`, a `running` with ts 0 was posted as 1970-01-01 (the billing start), and
    a ts of NaN recorded `running` unposted, so the real marker was then ignored."""
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--running-when", "marker", "--", *python_child(FORGED)], env,
                   tmp_path / "sc")
    assert done.status == 0, done.stderr
    text = done.stdout.decode()
    assert text.count("forged False") == 2, text
    assert ingest.events() == ["starting", "running", "succeeded"]
    running = epoch(ingest.records("lifecycle")[1]["ts"])
    assert stamp(text, "setup") < running < stamp(text, "training")


def test_lifecycle_command_outside_a_wrapper(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    assert sidecar(["lifecycle", "running"], env, tmp_path / "a").status == 0
    assert ingest.events() == ["running"]
    ingest.stop_listening()
    done = sidecar(["lifecycle", "failed", "--timeout", "1"], env, tmp_path / "b")
    assert done.status == 1
    assert b"not acknowledged" in done.stderr


def test_events_left_by_a_killed_sidecar_are_replayed_first_and_not_recorded_again(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """A wrapper started again for a run whose journal holds `running` (a restarted container,
    a SIGKILLed wrapper) posted a second `starting` and `running` after it."""
    ingest.stop_listening()
    env = platform_env(ingest, tmp_path / "state")
    first = Sidecar(["run", "--", *python_child("import time; time.sleep(60)")], env,
                    tmp_path / "one")
    journal = next_journal(tmp_path / "state")
    wait_until(lambda: journal.exists() and journal.stat().st_size > 0 and
               b"running" in journal.read_bytes(), 10, "running journaled")
    first.proc.kill()
    first.wait()
    ingest.start_listening()
    done = sidecar(["run", "--", *python_child("pass")], env, tmp_path / "two")
    assert done.status == 0
    assert ingest.events() == ["starting", "running", "succeeded"]
    assert "already holds starting, running from an earlier start" in done.stderr.decode()


def next_journal(state: Path) -> Path:
    return state / RUN_ID / "lifecycle.journal"


def test_missing_command_is_a_configuration_error(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run"], env, tmp_path / "sc")
    assert done.status == 2
    assert b"no command" in done.stderr
    missing = sidecar(["run", "--", "/nonexistent/train.sh"], env, tmp_path / "sc2")
    assert missing.status == 127
    assert ingest.events() == ["starting", "failed"]  # never running: nothing to bill
    assert ingest.log_text() == ("[sidecar] run failed: exit status 127 after 0s; likely cause: "
                                "cannot start '/nonexistent/train.sh': No such file or "
                                "directory\n")


def test_both_families_disagreeing_is_refused(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state", TUNEPLANE_JOB_ENABLED="1",
                       TUNEPLANE_JOB_RUN_ID="another-run")
    done = sidecar(["run", "--", *python_child("pass")], env, tmp_path / "sc")
    assert done.status == 2
    assert b"STARFORGE_RUN_ID" in done.stderr and b"TUNEPLANE_JOB_RUN_ID" in done.stderr


def test_tuneplane_family_sends_its_own_header(tmp_path: Path) -> None:
    with running_ingest(tmp_path / "rx", token=TOKEN, run_id=RUN_ID) as ingest:
        env = clean_environ()
        env.update(TUNEPLANE_JOB_ENABLED="1", TUNEPLANE_JOB_ENDPOINT=ingest.base_url,
                   TUNEPLANE_JOB_RUN_ID=RUN_ID, SIDECAR_STATE_DIR=str(tmp_path / "state"))
        token_file = tmp_path / "token"
        token_file.write_text(f"  {TOKEN}\n")
        done = sidecar(["run", "--token-file", str(token_file), "--", sys.executable, "-c",
                        "print(1)"], env, tmp_path / "sc")
        assert done.status == 0, done.stderr
        assert ingest.events() == ["starting", "running", "succeeded"]


ORPHAN_MAKER = """
import os, sys, time
pid = os.fork()
if pid == 0:
    if os.fork():
        os._exit(0)  # the grandchild is orphaned and adopted by PID 1
    print("orphan", os.getpid(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.5)
"""


def test_as_pid1_it_reaps_orphans(ingest: RunningIngest, tmp_path: Path) -> None:
    """Inside a PID namespace the sidecar is PID 1: an adopted orphan must not stay a zombie."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.call([unshare, "-fp", "--mount-proc", "true"]) != 0:
        pytest.skip("no PID namespaces here (unshare -fp needs root or user namespaces)")
    check = ("import sys, time\n"
             "pid = sys.argv[1]\n"
             "deadline = time.time() + 10\n"
             "while time.time() < deadline:\n"
             "    try: state = open(f'/proc/{pid}/stat').read().split()[2]\n"
             "    except FileNotFoundError: print('reaped'); break\n"
             "    time.sleep(0.05)\n"
             "else: print('zombie', state)\n")
    script = (f"{sys.executable} -c '{ORPHAN_MAKER}' > {tmp_path}/orphan; "
              f"{sys.executable} -c \"$CHECK\" $(cut -d' ' -f2 {tmp_path}/orphan)")
    env = platform_env(ingest, tmp_path / "state", CHECK=check)
    inner_state = f"SIDECAR_STATE_DIR={tmp_path / 'inner'}"  # the outer one holds its folder
    done = sidecar(["run", "--", unshare, "-fp", "--mount-proc", "--", "env", inner_state,
                    *SIDECAR, "run", "--", "sh", "-c", script], env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    assert b"reaped" in done.stdout, done.stdout


# 14 full requests of /metrics (2,048 points each), written at once, then the exit.
MANY_POINTS = """
import sys
with open(sys.argv[1], "w") as out:
    for step in range(14 * 2048):
        out.write(f'{{"step": {step}, "loss": 0.5}}\\n')
"""


def test_a_slow_metrics_route_is_given_the_whole_drain(ingest: RunningIngest,
                                                      tmp_path: Path) -> None:
    """/metrics answers in 1 s: the 14 requests take 14 s of a 20 s drain, and all of them
    arrive before the wrapper exits (it left at half the drain, 4,000 points short)."""
    ingest.add_fault(Fault(route="metrics", slow_answer_s=1.0))
    metrics = tmp_path / "metrics.jsonl"
    done = sidecar(["run", "--hardware-interval", "0", "--drain-timeout", "20", "--jsonl",
                    str(metrics), "--", *python_child(MANY_POINTS), str(metrics)],
                   platform_env(ingest, tmp_path / "state"), tmp_path / "sc", timeout=90)
    assert done.status == 0, done.stderr
    steps = sorted(p["step"] for body in ingest.records("metrics") for p in body["points"])
    assert steps == list(range(14 * 2048))
    assert [r["event"] for r in ingest.records("lifecycle")] == [
        "starting", "running", "succeeded"]
