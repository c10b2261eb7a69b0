"""Secrets masked out of every text the sidecar writes or sends: its own messages, the command's
output, followed log files (docs/ingest.md#logs).

The rule: nothing sent or written holds RUN_CHARS consecutive characters of a secret, whatever
surrounds them. A part of a secret is a secret too: the first characters of a token a progress
bar then redraws, what a read or a quiet spell cut, what a redraw left showing. So every run of
RUN_CHARS characters of a secret (its *pieces*; a shorter secret is one piece, itself) is
masked, wherever it is found: in the raw output, before a terminal model draws it, and again in
what the terminal shows (a redraw can put pieces together).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sidecar.process import held

MASK = "***"
# A shorter token is refused at start (config.check_token): masking it would blank pieces of
# ordinary words.
MIN_SECRET_CHARS = 4
# a run of this many characters of a secret is masked: 8 characters of a random token are as
# unlikely in ordinary text as the token, and fewer would mask pieces of ordinary words
RUN_CHARS = 8
# every run of RUN_CHARS characters holds one of a secret's pieces of this many that start at a
# multiple of it: those are what is looked for, and each found is followed out both ways
ANCHOR_CHARS = RUN_CHARS // 2
# a block whose first PROBE_BYTES hold one of a secret's anchors more often than once in
# DENSE_BYTES is masked whole: ordinary output holds a 4-character piece of a random token now
# and then, text built of the token's own characters everywhere, and looking at each place
# would cost a search each (a megabyte of one letter against a token of 18 of it: 0.5 s)
PROBE_BYTES = 4096
DENSE_BYTES = 256


class Secrets:
    """Every secret this process has used (a token re-read after a 401 adds the new one).

    The command's output is masked in its raw bytes (`mask_raw`) at a cost that depends on
    neither the secret nor the text (CPython's str.find, keyed on the low 6 bits of each
    character, was fifteen times slower on a line of one repeated letter for one token than for
    another). Each secret's pieces are looked for in two steps:
    - a gate: a piece one of whose bytes the block lacks is not there. Each test is a memchr;
      the bytes that ruled pieces out are tried first next time, so a text keeps hitting the
      bytes it lacks, whatever the secret (a line of `x`s is decided by the few memchrs that
      rule out every piece of a token).
    - then one SIMD search for the secret's pieces (ahocorasick_rs), only in a block that holds
      every byte of one of them. That search alone fell to 0.1 GB/s on a line of one byte the
      pieces hold (a candidate at every byte): the gate takes such a line out first.
    Our own messages, short, take the same path (`mask`).
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: list[_Secret] = []
        self._pieces_text: list[str] = []  # every secret's pieces
        self._starts_text: set[str] = set()  # their proper beginnings
        self._starts: set[bytes] = set()  # the same, as UTF-8
        self._start_bytes = 0  # bytes of the longest of them
        self._bytes: set[int] = set()  # every byte of a piece
        self._longest_raw = 0  # bytes of the longest secret
        self.longest = 0  # characters of the longest secret
        for secret in secrets:
            self.add(secret)

    def forget(self) -> None:
        """No secret any more, as at start."""
        self._secrets.clear()
        self._pieces_text.clear()
        self._starts_text.clear()
        self._starts.clear()
        self._start_bytes = 0
        self._bytes.clear()
        self._longest_raw = 0
        self.longest = 0

    def add(self, secret: str) -> None:
        """Mask `secret` from now on (a shorter one than MIN_SECRET_CHARS is ignored)."""
        if len(secret) < MIN_SECRET_CHARS or any(known.text == secret for known in self._secrets):
            return
        added = _Secret(secret)
        self._secrets.append(added)
        self.longest = max(self.longest, len(secret))
        self._pieces_text += [piece.decode("utf-8", "surrogatepass") for piece in added.pieces]
        self._starts_text |= {piece[:size] for piece in self._pieces_text
                              for size in range(1, len(piece))}
        self._starts |= {piece[:size] for piece in added.pieces for size in range(1, len(piece))}
        self._start_bytes = max(map(len, self._starts))
        self._bytes |= {byte for piece in added.pieces for byte in piece}
        self._longest_raw = max(self._longest_raw, len(added.raw))

    def mask(self, text: str) -> str:
        """`text` with every run of a secret replaced by ***."""
        if not any(piece in text for piece in self._pieces_text):
            return text
        raw = text.encode("utf-8", "surrogatepass")
        return bytes(self.mask_raw(raw, final=True)[0]).decode("utf-8", "surrogatepass")

    def unfinished(self, text: str) -> int:
        """How many characters at the end of `text` could begin a run of a secret (a state of
        a line sent while the secret is still being written must not show them)."""
        starts = self._starts_text
        return next((size for size in range(min(RUN_CHARS - 1, len(text)), 0, -1)
                     if text[-size:] in starts), 0)

    def mask_raw(self, data: bytes | memoryview,
                 final: bool = False) -> tuple[bytes | memoryview, int]:
        """Raw output -> (the masked form of all of `data` but its last `keep` bytes, `keep`):
        every run of a secret replaced by *** (runs that touch or overlap as one ***), and the
        end of `data` that could begin one kept back, unmasked, for the caller to put before
        the next block (none when `final`), so that a run cut by a read is masked whole. The
        first is `data` itself when it holds no run and keeps nothing (no copy)."""
        if not self._secrets:
            return data, 0
        keep = 0 if final else self._unfinished_raw(data)
        end_at = len(data) - keep
        whole = _searchable(data)
        spans = sorted(span for secret in self._secrets
                       for span in secret.runs(data, secret.possible(whole)))
        if keep and spans:
            start, stop = max(spans, key=lambda span: span[1])
            if start < end_at <= stop and len(data) - start <= 2 * self._longest_raw:
                # a run the read cut: kept whole, to be masked as one with its rest
                keep, end_at = len(data) - start, start
        pieces: list[bytes | memoryview] = []
        end = 0
        for start, stop in spans:
            if start >= end_at:
                break
            if start > end:
                pieces += (data[end:start], _MASK_BYTES)
            elif not pieces:
                pieces.append(_MASK_BYTES)  # a run at the very start
            end = max(end, min(stop, end_at))
        if not pieces:
            return (data[:end_at] if keep else data), keep
        pieces.append(data[end:end_at])
        return b"".join(pieces), keep

    def _unfinished_raw(self, data: bytes | memoryview) -> int:
        """How many bytes at the end of `data` could begin a run of a secret."""
        if not data or data[-1] not in self._bytes:
            return 0
        tail = bytes(data[-self._start_bytes:])
        starts = self._starts
        return next((size for size in range(len(tail), 0, -1) if tail[-size:] in starts), 0)


class _Secret:
    """One secret: its anchors (every run of RUN_CHARS characters holds one of its aligned
    pieces of ANCHOR_CHARS; a shorter secret is its own anchor), the gate over their bytes and
    one search each (memchr's memmem: a single pattern's search has no candidate flood)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.raw = text.encode("utf-8", "surrogatepass")
        self.run_chars = min(RUN_CHARS, len(text))
        # characters of `raw` before each byte offset
        self._chars = [len(self.raw[:at].decode("utf-8", "ignore")) for at in
                       range(len(self.raw) + 1)]
        starts = [0] if len(text) < RUN_CHARS else range(0, len(text) - ANCHOR_CHARS + 1,
                                                          ANCHOR_CHARS)
        size = len(text) if len(text) < RUN_CHARS else ANCHOR_CHARS
        offsets: dict[bytes, list[int]] = {}  # each anchor -> where it is in `raw`
        for start in starts:
            anchor = text[start:start + size].encode("utf-8", "surrogatepass")
            offsets.setdefault(anchor, []).append(len(text[:start].encode("utf-8",
                                                                          "surrogatepass")))
        self.pieces = [text[start:start + RUN_CHARS].encode("utf-8", "surrogatepass")
                       for start in range(max(len(text) - RUN_CHARS, 0) + 1)]
        self._anchors = list(offsets)
        self._offsets = list(offsets.values())
        self._all = (1 << len(self._anchors)) - 1  # a bit an anchor
        # for each byte of an anchor, the anchors without it
        self._lacking = {byte: sum(1 << i for i, anchor in enumerate(self._anchors)
                                   if byte not in anchor)
                         for byte in {byte for anchor in self._anchors for byte in anchor}}
        self._order = sorted(self._lacking, key=_RARE_FIRST.index)  # the order the gate tries
        self._finders: list[Any] = []  # built at the first output

    def possible(self, data: bytes | bytearray) -> int:
        """The anchors `data` may hold (a bit each): not those that lack a byte `data` lacks
        (the bytes that ruled anchors out are tried first next time)."""
        alive = self._all
        order = self._order
        lacking = self._lacking
        for position, byte in enumerate(order):
            if not alive & ~lacking[byte] or byte in data:
                continue  # no anchor still possible holds it, or `data` does
            alive &= lacking[byte]
            if position:
                order.insert(0, order.pop(position))
            if not alive:
                break
        return alive

    def runs(self, data: bytes | memoryview, possible: int) -> list[tuple[int, int]]:
        """Where runs of at least `run_chars` characters of the secret are in `data`, each as
        far as `data` goes on with the secret both ways."""
        if not self._finders:
            self._finders = _finders(self._anchors)
        found: list[tuple[int, int]] = []
        for index, finder in enumerate(self._finders):
            if not possible >> index & 1:
                continue
            size = len(self._anchors[index])
            if len(data) > 4 * PROBE_BYTES and self._dense(data, index):
                # text made of the secret's own characters (a line of one letter against a
                # token of that letter): its runs cost a look each, so it is masked whole
                return [(0, len(data))]
            for _, start, _ in finder.find_matches_as_indexes(data, overlapping=True):
                if found and start + size <= found[-1][1]:
                    continue  # inside the run found last
                for offset in self._offsets[index]:
                    run = self._run(data, start, offset, size)
                    if run is not None:
                        found.append(run)
        return found

    def _dense(self, data: bytes | memoryview, index: int) -> bool:
        """Whether the start of `data` holds the anchor `index` more often than once in
        DENSE_BYTES, most of the first places as parts of runs (not a common word that is also
        a piece of the token)."""
        places = self._finders[index].find_matches_as_indexes(data[:PROBE_BYTES])
        if len(places) <= PROBE_BYTES // DENSE_BYTES:
            return False
        size = len(self._anchors[index])
        runs = sum(any(self._run(data, start, offset, size) for offset in self._offsets[index])
                   for _, start, _ in places[:3])
        return runs >= 2

    def _run(self, data: bytes | memoryview, start: int, offset: int,
             size: int) -> tuple[int, int] | None:
        """The run around the anchor at `start` of `data`, `offset` of the secret, when it is
        long enough to mask."""
        raw = self.raw
        before = _common(lambda n: data[start - n:start] == raw[offset - n:offset],
                         min(start, offset))
        end = start + size
        after = _common(lambda n: data[end:end + n] == raw[offset + size:offset + size + n],
                        min(len(data) - end, len(raw) - offset - size))
        if self._chars[offset + size + after] - self._chars[offset - before] < self.run_chars:
            return None
        return start - before, end + after


def _common(same: Callable[[int], bool], most: int) -> int:
    """The largest n <= `most` for which `same(n)` holds (it holds for every smaller n)."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if same(middle):
            low = middle
        else:
            high = middle - 1
    return low


_MASK_BYTES = MASK.encode()
_COMMON = b" etaoinsrhldcumfpgwybvkxjqz0123456789.,:;-_/=()[]'\"ETAOINSRHLDCUMFPGWYBVKXJQZ"
# Bytes, the rarest in ordinary output first: the order a secret's gate starts with, before a
# text has said which of its bytes it lacks.
_RARE_FIRST = [byte for byte in range(256) if byte not in _COMMON] + list(reversed(_COMMON))


def _searchable(data: bytes | memoryview) -> bytes | bytearray:
    """What the gate looks in: `data`, or the buffer a view of it is of when it is not much
    larger. A buffer that lacks a byte has no view that holds it, and a copy of the view (a
    file's block up to its last newline) cost more than the search it saves."""
    if isinstance(data, memoryview):
        whole = data.obj
        if isinstance(whole, (bytes, bytearray)) and len(whole) <= 2 * data.nbytes:
            return whole
        return data.tobytes()
    return data


def _finders(anchors: list[bytes]) -> list[Any]:
    """One search for each anchor. Imported here: a process that prints nothing (a `watch` of
    metrics alone, `sidecar check`) never loads it."""
    from ahocorasick_rs import BytesAhoCorasick, MatchKind

    return [BytesAhoCorasick([anchor], matchkind=MatchKind.Standard) for anchor in anchors]


secrets = Secrets()
add_secret = secrets.add
mask = secrets.mask
held(secrets.forget)


def holds_secret(text: str) -> bool:
    """Whether `text` holds a run of a secret that `mask` would hide."""
    return mask(text) != text


def mask_doc(doc: Any) -> Any:
    """A JSON document with every string in it masked, keys too (a followed file's path), and
    its numbers as they are: masking its text instead would turn a number that holds 8 digits of
    a token into `***`, and the document into something no reader parses."""
    if isinstance(doc, str):
        return mask(doc)
    if isinstance(doc, dict):
        return {mask(str(key)): mask_doc(value) for key, value in doc.items()}
    if isinstance(doc, list | tuple):
        return [mask_doc(item) for item in doc]
    return doc
