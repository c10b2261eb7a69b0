"""LogFileParser: `--log` files -> /logs text, plain or Kubernetes CRI (docs/ingest.md#logs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.masking import Secrets
from sidecar.sources.console.lines import MAX_LINE_CHARS
from sidecar.sources.files.logfile import FIND_LINE_BYTES, LogFileParser, count_lines
from tests.conftest import cut_at

TOKEN = "tok-SECRET-0123456789abcdef"
TS = b"2026-11-30T10:00:00.123456789Z"


SECRETS = Secrets([TOKEN])


def cri(stream: str, tag: str, text: str | bytes, ts: bytes = TS) -> bytes:
    """One CRI log line as the kubelet writes it."""
    body = text.encode() if isinstance(text, str) else text
    return ts + b" " + stream.encode() + b" " + tag.encode() + b" " + body + b"\n"


@dataclass
class Fed:
    """What a run of parse calls produced, added up."""

    text: str = ""
    records: int = 0
    skipped: int = 0
    left: bytes = b""


def _follow(parser: LogFileParser, blocks: Sequence[bytes], now: float = 0.0) -> Fed:
    """Feed `blocks` as a follower does: the unconsumed rest is offered again with new bytes."""
    fed = Fed()
    for block in blocks:
        fed.left += block
        parsed = parser.parse(fed.left, now)
        assert 0 <= parsed.consumed <= len(fed.left)
        assert parsed.points == [] and parsed.hparams is None
        fed.left = fed.left[parsed.consumed:]
        fed.text += parsed.text
        fed.records += parsed.records
        fed.skipped += parsed.skipped
    return fed


# --- plain -----------------------------------------------------------------------------------


def test_plain_text_is_consumed_at_line_ends_only() -> None:
    parser = LogFileParser(log_format="plain")
    first = parser.parse(b"epoch 1\nepoch 2\nepo", 0.0)
    assert first.consumed == len(b"epoch 1\nepoch 2\n")
    assert first.text == "epoch 1\nepoch 2\n"
    assert first.records == 2
    assert parser.parse(b"epo", 0.0).consumed == 0
    done = parser.parse(b"epoch 3\n", 0.0)
    assert (done.consumed, done.text, done.records) == (8, "epoch 3\n", 1)


def test_plain_quiet_takes_a_partial_line_and_the_rest_continues_it() -> None:
    parser = LogFileParser(log_format="plain", prefix="[n1] ")
    assert parser.parse(b"Downloading weights", 0.0).consumed == 0
    quiet = parser.quiet(b"Downloading weights", 1.5)
    assert (quiet.consumed, quiet.text) == (len(b"Downloading weights"), "[n1] Downloading weights")
    rest = parser.parse(b" done\nnext\n", 2.0)
    assert rest.text == " done\n[n1] next\n"  # the continuation is not prefixed again


def test_plain_quiet_with_nothing_takes_nothing() -> None:
    parser = LogFileParser(log_format="plain")
    assert parser.quiet(b"", 5.0).consumed == 0


def test_plain_quiet_keeps_a_split_utf8_character_for_the_continuation() -> None:
    parser = LogFileParser(log_format="plain")
    quiet = parser.quiet(b"caf\xc3", 5.0)
    assert quiet.consumed == 4
    rest = parser.parse(b"\xa9 ok\n", 6.0)
    assert quiet.text + rest.text == "café ok\n"


def test_plain_invalid_utf8_is_replaced_not_fatal() -> None:
    fed = _follow(LogFileParser(log_format="plain"), [b"ok \xff\xfe bad\n\xc3\x28\n"])
    assert fed.text == "ok \ufffd\ufffd bad\n\ufffd(\n"


def test_plain_line_without_newline_longer_than_the_limit_is_passed_in_pieces() -> None:
    parser = LogFileParser(log_format="plain")
    size = 3 * MAX_LINE_CHARS + 10
    flood = parser.parse(b"a" * size, 0.0)
    assert flood.consumed == size  # not held back waiting for a newline that may never come
    assert flood.text.count("\n") >= 2
    text = flood.text + parser.parse(b"end\n", 0.0).text
    lines = text.split("\n")
    assert lines[-1] == ""
    assert all(len(line) <= MAX_LINE_CHARS for line in lines)
    assert "".join(lines) == "a" * size + "end"


def test_plain_masks_secrets_and_prefixes_every_line() -> None:
    parser = LogFileParser(log_format="plain", secrets=SECRETS, prefix="[gpu-node-3] ")
    parsed = parser.parse(f"token={TOKEN}\nloss 0.5\n".encode(), 0.0)
    assert parsed.text == "[gpu-node-3] token=***\n[gpu-node-3] loss 0.5\n"
    assert TOKEN not in parsed.text


def test_plain_forwards_a_cri_looking_line_verbatim() -> None:
    line = cri("stdout", "F", "hello")
    fed = _follow(LogFileParser(log_format="plain"), [line])
    assert fed.text == line.decode()


_plain_piece = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\b\x1b"),
            max_size=10).map(str.encode),
    st.sampled_from([b"\n", b"\xc3", b"\xa9", b"\xff", "é€😀".encode()]))


@settings(max_examples=150, deadline=None)
@given(data=st.lists(_plain_piece, max_size=30).map(b"".join),
       cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=20))
def test_plain_split_anywhere_gives_the_text_of_its_whole_lines(
        data: bytes, cuts: list[int]) -> None:
    fed = _follow(LogFileParser(log_format="plain"), cut_at(data, cuts))
    whole_lines = data[: data.rfind(b"\n") + 1]
    assert fed.text == whole_lines.decode("utf-8", "replace")
    assert fed.left == data[len(whole_lines):]
    assert fed.records == data.count(b"\n")


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 9, 99, FIND_LINE_BYTES - 1, FIND_LINE_BYTES,
                                         FIND_LINE_BYTES + 1, 1023, 70_000]), max_size=60),
       tail=st.integers(min_value=0, max_value=2000), cut=st.integers(min_value=0))
def test_count_lines_is_the_newlines_before_the_end_whatever_the_line_lengths(
        lengths: list[int], tail: int, cut: int) -> None:
    """Long lines counted newline to newline, short ones byte by byte, and every mix of them
    (long lines first, then short: where the count changes its way) gives bytes.count."""
    data = b"".join(b"x" * length + b"\n" for length in lengths) + b"y" * tail
    end = cut % (len(data) + 1)
    assert count_lines(data, end) == data.count(b"\n", 0, end)


def test_count_lines_of_long_lines_then_short_ones() -> None:
    data = (b"x" * 1023 + b"\n") * 100 + b"step 1\n" * 10_000
    assert count_lines(data, len(data)) == 10_100
    assert count_lines(data, 1024 * 50 + 3) == 50
    assert count_lines(b"no newline", 10) == 0


# --- CRI -------------------------------------------------------------------------------------


def test_cri_forwards_only_the_text() -> None:
    fed = _follow(LogFileParser(log_format="cri"),
                  [cri("stdout", "F", "epoch 1 loss 0.5") + cri("stderr", "F", "warning: x")])
    assert fed.text == "epoch 1 loss 0.5\nwarning: x\n"
    assert (fed.records, fed.skipped) == (2, 0)


def test_cri_empty_line_and_inner_spaces_are_kept() -> None:
    fed = _follow(LogFileParser(log_format="cri"),
                  [cri("stdout", "F", "") + cri("stdout", "F", "  two  spaces ")])
    assert fed.text == "\n  two  spaces \n"


def test_cri_partial_pieces_are_joined_up_to_the_f_per_stream() -> None:
    data = (cri("stdout", "P", "out-a ") + cri("stderr", "P", "err-a ")
            + cri("stdout", "P", "out-b ") + cri("stderr", "F", "err-end")
            + cri("stdout", "F", "out-end"))
    fed = _follow(LogFileParser(log_format="cri"), [data])
    assert fed.text == "err-a err-end\nout-a out-b out-end\n"
    assert fed.records == 2


def test_cri_partial_pieces_wait_across_calls() -> None:
    parser = LogFileParser(log_format="cri")
    first = parser.parse(cri("stdout", "P", "half of "), 0.0)
    assert first.consumed == len(cri("stdout", "P", "half of "))
    assert first.text == ""
    second = parser.parse(cri("stdout", "F", "a line"), 0.0)
    assert second.text == "half of a line\n"


def test_cri_unfinished_line_waits_and_quiet_never_takes_it() -> None:
    parser = LogFileParser(log_format="cri")
    line = cri("stdout", "F", "complete")
    parsed = parser.parse(line + line[:20], 0.0)
    assert (parsed.consumed, parsed.text) == (len(line), "complete\n")
    quiet = parser.quiet(line[:20], 10.0)
    assert (quiet.consumed, quiet.text) == (0, "")


@pytest.mark.parametrize("bad", [
    b"garbage", b"", b"2026-11-30T10:00:00Z stdin F text", b"2026-11-30T10:00:00Z stdout X text",
    b"2026-11-30 10:00:00Z stdout F text", b"stdout F text", b"2026-11-30T10:00:00Z stdout"])
def test_cri_malformed_line_is_skipped_and_counted(bad: bytes) -> None:
    fed = _follow(LogFileParser(log_format="cri"),
                  [cri("stdout", "F", "before") + bad + b"\n" + cri("stdout", "F", "after")])
    assert fed.text == "before\nafter\n"
    assert (fed.records, fed.skipped) == (2, 1)


def test_cri_masks_and_prefixes_the_joined_line() -> None:
    half = len(TOKEN) // 2
    parser = LogFileParser(log_format="cri", secrets=SECRETS, prefix="[n2] ")
    data = (cri("stdout", "P", f"token={TOKEN[:half]}") + cri("stdout", "F", TOKEN[half:])
            + cri("stderr", "F", "x"))
    fed = _follow(parser, [data])
    assert fed.text == "[n2] token=***\n[n2] x\n"


def test_cri_text_with_invalid_utf8_is_replaced() -> None:
    fed = _follow(LogFileParser(log_format="cri"), [cri("stdout", "F", b"bad \xff end")])
    assert fed.text == "bad \ufffd end\n"


_cri_entry = st.tuples(
    st.sampled_from(["stdout", "stderr"]), st.sampled_from(["P", "F"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n\b\x1b"), max_size=8))


@settings(max_examples=150, deadline=None)
@given(entries=st.lists(_cri_entry, max_size=20),
       cuts=st.lists(st.integers(min_value=0, max_value=1500), max_size=25))
def test_cri_split_anywhere_reassembles_each_stream(
        entries: list[tuple[str, str, str]], cuts: list[int]) -> None:
    data = b"".join(cri(stream, tag, text) for stream, tag, text in entries)
    expected, open_pieces = "", {"stdout": "", "stderr": ""}
    for stream, tag, text in entries:
        open_pieces[stream] += text
        if tag == "F":
            expected += open_pieces[stream] + "\n"
            open_pieces[stream] = ""
    fed = _follow(LogFileParser(log_format="cri"), cut_at(data, cuts))
    assert fed.text == expected
    assert fed.left == b""
    assert fed.records == sum(tag == "F" for _, tag, _ in entries)


# --- auto ------------------------------------------------------------------------------------


def test_auto_detects_cri_on_the_first_whole_line_and_remembers_it() -> None:
    parser = LogFileParser(log_format="auto")
    assert parser.state() == {"format": "auto"}
    assert parser.parse(TS + b" stdout F not yet", 0.0).consumed == 0
    assert parser.state() == {"format": "auto"}  # no whole line yet: undecided
    fed = _follow(parser, [cri("stdout", "F", "hello") + b"not cri\n" + cri("stderr", "F", "x")])
    assert fed.text == "hello\nx\n"
    assert fed.skipped == 1
    assert parser.state() == {"format": "cri"}


def test_auto_detects_plain_and_then_forwards_cri_looking_lines_verbatim() -> None:
    parser = LogFileParser(log_format="auto")
    later = cri("stdout", "F", "looks like cri")
    fed = _follow(parser, [b"Starting training\n", later])
    assert fed.text == "Starting training\n" + later.decode()
    assert parser.state() == {"format": "plain"}


def test_auto_detection_survives_a_resume() -> None:
    parser = LogFileParser(log_format="auto")
    _follow(parser, [cri("stdout", "F", "first")])
    resumed = LogFileParser.resume(parser.state(), log_format="auto")
    # After a restart the first line it sees is from the middle of the file; it must still
    # be read as CRI even though this line alone would not be detected as such.
    fed = _follow(resumed, [b"not a cri line\n" + cri("stdout", "F", "second")])
    assert fed.text == "second\n"
    assert fed.skipped == 1
    plain = LogFileParser.resume({"format": "plain"}, log_format="auto")
    assert _follow(plain, [cri("stdout", "F", "x")]).text == cri("stdout", "F", "x").decode()


def test_resume_from_undecided_state_still_detects() -> None:
    parser = LogFileParser.resume({"format": "auto"}, log_format="auto")
    assert _follow(parser, [cri("stderr", "F", "e")]).text == "e\n"
    assert LogFileParser.resume({}, log_format="auto").state() == {"format": "auto"}


def test_auto_quiet_before_detection_takes_a_plain_partial_line() -> None:
    parser = LogFileParser(log_format="auto")
    quiet = parser.quiet(b"Enter password: ", 5.0)
    assert (quiet.consumed, quiet.text) == (16, "Enter password: ")


def test_auto_applies_mask_and_prefix_in_both_formats() -> None:
    for data in (f"k={TOKEN}\n".encode(), cri("stdout", "F", f"k={TOKEN}")):
        parser = LogFileParser(log_format="auto", secrets=SECRETS, prefix="[r0] ")
        assert _follow(parser, [data]).text == "[r0] k=***\n"


# --- bugs found --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"2026-11-30T10:00:00Z stdout Fx text",
                                 b"2026-11-30Tjunk stdout F text"], ids=["tag", "time"])
def test_cri_loosely_malformed_line_is_skipped(bad: bytes) -> None:
    fed = _follow(LogFileParser(log_format="cri"), [bad + b"\n"])
    assert (fed.text, fed.skipped) == ("", 1)
