"""What a terminal shows is what /logs gets: real programs drawing progress bars through
`sidecar run`, compared with the screen of a real terminal emulator (pyte) fed the raw output."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import tracemalloc
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import pyte
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar.masking import Secrets
from sidecar.observe.address import STATUS_ADDR_FILE
from sidecar.sources.console.lines import MAX_LINE_CHARS, LineAssembler
from sidecar.sources.console.terminal import Screen
from tests.conftest import RUN_ID, SIDECAR, TOKEN, platform_env, python_child, sidecar
from tests.ingest_server import RunningIngest, running_ingest, wait_until

WIDTH = 400  # columns of the oracle terminal: no line of these programs wraps
OWN_MESSAGE = re.compile(rb"^\d{4}-\d\d-\d\dT[0-9:.]+Z sidecar .*\n", re.M)
CURSOR_MOVE = re.compile(r"\x1b\[[0-9;]*[ABCDEFGHJKf]")

NESTED_TQDM = """
import sys, time
from tqdm import tqdm
for epoch in tqdm(range(3), desc="epoch", position=0, file=sys.stdout):
    for step in tqdm(range(120), desc="batch", position=1, leave=False, file=sys.stdout,
                     mininterval=0):
        time.sleep(0.01)
    tqdm.write(f"epoch {epoch} loss=0.{epoch}3", file=sys.stdout)
print("training done")
"""

THREE_BARS = """
import sys, time
from tqdm import tqdm
bars = [tqdm(total=50, desc=name, position=i, file=sys.stdout, mininterval=0)
        for i, name in enumerate(("load", "train", "eval"))]
for step in range(50):
    for bar in bars:
        bar.update(1)
    time.sleep(0.005)
for bar in reversed(bars):
    bar.close()
print("all three done")
"""

RICH_PROGRESS = """
import time
from rich.console import Console
from rich.progress import Progress
console = Console(force_terminal=True, width=100)
with Progress(console=console, refresh_per_second=50) as progress:
    download = progress.add_task("download", total=40)
    unpack = progress.add_task("unpack", total=40)
    for step in range(40):
        progress.update(download, advance=1)
        progress.update(unpack, advance=1)
        if step == 20:
            progress.console.print("halfway there")
        time.sleep(0.01)
print("rich done")
"""

KERAS_BACKSPACES = """
import sys, time
previous = 0
for step in range(1, 31):
    done = step * 20 // 30
    line = f"{step}/30 [" + "=" * done + ">" + "." * (20 - done) + f"] - loss: {1 / step:.4f}"
    sys.stdout.write("\\b" * previous + line)
    sys.stdout.flush()
    previous = len(line)
    time.sleep(0.005)
sys.stdout.write("\\n")
print("Epoch 2/2")
"""

PIP_BARS = """
import sys, time
sys.stdout.write("Collecting torch\\n  Downloading torch-2.3.0.whl (780 MB)\\n")
sys.stdout.write("\\x1b[?25l")
for i in range(41):
    bar = "\\u2501" * i + " " * (40 - i)
    sys.stdout.write(f"\\r     \\x1b[38;5;197m{bar}\\x1b[0m {i * 19.5:.1f}/780.0 MB "
                     f"2.1 MB/s eta 0:00:{40 - i:02d}")
    sys.stdout.flush()
    time.sleep(0.005)
sys.stdout.write("\\x1b[?25h\\n")
print("Successfully installed torch-2.3.0")
"""

LINES_BETWEEN_UPDATES = """
import sys, time
from tqdm import tqdm
outer = tqdm(total=3, desc="epochs", position=0, file=sys.stdout)
for epoch in range(3):
    inner = tqdm(total=30, desc="steps", position=1, leave=False, file=sys.stdout, mininterval=0)
    for step in range(30):
        inner.update(1)
        if step % 10 == 9:
            tqdm.write(f"epoch {epoch} checkpoint at step {step + 1}", file=sys.stdout)
        time.sleep(0.003)
    inner.close()
    outer.update(1)
outer.close()
print("bye")
"""

BAR_THEN_TRACEBACK = """
import time
from tqdm import tqdm
for epoch in tqdm(range(2), desc="epoch", position=0):
    for step in tqdm(range(100), desc="train", position=1, mininterval=0):
        time.sleep(0.003)
        if epoch == 1 and step == 60:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
"""


def screen_lines(raw: bytes) -> list[str]:
    """Every line a terminal shows of `raw`, its scrollback first, without blank ones."""
    screen = pyte.HistoryScreen(WIDTH, 24, history=10_000)
    stream = pyte.Stream(screen)
    stream.feed(raw.decode("utf-8", "replace").replace("\n", "\r\n"))  # as onlcr would
    history = ["".join(line[x].data for x in range(WIDTH)) for line in screen.history.top]
    return [line.rstrip() for line in history + screen.display if line.strip()]


def arrived(ingest: RunningIngest) -> str:
    return "".join(c for r in ingest.records("logs") for c in r["chunks"])


def assert_in_order(shown: list[str], text: str) -> None:
    """Each line the terminal shows is a whole line of `text`, in the same order."""
    lines = text.split("\n")
    position = 0
    for line in shown:
        try:
            position = lines.index(line, position) + 1
        except ValueError:
            raise AssertionError(f"{line!r} missing (or out of order) in what arrived:\n"
                                 + "\n".join(lines)) from None


@pytest.mark.parametrize("program", [
    NESTED_TQDM, THREE_BARS, RICH_PROGRESS, KERAS_BACKSPACES, PIP_BARS, LINES_BETWEEN_UPDATES],
    ids=["nested-tqdm", "three-bars", "rich-progress", "keras-backspaces", "pip-bars",
         "lines-between-updates"])
def test_what_arrives_is_what_a_terminal_shows(ingest: RunningIngest, tmp_path: Path,
                                              program: str) -> None:
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child(program)], env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    text = arrived(ingest)
    assert_in_order(screen_lines(done.stdout), text)
    assert "\x1b" not in text  # strip: no escape sequence of any kind
    assert "\r" not in text and "\b" not in text


def test_bar_interrupted_by_a_traceback(ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state", SIDECAR_LOG_LEVEL="error")
    done = sidecar(["run", "--", *python_child(BAR_THEN_TRACEBACK)], env, tmp_path / "sc")
    assert done.status == 1
    text = arrived(ingest)
    shown = screen_lines(OWN_MESSAGE.sub(b"", done.stderr))  # the child's output alone
    assert shown[-1] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert_in_order(shown, text)
    assert not CURSOR_MOVE.search(text) and "\r" not in text


def test_nested_bars_send_a_line_per_epoch_and_per_bar_every_few_seconds(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """Three epochs of a 120-step inner bar: not one line per redraw (360 of them), but the
    epoch lines, and each bar's state at most once per 3 s of the run, and its final state."""
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child(NESTED_TQDM)], env, tmp_path / "sc")
    assert done.status == 0, done.stderr
    lines = arrived(ingest).splitlines()
    run_s = 3 * 120 * 0.01 * 1.5  # the sleeps, and slack for a loaded machine
    bound = 3 + 1 + 2 * (int(run_s / 3.0) + 2)  # epochs, the last line, each bar per 3 s
    assert len(lines) <= bound, lines
    assert sum(line.startswith("batch:") for line in lines) <= int(run_s / 3.0) + 2, lines


TOKEN_UNDER_A_BAR = """
import os, sys, time
token = os.environ["STARFORGE_TOKEN"]
half = len(token) // 2
for erase in ["\\r", "\\x1b[1K\\r", "\\x1b[2K\\r", "\\x1b[40D", "\\b" * 8]:
    sys.stdout.write("login " + token[:half])  # the token in two writes a moment apart
    sys.stdout.flush()
    time.sleep(0.05)
    sys.stdout.write(token[half:] + erase + "  0% |###|")  # then a bar drawn over it
    sys.stdout.flush()
    time.sleep(0.05)
    print(flush=True)
sys.stderr.write("fatal: rejected " + token + "\\r" + "retrying\\n")
sys.exit(int(sys.argv[1]))
"""


def _pieces(token: str, size: int) -> list[str]:
    return [token[i:i + size] for i in range(len(token) - size + 1)]


def test_a_token_overwritten_by_a_progress_bar_never_reaches_the_ingest(
        ingest: RunningIngest, tmp_path: Path) -> None:
    """A terminal shows what a bar did not cover of a token printed before it
    (`  0% |###|cret-0123...`): the output is masked before the terminal model draws it."""
    env = platform_env(ingest, tmp_path / "state")
    done = sidecar(["run", "--", *python_child(TOKEN_UNDER_A_BAR), "3"], env, tmp_path / "sc")
    assert done.status == 3, done.stderr
    text = arrived(ingest)
    assert text.count("  0% |###|") == 5 and "retrying" in text, text
    ours = b"".join(OWN_MESSAGE.findall(done.stderr)).decode()
    assert "failed" in ours, ours  # the failure summary, which quotes the last line
    for where in (text, ours):
        assert not any(piece in where for piece in _pieces(TOKEN, 8)), where


@pytest.mark.parametrize("token", ["tok-1", "tok-7ch"])
def test_a_short_token_is_masked_in_the_output_the_summary_and_our_messages(
        tmp_path: Path, token: str) -> None:
    with running_ingest(tmp_path / "received", token=token, run_id=RUN_ID) as ingest:
        env = platform_env(ingest, tmp_path / "state", STARFORGE_TOKEN=token)
        code = "import os, sys; t = os.environ['STARFORGE_TOKEN']; print('key=' + t); " \
               "sys.exit('error: bad key ' + t)"
        done = sidecar(["run", "--", *python_child(code)], env, tmp_path / "sc")
        assert done.status == 1, done.stderr
        text = arrived(ingest)
    assert "key=***\n" in text and "bad key ***" in text, text
    ours = b"".join(OWN_MESSAGE.findall(done.stderr)).decode()
    assert "bad key ***" in ours, ours  # the failure summary quotes the last line
    assert token not in text and token not in ours


def test_a_token_too_short_to_be_masked_is_refused_before_the_command_runs(
        ingest: RunningIngest, tmp_path: Path) -> None:
    env = platform_env(ingest, tmp_path / "state", STARFORGE_TOKEN="ab1")
    ran = tmp_path / "ran"
    done = sidecar(["run", "--", *python_child(f"open({str(ran)!r}, 'w')")], env, tmp_path / "sc")
    assert done.status == 2
    assert not ran.exists()
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "STARFORGE_TOKEN" in lines[0] and "too short" in lines[0], lines
    assert "ab1" not in lines[0]
    assert not ingest.records("lifecycle") and not ingest.records("logs")


ESCAPE_FLOOD = """
import os, random, sys, time
go, stamp = sys.argv[1:]
moves = [b"\\x1b[A", b"\\x1b[2B", b"\\x1b[5C", b"\\x1b[3D", b"\\x1b[K", b"\\x1b[2K", b"\\x1b[1K",
         b"\\x1b]0;epoch 3 step 41\\x07", b"\\x1b[10G", b"\\r", b"ab", b"\\x1b[2A", b"\\x1b[E"]
rng = random.Random(6)
block = b"".join(rng.choice(moves) for _ in range(300_000))[:1 << 20]
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
for _ in range(70):  # 70 MB of cursor moves, erases and window titles, as fast as it goes
    sys.stdout.buffer.write(block)
sys.stdout.buffer.write(b"\\nflood over\\n")
sys.stdout.flush()
with open(stamp, "w") as f:
    f.write(repr(time.time()))
"""


PROBE = """
import json, sys, time, urllib.error, urllib.request
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
waits = []
while True:  # until the endpoint closes, on the sidecar's way out
    started = time.monotonic()
    try:
        with direct.open(sys.argv[1], timeout=5) as answer:
            assert answer.status == 200
    except (TimeoutError, urllib.error.URLError) as exc:
        if not isinstance(getattr(exc, "reason", exc), TimeoutError):
            break
    except OSError:
        break
    waits.append(time.monotonic() - started)
print(json.dumps(waits))
"""


def test_an_escape_flood_never_holds_up_the_loop(ingest: RunningIngest, tmp_path: Path) -> None:
    """The terminal model draws a slice a turn of the loop, and drops what it is too far behind
    to draw: the end event is stamped when the command exited, and /healthz answers at once all
    through the flood (asked from a process of its own: this one holds the ingest)."""
    state = tmp_path / "state"
    env = platform_env(ingest, state, SIDECAR_STATUS_ADDR="127.0.0.1:0")
    go, stamp = tmp_path / "go", tmp_path / "exited"
    run = subprocess.Popen(  # its output to /dev/null: 70 MB of a file would be written back
        [*SIDECAR, "run", "--", *python_child(ESCAPE_FLOOD), str(go), str(stamp)], env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: any(state.rglob(STATUS_ADDR_FILE)), 30, "the status address")
    url = f"http://{next(state.rglob(STATUS_ADDR_FILE)).read_text().strip()}/healthz"
    probe = subprocess.Popen([*python_child(PROBE), url], stdout=subprocess.PIPE, text=True)
    go.touch()
    stderr = run.communicate(timeout=60)[1]
    waits = json.loads(probe.communicate(timeout=30)[0])
    assert run.returncode == 0, stderr
    # No call of the loop lasts 20 ms here and the slowest answer takes 15-25 ms on a quiet
    # machine; a busy one can keep the probe itself waiting for a core, hence the percentile.
    assert len(waits) >= 10, waits
    assert sorted(waits)[len(waits) * 9 // 10] < 0.1 and max(waits) < 0.5, sorted(waits)[-5:]
    end = ingest.records("lifecycle")[-1]
    assert end["event"] == "succeeded"
    assert abs(datetime.fromisoformat(end["ts"]).timestamp() - float(stamp.read_text())) < 0.5
    assert "bytes of output were dropped here" in arrived(ingest)
    assert b"no answer within" not in stderr, stderr


# --- the terminal model, fed directly ----------------------------------------------------------


def feed_all(asm: LineAssembler, blocks: list[bytes], now: float = 0.0) -> str:
    return "".join(asm.feed(block, now) for block in blocks) + asm.finish()


def test_cursor_moves_and_erasing_as_a_terminal_applies_them() -> None:
    raw = (b"abcdef\x1b[3Dxy\x1b[K\n"  # back 3, overwrite, erase to the end
           b"12345\x1b[2G-\x1b[1K+\n"  # column 2, erase to the start
           b"gone\x1b[2Kkept\n"  # erase the whole line, the column stays
           b"one\ntwo\x1b[Fthree\x1b[E"  # previous line, next line
           b"back\b\bck\n")
    assert feed_all(LineAssembler(), [raw]) == screen_text(raw)


def screen_text(raw: bytes) -> str:
    return "".join(line + "\n" for line in screen_lines(raw))


def test_an_escape_sequence_cut_by_a_block_end_is_still_applied() -> None:
    raw = b"\r 10%\x1b[2K\r 20%\n\x1b[1A\x1b[38;5;197mdone\x1b[0m\n"
    for cut in range(len(raw)):
        out = feed_all(LineAssembler(), [raw[:cut], raw[cut:]])
        assert "\x1b" not in out and out.endswith("done\n") and out.count("done") == 1, cut


@pytest.mark.parametrize(("mode", "expected"), [
    ("strip", "loss 0.5 ok\n"), ("keep", "loss \x1b[1;31m0.5\x1b[0m ok\n")])
def test_log_ansi_keeps_colours_only_when_asked(mode: str, expected: str) -> None:
    raw = b"\x1b]0;window title\x07\x1b[?25lloss \x1b[1;31m0.5\x1b[0m ok\x1b[?25h\n"
    assert feed_all(LineAssembler(keep_sgr=mode == "keep"), [raw]) == expected
    plain = b"loss \x1b[1;31m0.5\x1b[0m ok\n"  # colours alone take the fast path, same result
    assert feed_all(LineAssembler(keep_sgr=mode == "keep"), [plain]) == expected


def test_line_left_downwards_is_final_after_the_hold_unless_the_cursor_comes_back() -> None:
    asm = LineAssembler()
    assert asm.feed(b"\rbar 1\n\rinner 1\x1b[A", 0.0) == "bar 1\ninner 1\n"  # first states
    assert asm.feed(b"\rbar 2\ntext\x1b[A", 1.0) == ""  # redrawn within 3 s: nothing yet
    assert asm.tick(1.5) == ""
    assert asm.tick(2.5) == "bar 2\ntextr 1\n"  # quiet: the latest states
    assert asm.feed(b"\n\n", 3.0) == ""  # the cursor leaves both downwards
    assert asm.tick(5.9) == ""
    assert asm.tick(6.0) == ""  # final now, and already sent in that state: not again
    assert asm.feed(b"after\n", 7.0) == "after\n"  # nothing held: the fast path again


def test_a_line_sent_is_redrawn_when_the_cursor_goes_back_up_into_it() -> None:
    """tqdm's first redraw of a lower bar may come in another block than the line feed that
    made room for it: the line above, already sent, is drawn on again, not the line below."""
    asm = LineAssembler()
    out = asm.feed(b"\repoch 0/3", 0.0) + asm.feed(b"\n", 0.0)
    out += asm.feed(b"\rbatch 0/9\x1b[A\repoch 1/3", 0.1) + asm.finish()
    assert out == "epoch 0/3\nepoch 1/3\nbatch 0/9"


def test_a_million_cursor_ups_and_a_ten_megabyte_line_take_bounded_memory() -> None:
    tracemalloc.start()
    asm = LineAssembler()
    out = [asm.feed(b"top\n\x1b[999999999A\x1b[999999999B\x1b[999999999D\x1b[999999999C", 0.0)]
    for _ in range(10):
        out.append(asm.feed(b"\x1b[A" * 100_000, 0.0))
    line = b"x" * (10 << 20)
    for start in range(0, len(line), 1 << 20):
        out.append(asm.feed(b"\r" + line[start:start + (1 << 20)], 1.0))
    out.append(asm.finish())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 20
    text = "".join(out)
    assert text.startswith("top\n")
    assert all(len(part) <= MAX_LINE_CHARS for part in text.split("\n"))


def test_token_straddling_a_wrapped_line_is_masked() -> None:
    """A line longer than the limit wraps on the terminal as it does at the split of the fast
    path: masking still comes first."""
    token = "tok-SECRET-0123456789abcdef"
    for offset in (1, 9, len(token) - 1):
        raw = ("\r" + "a" * (40 - offset) + token + "b" * 50 + "\n").encode()
        for cut in (len(raw) // 2, len(raw)):
            asm = LineAssembler(secrets=Secrets([token]), max_line_chars=40)
            out = feed_all(asm, [raw[:cut], raw[cut:]])
            final = "a" * (40 - offset) + "***" + "b" * 50  # wrapped; states of it may come first
            assert out.replace("\n", "").endswith(final), (offset, cut)
            assert "tok-" not in out and "SECRET" not in out
            assert all(len(line) <= 40 for line in out.split("\n"))


def test_a_state_sent_while_a_secret_is_being_written_does_not_show_its_start() -> None:
    token = "tok-SECRET-0123456789abcdef"
    asm = LineAssembler(secrets=Secrets([token]))
    out = asm.feed(f"\rlogin with {token[:20]}".encode(), 0.0) + asm.tick(5.0)
    assert token[:2] not in out and out.startswith("login with")
    out += asm.feed(f"{token[20:]} ok\n".encode(), 6.0) + asm.finish()
    assert out.endswith("login with *** ok\n") and token[:20] not in out


_redraw = st.one_of(
    st.text(alphabet="ab #%|0123456789", max_size=12).map(lambda s: "\r" + s),
    st.text(alphabet="xyz 0123456789", max_size=12).map(lambda s: "\n\r" + s + "\x1b[A"),
    st.text(alphabet="uvw", max_size=6).map(lambda s: "\n\n\r" + s + "\x1b[A\x1b[A"),
    st.sampled_from(["\n", "\x1b[A", "\x1b[2K", "\b", "\x1b[3G", "done\n"]))


@settings(max_examples=300)
@given(pieces=st.lists(_redraw, max_size=60), repeat=st.integers(min_value=1, max_value=4))
def test_skipped_redraws_change_nothing_a_terminal_shows(pieces: list[str], repeat: int) -> None:
    """However the redraws of a flood are thinned before they are applied, every line the
    terminal shows is sent, in order."""
    raw = ("".join(pieces) * repeat).encode()
    assert_in_order(screen_lines(raw), feed_all(LineAssembler(), [raw], now=0.0))


class _CountingScreen(Screen):
    """The terminal model, counting what each call is given."""

    fed: ClassVar[list[int]] = []

    def feed(self, text: str, now: float, more: bool = False) -> str:
        self.fed.append(len(text))
        return super().feed(text, now, more)


@settings(max_examples=200)
@given(pieces=st.lists(_redraw, max_size=60), cuts=st.lists(st.integers(0, 600), max_size=5),
       slice_chars=st.integers(min_value=1, max_value=40))
# a cleared line left in one slice, the cursor back up to it in the next: what was written
# there went to the line below (the cleared row was not kept for a cursor coming back)
@example(pieces=["\r0", "\x1b[2K", "\n\r0\x1b[A"], cuts=[], slice_chars=1)
def test_drawing_a_slice_a_call_shows_what_a_terminal_shows(pieces: list[str], cuts: list[int],
                                                            slice_chars: int) -> None:
    """With the work per call bounded, whatever the blocks and the slices (an escape sequence
    cut included), each call draws at most a slice, and every line the terminal shows is sent,
    in order, once the backlog is drawn."""
    raw = ("\x1b[2K" + "".join(pieces) + "end\n").encode()
    _CountingScreen.fed.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sidecar.sources.console.lines.Screen", _CountingScreen)
        asm = LineAssembler(screen_slice_chars=slice_chars)
        points = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
        out = [asm.feed(raw[a:b], 0.0) for a, b in itertools.pairwise(points)]
        while asm.backlog:
            out.append(asm.resume(0.0))
        out.append(asm.finish())
    assert max(_CountingScreen.fed) <= slice_chars + 8  # and an escape sequence cut before
    assert_in_order(screen_lines(raw), "".join(out))


def test_a_gap_while_the_terminal_is_behind_comes_after_what_it_has_to_draw() -> None:
    asm = LineAssembler(screen_slice_chars=4)
    out = asm.feed(b"\x1b[2Kfirst line\nsecond\r", 0.0) + asm.gap(1000)
    assert asm.backlog and "dropped" not in out
    while asm.backlog:
        out += asm.resume(0.0)
    out += asm.feed(b"after\n", 0.0) + asm.finish()
    assert out == "first line\nsecond\n[sidecar] 1000 bytes of output were dropped here\nafter\n"
