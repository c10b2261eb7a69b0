"""Secrets masked out of every text the sidecar writes or sends: its own messages, the command's
output, followed log files."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MASK = "***"
# A shorter token is refused at start (config.check_token): masking it would blank pieces of
# ordinary words.
MIN_SECRET_CHARS = 4


class Secrets:
    """Every secret this process has used (a token re-read after a 401 adds the new one).

    Our own messages, short, are masked with str.replace. The command's output is masked in its
    raw bytes (`mask_raw`), before a terminal model renders it or a line is cut, so that its cost
    depends on neither the secret nor the text (CPython's str.find, keyed on the low 6 bits of
    each character, was fifteen times slower on a line of one repeated letter for one token
    than for another). Each secret is looked for in two steps:
    - a gate: one of its bytes that the block lacks means it is not there. Each test is a
      memchr; the byte found missing last is tried first, so a text keeps hitting the byte it
      lacks, whatever the secret (a token of `x`s and one `0`, against a line of `x`s, is
      decided by one memchr for its `0`).
    - then a SIMD substring search (ahocorasick_rs, whose search for one pattern is the memchr
      crate's memmem), only in a block holding every byte of the secret. That search alone
      fell to 0.4 GB/s for such a token on such a line, and one automaton for all the secrets
      to 0.14 GB/s on a line of a byte they share: hence one search a secret, behind its gate.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: list[str] = []  # the longest first: it may hold a shorter one
        self._raw: list[bytes] = []  # the same, as UTF-8
        self._gates: list[list[int]] = []  # each secret's distinct bytes, in the order tried
        self._finders: list[Any] = []  # one search each, built at the first output
        self.longest = 0  # characters of the longest
        self._longest_raw = 0  # bytes of the longest in UTF-8 (not the longest in characters)
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str) -> None:
        """Mask `secret` from now on (a shorter one than MIN_SECRET_CHARS is ignored)."""
        if len(secret) < MIN_SECRET_CHARS or secret in self._secrets:
            return
        self._secrets = sorted([*self._secrets, secret], key=len, reverse=True)
        self._raw = [known.encode("utf-8") for known in self._secrets]
        self._gates = [sorted(set(raw), key=_RARE_FIRST.index) for raw in self._raw]
        self._finders = []
        self.longest = max(self.longest, len(secret))
        self._longest_raw = max(map(len, self._raw))

    def mask(self, text: str) -> str:
        """`text` with every known secret replaced by ***."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def unfinished(self, text: str) -> int:
        """How many characters at the end of `text` could be the start of a secret (a state
        of a line sent while the secret is still being written must not show that start)."""
        tail = text[-self.longest:]
        return max((size for secret in self._secrets for size in range(len(secret) - 1, 0, -1)
                    if tail.endswith(secret[:size])), default=0)

    def mask_raw(self, data: bytes | memoryview) -> tuple[bytes | memoryview, int]:
        """`data`, raw output, with every secret in it replaced by *** (secrets that overlap
        as one ***), and how many bytes at its end, after the last secret, could be the start
        of one: the caller keeps them for the next block, so that a secret cut by a read is
        masked whole. `data` itself when it holds none (no copy)."""
        if not self._raw:
            return data, 0
        if not self._finders:
            self._finders = _finders(self._raw)
        whole = _searchable(data)
        spans = sorted(match[1:] for gate, finder in zip(self._gates, self._finders, strict=True)
                       if _may_hold(gate, whole) for match in finder.find_matches_as_indexes(data))
        end = 0
        if spans:
            pieces: list[bytes | memoryview] = []
            for start, stop in spans:
                if start > end:
                    pieces += (data[end:start], _MASK_BYTES)
                elif not pieces:
                    pieces.append(_MASK_BYTES)  # a secret at the very start
                end = max(end, stop)
            pieces.append(data[end:])
            data = b"".join(pieces)
            end = len(data) - len(pieces[-1])
        return data, self._unfinished_raw(data, end)

    def _unfinished_raw(self, data: bytes | memoryview, start: int) -> int:
        """How many bytes at the end of `data`, none before `start`, could begin a secret."""
        tail = bytes(data[max(len(data) - self._longest_raw + 1, start):])
        longest = 0
        for secret in self._raw:
            first = secret[:1]
            at = tail.find(first, max(len(tail) - len(secret) + 1, 0))
            while at >= 0 and len(tail) - at > longest:
                if secret.startswith(tail[at:]):
                    longest = len(tail) - at
                    break
                at = tail.find(first, at + 1)
        return longest


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


def _may_hold(gate: list[int], data: bytes | bytearray) -> bool:
    """False when `data` lacks one of the bytes in `gate` (which then goes first)."""
    for position, byte in enumerate(gate):
        if byte not in data:
            if position:
                gate.insert(0, gate.pop(position))
            return False
    return True


def _finders(raw: list[bytes]) -> list[Any]:
    """One search for each secret. Imported here: a process that prints nothing (a `watch` of
    metrics alone, `sidecar check`) never loads it."""
    from ahocorasick_rs import BytesAhoCorasick, MatchKind

    return [BytesAhoCorasick([secret], matchkind=MatchKind.LeftmostLongest) for secret in raw]


secrets = Secrets()
add_secret = secrets.add
mask = secrets.mask
