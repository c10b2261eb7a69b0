"""LineAssembler: bytes of one output stream -> text for /logs (docs/ingest.md#logs)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.masking import Secrets
from sidecar.sources.console.lines import (
    MAX_LINE_CHARS,
    PROGRESS_INTERVAL_S,
    QUIET_FLUSH_S,
    LineAssembler,
)
from tests.conftest import cut_at

TOKEN = "tok-SECRET-0123456789abcdef"
PREFIX = "[n1] "


SECRETS = Secrets([TOKEN])


def _feed_all(asm: LineAssembler, blocks: Sequence[bytes], now: float = 0.0) -> list[str]:
    """Feed every block at the same instant (no quiet tick), then finish."""
    return [asm.feed(block, now) for block in blocks] + [asm.finish()]


def _lines(text: str) -> list[str]:
    """`text` cut after each newline only (str.splitlines also cuts at \\r, \\x0b, ...)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _prefixed(text: str, prefix: str) -> str:
    return "".join(prefix + line for line in _lines(text))


# Bytes without a bare carriage return: text (multibyte included), CRLF and LF line ends,
# and invalid UTF-8 (stray continuation bytes, truncated sequences, overlongs).
_piece = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\b\x1b"),
            max_size=12).map(lambda s: s.encode("utf-8")),
    st.sampled_from([b"\n", b"\r\n", b"\xc3", b"\xa9", b"\xe2\x82", b"\xf0\x9f\x98", b"\xff",
                     b"\xc0\xaf", b"\xed\xa0\x80", "é€😀".encode()]),
)
_no_cr_data = st.lists(_piece, max_size=40).map(b"".join)
_cuts = st.lists(st.integers(min_value=0, max_value=400), max_size=30)


# --- decoding and splitting into blocks ------------------------------------------------------


@given(data=_no_cr_data, cuts=_cuts)
def test_any_split_gives_the_one_shot_decoding(data: bytes, cuts: list[int]) -> None:
    out = _feed_all(LineAssembler(), cut_at(data, cuts))
    assert "".join(out) == data.decode("utf-8", "replace")


@given(data=_no_cr_data, cuts=_cuts)
def test_feed_without_a_quiet_tick_returns_only_whole_lines(data: bytes, cuts: list[int]) -> None:
    asm = LineAssembler()
    for block in cut_at(data, cuts):
        out = asm.feed(block, 0.0)
        assert out == "" or out.endswith("\n")
        assert asm.tick(QUIET_FLUSH_S / 2) == ""


def test_multibyte_character_split_byte_by_byte_survives() -> None:
    data = "naïve € 😀\r\n".encode()
    out = _feed_all(LineAssembler(), [data[i:i + 1] for i in range(len(data))])
    assert "".join(out) == "naïve € 😀\r\n"
    assert out[-2] == "naïve € 😀\r\n"  # the whole line at once, with the byte that ended it


def test_crlf_split_across_blocks_is_kept_as_is() -> None:
    asm = LineAssembler()
    assert asm.feed(b"epoch 1\r", 0.0) == ""
    assert asm.feed(b"\nepoch 2\r", 0.0) == "epoch 1\r\n"
    assert asm.feed(b"\n", 0.0) == "epoch 2\r\n"
    assert asm.finish() == ""


@pytest.mark.parametrize("data", [b"ok\xff\xfe\n", b"\x80abc\n", b"\xe2\x82x\n", b"\xed\xa0\x80\n"])
def test_invalid_utf8_becomes_replacement_characters(data: bytes) -> None:
    out = "".join(_feed_all(LineAssembler(), [data[:2], data[2:]]))
    assert out == data.decode("utf-8", "replace")
    assert "\ufffd" in out


@settings(max_examples=200)
@given(data=st.binary(max_size=600), cuts=_cuts,
       times=st.lists(st.floats(min_value=0, max_value=5), max_size=30))
def test_random_bytes_never_raise(data: bytes, cuts: list[int], times: list[float]) -> None:
    asm = LineAssembler(prefix=PREFIX, secrets=SECRETS, max_line_chars=16)
    now = 0.0
    out: list[str] = []
    for i, block in enumerate(cut_at(data, cuts)):
        out.append(asm.feed(block, now))
        now += times[i] if i < len(times) else 0.5
        out.append(asm.tick(now))
    out.append(asm.gap(3))
    out.append(asm.feed(data, now))
    out.append(asm.finish())
    assert all(isinstance(chunk, str) for chunk in out)
    if b"\r" not in data and b"\xff" in data:
        assert "\ufffd" in "".join(out)


# --- quiet partial lines ---------------------------------------------------------------------


def test_partial_line_goes_out_only_after_a_quiet_second() -> None:
    asm = LineAssembler()
    assert asm.feed(b"loading weights", 10.0) == ""
    assert asm.tick(10.5) == ""
    assert asm.tick(10.0 + QUIET_FLUSH_S - 0.001) == ""
    assert asm.tick(10.0 + QUIET_FLUSH_S) == "loading weights"
    assert asm.tick(20.0) == ""  # nothing repeated
    assert asm.feed(b"... done\nnext", 21.0) == "... done\n"
    assert asm.tick(21.5) == ""  # the quiet second counts from the latest feed
    assert asm.finish() == "next"


def test_quiet_flush_keeps_a_split_multibyte_character_whole() -> None:
    asm = LineAssembler()
    assert asm.feed(b"loss \xe2\x82", 0.0) == ""
    assert asm.tick(QUIET_FLUSH_S) == "loss "
    assert asm.feed(b"\xac 1\n", 2.0) == "€ 1\n"


@given(data=_no_cr_data, cuts=_cuts,
       pauses=st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), max_size=30))
def test_quiet_ticks_lose_and_repeat_nothing(data: bytes, cuts: list[int],
                                              pauses: list[float]) -> None:
    asm = LineAssembler(prefix=PREFIX)
    out: list[str] = []
    now = 0.0
    for i, block in enumerate(cut_at(data, cuts)):
        out.append(asm.feed(block, now))
        last_feed = now
        now += pauses[i] if i < len(pauses) else 0.0
        flushed = asm.tick(now)
        if flushed:
            assert now - last_feed >= QUIET_FLUSH_S
        out.append(flushed)
    out.append(asm.finish())
    assert "".join(out) == _prefixed(data.decode("utf-8", "replace"), PREFIX)


# --- over-long lines -------------------------------------------------------------------------


def _line_chars(n: int, salt: int = 0) -> str:
    """`n` characters without newline whose order is checkable."""
    return "".join(chr(0x41 + (i * 7 + salt) % 26) for i in range(n))


def test_long_line_in_one_block_is_split_and_nothing_lost() -> None:
    body = _line_chars(3 * MAX_LINE_CHARS + 5)
    asm = LineAssembler()
    out = asm.feed((body + "\nshort\n").encode(), 0.0) + asm.finish()
    lines = out.split("\n")
    assert lines[-1] == ""
    assert all(len(line) <= MAX_LINE_CHARS for line in lines)
    assert [len(line) for line in lines[:-2]] == [MAX_LINE_CHARS] * 3 + [5]
    assert "".join(lines[:-2]) == body
    assert lines[-2] == "short"


def test_line_of_exactly_the_limit_is_not_split() -> None:
    body = _line_chars(MAX_LINE_CHARS)
    asm = LineAssembler()
    assert asm.feed(body.encode(), 0.0) == ""
    assert asm.feed(b"\n", 0.0) == body + "\n"


def test_long_line_over_many_blocks_is_split_with_bounded_memory() -> None:
    body = _line_chars(5 * MAX_LINE_CHARS + 1234).encode()
    asm = LineAssembler()
    out: list[str] = []
    fed = 0
    for i in range(0, len(body), 4096):
        out.append(asm.feed(body[i:i + 4096], 0.0))
        fed += len(body[i:i + 4096])
        emitted = sum(len(chunk.replace("\n", "")) for chunk in out)
        assert fed - emitted <= MAX_LINE_CHARS  # what is held back stays within one line's limit
    out.append(asm.feed(b"\n", 0.0))
    out.append(asm.finish())
    text = "".join(out)
    assert all(len(line) <= MAX_LINE_CHARS for line in text.split("\n"))
    assert text.replace("\n", "") == body.decode()
    assert text.endswith("\n")


@settings(max_examples=300)
@given(lines=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=20),
       limit=st.integers(min_value=1, max_value=9))
def test_split_lines_respect_the_limit_for_any_blocks(lines: list[int], cuts: list[int],
                                                      limit: int) -> None:
    text = "".join(_line_chars(n, salt=i) + "\n" for i, n in enumerate(lines))
    data = text.encode()
    out = "".join(_feed_all(LineAssembler(max_line_chars=limit), cut_at(data, cuts)))
    assert all(len(line) <= limit for line in out.split("\n"))
    assert out.replace("\n", "") == text.replace("\n", "")
    assert out.endswith("\n")


def test_line_of_twice_the_limit_gives_no_empty_line() -> None:
    body = _line_chars(2 * MAX_LINE_CHARS)
    asm = LineAssembler()
    out = asm.feed(body.encode(), 0.0) + asm.feed(b"\n", 0.0) + asm.finish()
    assert out == body[:MAX_LINE_CHARS] + "\n" + body[MAX_LINE_CHARS:] + "\n"


def test_line_continued_after_a_quiet_flush_still_respects_the_limit() -> None:
    asm = LineAssembler()
    half = MAX_LINE_CHARS * 5 // 8
    out = asm.feed(b"x" * half, 0.0) + asm.tick(QUIET_FLUSH_S)
    out += asm.feed(b"y" * half + b"\n", 2.0) + asm.finish()
    assert out.replace("\n", "") == "x" * half + "y" * half
    assert all(len(line) <= MAX_LINE_CHARS for line in out.split("\n"))


def test_long_text_after_a_carriage_return_is_split() -> None:
    asm = LineAssembler()
    out = [asm.feed(b"\r", 0.0)]
    for i in range(48):
        out.append(asm.feed(b"z" * 4096, i * 0.1))
    out.append(asm.feed(b"\n", 5.0))
    text = "".join(out)
    assert text.endswith("z\n")
    assert all(len(line) <= MAX_LINE_CHARS for line in text.split("\n"))


# --- progress bars ---------------------------------------------------------------------------


def _bar_state(i: int, total: int = 1000) -> str:
    done = i * 20 // total
    bar = "#" * done + " " * (20 - done)
    return f"{i * 100 // total:3d}%|{bar}| {i}/{total} [00:{i // 100:02d}]"


def test_tqdm_stream_collapses_to_a_few_real_states() -> None:
    asm = LineAssembler()
    duration_s, updates = 10.0, 1000
    states = [_bar_state(i) for i in range(1, updates + 1)]
    out: list[str] = []
    for i, state in enumerate(states):
        now = i * duration_s / updates
        out.append(asm.feed(("\r" + state).encode(), now))
        if i % 25 == 0:
            out.append(asm.tick(now))  # the caller ticks while the bar is still moving
    out.append(asm.feed(b"\n", duration_s))
    out.append(asm.finish())
    text = "".join(out)
    assert "\r" not in text
    lines = text.split("\n")
    assert lines[-1] == ""
    lines = lines[:-1]
    assert 2 <= len(lines) <= duration_s / PROGRESS_INTERVAL_S + 2
    assert set(lines) <= set(states)
    assert lines[-1] == states[-1]
    assert lines == sorted(lines, key=states.index)  # in the order they happened


def test_stalled_bar_shows_its_latest_state_after_a_quiet_second() -> None:
    asm = LineAssembler()
    first = asm.feed(b"\r 10%|##  |\r 20%|####|", 0.0)
    assert first == " 20%|####|\n"
    assert asm.feed(b"\r 30%|######|", 0.5) == ""  # too soon after the last state sent
    assert asm.tick(0.9) == ""
    assert asm.tick(0.5 + QUIET_FLUSH_S) == " 30%|######|\n"
    assert asm.tick(5.0) == ""  # unchanged state is not repeated
    assert asm.feed(b"\r100%|########|\n", 6.0) == "100%|########|\n"


def test_bar_final_state_is_sent_when_the_stream_ends_without_newline() -> None:
    asm = LineAssembler()
    out = asm.feed(b"\r 1/3", 0.0) + asm.feed(b"\r 2/3", 0.1) + asm.feed(b"\r 3/3", 0.2)
    out += asm.finish()
    assert out == " 1/3\n 3/3"


def test_bar_followed_by_ordinary_lines_in_one_block() -> None:
    asm = LineAssembler()
    out = asm.feed(b"epoch 1\n\r 50%\r100%\nepoch 2\n", 0.0) + asm.finish()
    assert out == "epoch 1\n100%\nepoch 2\n"


# --- masking ---------------------------------------------------------------------------------


def test_token_is_masked_when_split_at_any_byte_across_two_blocks() -> None:
    line = f"export STARFORGE_TOKEN={TOKEN} # é\n".encode()
    start = line.index(TOKEN.encode())
    for cut in range(start, start + len(TOKEN) + 1):
        asm = LineAssembler(secrets=SECRETS)
        out = "".join(_feed_all(asm, [b"before\n" + line[:cut], line[cut:] + b"after\n"]))
        assert TOKEN not in out
        assert out == "before\nexport STARFORGE_TOKEN=*** # é\nafter\n"


@given(before=st.text(max_size=20).filter(lambda s: not set(s) & set("\r\n\b\x1b")),
       cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=6))
def test_token_never_appears_in_output(before: str, cuts: list[int]) -> None:
    data = f"{before}{TOKEN}{before}\n{TOKEN}\n".encode()
    out = "".join(_feed_all(LineAssembler(secrets=SECRETS, prefix=PREFIX), cut_at(data, cuts)))
    assert TOKEN not in out
    assert out == _prefixed(f"{before}***{before}\n***\n", PREFIX)


def test_token_printed_in_two_writes_a_quiet_spell_apart_is_masked() -> None:
    """A quiet partial keeps back what could be the start of a secret until the next block."""
    for cut in range(1, len(TOKEN)):
        asm = LineAssembler(secrets=SECRETS)
        out = [asm.feed(f"export T={TOKEN[:cut]}".encode(), 0.0), asm.tick(QUIET_FLUSH_S)]
        out += [asm.feed(f"{TOKEN[cut:]} ok\n".encode(), 1.6), asm.finish()]
        assert "".join(out) == "export T=*** ok\n", cut


def test_quiet_partial_ending_in_a_token_start_goes_out_at_the_end() -> None:
    asm = LineAssembler(secrets=SECRETS)
    out = asm.feed(("prompt " + TOKEN[:5]).encode(), 0.0) + asm.tick(QUIET_FLUSH_S)
    assert TOKEN[:5] not in out
    assert out + asm.finish() == "prompt " + TOKEN[:5]


@pytest.mark.parametrize("blocks", [1, 7])
def test_token_straddling_the_line_split_is_masked(blocks: int) -> None:
    """Masking comes before the 64 KiB split, in one block or over many (the line then waits
    as an over-long partial)."""
    for offset in (1, 5, len(TOKEN) - 1):
        line = ("a" * (MAX_LINE_CHARS - offset) + TOKEN + "b" * 10 + "\n").encode()
        step = -(-len(line) // blocks)
        asm = LineAssembler(secrets=SECRETS)
        out = "".join(_feed_all(asm, [line[i:i + step] for i in range(0, len(line), step)]))
        assert out.replace("\n", "") == "a" * (MAX_LINE_CHARS - offset) + "***" + "b" * 10
        assert all(len(part) <= MAX_LINE_CHARS for part in out.split("\n"))


def test_every_secret_added_is_masked_and_the_longest_wins() -> None:
    secrets = Secrets(["tok-first-000000"])
    secrets.add("tok-first-000000-and-longer")
    secrets.add("tok-1")  # the README's own: 4 characters are enough to be masked
    secrets.add("abc")  # too short to be a secret (refused at start): never masked inside words
    assert secrets.mask("a tok-first-000000-and-longer b tok-first-000000 tok-1 abc") == \
        "a *** b *** *** abc"
    assert secrets.mask_raw(b"a tok-first-000000-and-longer b tok-first-000000 tok-1 abc") == \
        (b"a *** b *** *** abc", 0)
    assert secrets.longest == len("tok-first-000000-and-longer")


def test_raw_masking_merges_overlapping_secrets_and_keeps_back_what_could_begin_one() -> None:
    secrets = Secrets(["abcdXY", "XYZW", "tok-7777"])
    assert secrets.mask_raw(b"abcdXYZW!") == (b"***!", 0)  # overlapping: one mask, no fragment
    # the kept end is not in the masked part: the caller puts it before the next block
    assert secrets.mask_raw(b"tok-7777tok-7777 tok-") == (b"*** ", 4)
    assert secrets.mask_raw(b"abcdXYZ") == (b"", 7)  # a run that may go on waits whole
    assert secrets.mask_raw(b"abcdXYZ", final=True) == (b"***Z", 0)
    assert secrets.mask_raw(b"x abcdX") == (b"x ", 5)
    view = memoryview(b"nothing secret here")
    assert secrets.mask_raw(view) == (view, 0)  # the caller's buffer, not a copy
    assert secrets.mask_raw(view)[0] is view
    assert secrets.mask_raw(memoryview(b"a tok-7777 b Q")[:10]) == (b"a ***", 0)  # a file's slice
    assert secrets.mask_raw(memoryview(b"a b tok-7777")[:3])[0] == b"a b"


def test_every_run_of_eight_characters_of_a_secret_is_masked() -> None:
    """A part of a secret is a secret: its first characters before a redraw, what a cut left."""
    secrets = Secrets([TOKEN])
    for start in range(len(TOKEN) - 7):
        for stop in range(start + 8, len(TOKEN) + 1):
            assert secrets.mask(f"a {TOKEN[start:stop]} b") == "a *** b"
    assert secrets.mask(f"a {TOKEN[:7]} b {TOKEN[-7:]}") == f"a {TOKEN[:7]} b {TOKEN[-7:]}"
    assert secrets.unfinished("a " + TOKEN[3:9]) == 6


def test_a_block_made_of_a_secrets_characters_is_masked_whole_and_fast() -> None:
    """A megabyte of one letter against a token of 18 of that letter and two others: every
    8 characters of it are a run of the token, so nothing of it may go out; looked at run by
    run it took half a second a block (the bench's worst cell: 0.002 GB/s)."""
    secrets = Secrets(["D" * 18 + "tt"])
    assert secrets.mask_raw(b"D" * (1 << 20) + b"\n", final=True)[0] == b"***"
    ordinary = b"".join(b"step %06d loss DDDD\n" % i for i in range(1000))
    assert secrets.mask_raw(ordinary, final=True)[0] == ordinary  # a piece now and then stays


OVERWRITES = ["\r", "\x1b[1K\r", "\x1b[2K\r", "\x1b[2K\x1b[1G", "\x1b[40D", "\b" * 30,
              "\x1b[1A\n\r"]


@pytest.mark.parametrize("overwrite", OVERWRITES)
@given(cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=6))
def test_a_token_overwritten_by_a_progress_bar_leaves_nothing_of_it(overwrite: str,
                                                                   cuts: list[int]) -> None:
    """The terminal would show what the bar did not cover (`  0% |###|cret-0123...`): the
    token is masked in the raw output, before the terminal model draws it."""
    data = f"login with {TOKEN}{overwrite}  0% |###|\n 50% |#####|\rdone\n".encode()
    for tick in (False, True):
        asm = LineAssembler(secrets=SECRETS)
        out = []
        for i, block in enumerate(cut_at(data, cuts)):
            out.append(asm.feed(block, i * 2.0))
            if tick:
                out.append(asm.tick(i * 2.0 + QUIET_FLUSH_S))
        text = "".join(out) + asm.finish()
        assert not any(TOKEN[i:i + 8] in text for i in range(len(TOKEN) - 7)), text
        assert "done" in text


# --- prefix ----------------------------------------------------------------------------------


def test_prefix_once_per_line_across_a_quiet_flush() -> None:
    asm = LineAssembler(prefix=PREFIX)
    out = [asm.feed(b"epoch 1 ", 0.0), asm.tick(QUIET_FLUSH_S)]
    assert out == ["", "[n1] epoch 1 "]
    out.append(asm.feed(b"loss=0.5\nepoch 2\n", 3.0))
    assert out[-1] == "loss=0.5\n[n1] epoch 2\n"
    out.append(asm.feed(b"\n", 3.0))
    out.append(asm.finish())
    assert "".join(out) == "[n1] epoch 1 loss=0.5\n[n1] epoch 2\n[n1] \n"


def test_prefix_on_split_long_lines_and_bar_states() -> None:
    asm = LineAssembler(prefix=PREFIX, max_line_chars=4)
    out = asm.feed(b"abcdefghij\n\r1/2\r2/2\n", 0.0) + asm.finish()
    assert out == "[n1] abcd\n[n1] efgh\n[n1] ij\n[n1] 2/2\n"


# --- gaps ------------------------------------------------------------------------------------


def _assert_gap_line(line: str, dropped: int) -> None:
    assert str(dropped) in line
    assert "dropped" in line


def test_gap_closes_the_line_and_says_how_much_was_dropped() -> None:
    asm = LineAssembler()
    assert asm.feed(b"step 1\nstep 2 lo", 0.0) == "step 1\n"
    out = asm.gap(4096)
    first, second, rest = out.split("\n")
    assert first == "step 2 lo"
    _assert_gap_line(second, 4096)
    assert rest == ""
    assert asm.feed(b"step 9\n", 1.0) == "step 9\n"


def test_gap_on_a_closed_line_adds_just_the_notice() -> None:
    asm = LineAssembler(prefix=PREFIX)
    assert asm.feed(b"a\n", 0.0) == "[n1] a\n"
    out = asm.gap(7)
    assert out.startswith(PREFIX)
    assert out.endswith("\n")
    assert out.count("\n") == 1
    _assert_gap_line(out, 7)


def test_gap_drops_a_half_received_character() -> None:
    asm = LineAssembler()
    assert asm.feed(b"x\xe2\x82", 0.0) == ""
    out = asm.gap(5)
    assert out.startswith("x\ufffd\n")
    _assert_gap_line(out.split("\n")[1], 5)
    assert asm.feed(b"fresh\n", 1.0) == "fresh\n"


def test_gap_after_a_quiet_flush_starts_its_own_line() -> None:
    asm = LineAssembler()
    out = asm.feed(b"partial", 0.0) + asm.tick(QUIET_FLUSH_S) + asm.gap(10)
    lines = out.split("\n")
    assert lines[0] == "partial"
    assert len(lines) == 3
    _assert_gap_line(lines[1], 10)


def test_final_state_already_sent_when_quiet_is_not_repeated() -> None:
    asm = LineAssembler()
    assert asm.feed(b"\r" + _bar_state(500).encode(), 0.0) == _bar_state(500) + "\n"
    assert asm.feed(b"\r" + _bar_state(1000).encode(), 0.5) == ""
    assert asm.tick(2.0) == _bar_state(1000) + "\n"  # quiet: the latest state goes out
    assert asm.feed(b"\n", 2.5) == ""  # the line ends on that same state: no second copy
    assert asm.feed(b"next\n", 2.6) == "next\n"
