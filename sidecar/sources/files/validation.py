"""Evaluation and rollout samples -> /validation rounds (docs/validation.md).

A round is the samples of one step: one file of a folder (verl's `validation_data_dir` holds
`<global_step>.jsonl`, one object a sample: `input`, `output`, `score`, `step`, ...), or a run of
consecutive records of one step in a file of many rounds. A round is posted whole and once:
its bytes stay unconsumed (so its file's offset stays before it) until it is complete, which is
when a record of another step follows it, when its file has not grown for ROUND_SETTLE_S, or at
the stop. Its statistics (`avg_reward`, `accuracy`) are over every scored sample; the text of at
most a cap of them is sent, chosen across the range of rewards; each text is masked and cut to
MAX_TEXT_CHARS; the round's payloads are chunks under MAX_CHUNK_BYTES.

Of each record only its span, reward and correctness are held while its round grows; the samples
whose text is sent are read again from the round's bytes when it is posted.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from sidecar.log import log
from sidecar.masking import Secrets
from sidecar.records import LOG_BLOCK
from sidecar.sources.base import Parsed, Survey

if TYPE_CHECKING:
    from sidecar.sources.base import Settings

# The names each part of a sample is found under, the first present winning; --validation-map
# FIELD=NAME puts NAME first. "correct" is the sample's correctness (accuracy).
KNOWN_FIELDS: dict[str, tuple[str, ...]] = {
    "user": ("prompt", "input", "user"),
    "assistant": ("completion", "output", "response", "assistant"),
    "reward": ("reward", "score"),
    "step": ("step", "global_step", "_step", "iteration"),
    "correct": ("acc", "correct", "is_correct"),
}
MAPPABLE = tuple(KNOWN_FIELDS)
# a round of up to this many samples sends the text of all, a larger one of DEFAULT_KEPT: the
# platform's own rule for evaluation cohorts (docs/validation.md#which-samples-keep-their-text)
KEEP_ALL_UP_TO = 128
DEFAULT_KEPT = 32
MAX_TEXT_CHARS = 16 << 10  # of each text of a sample (user, assistant, a string in extra)
HEAD_SHARE = 0.75  # of a cut text, kept from its start; the rest from its end (the answer)
# of a request's body: under 1 MiB, nginx's default client_max_body_size
MAX_CHUNK_BYTES = LOG_BLOCK
MAX_SAMPLE_BYTES = MAX_CHUNK_BYTES // 4  # past it, a sample's extra fields are dropped
# a file not grown for this long holds a whole round: verl writes a round at once, and a
# writer that pauses longer inside one is rare
ROUND_SETTLE_S = 10.0
# a round's bytes held at most; a larger one is posted in parts of this size, each with the
# statistics of its own samples (said once a file)
MAX_ROUND_BYTES = 128 << 20
SURVEYED_BYTES = 64 << 20  # of each file, read by `sidecar check`
SHOWN_NAMES = 8  # field names listed by `sidecar check`
CUT_KEY = "text_cut"  # in a sample's extra: {part: {"kept": chars, "of": chars}}
DIGITS = re.compile(r"\d+")



def _loads(raw: bytes) -> Any:
    """A sample's JSON, its invalid UTF-8 (a model's output cut inside a character, a tokenizer's
    stray byte) read as U+FFFD: such a sample is still a sample, and its score counts in the
    round's avg_reward."""
    return json.loads(raw.decode("utf-8", errors="replace"))

class Fields(NamedTuple):
    """Where each part of a sample is found: the names tried, in order, for each part."""

    names: dict[str, tuple[str, ...]]

    @classmethod
    def of(cls, given: Mapping[str, str]) -> Fields:
        """The known names, with each FIELD=NAME of --validation-map first."""
        return cls({part: ((given[part],) if part in given else ()) + names
                    for part, names in KNOWN_FIELDS.items()})

    def find(self, record: dict[str, Any], part: str) -> str | None:
        return next((name for name in self.names[part] if name in record), None)


def parse_map(items: tuple[str, ...]) -> dict[str, str]:
    """--validation-map FIELD=NAME items as {FIELD: NAME}; ValueError saying what is wrong."""
    given = {}
    for item in items:
        part, sep, name = item.partition("=")
        if not sep or not name.strip() or part.strip() not in MAPPABLE:
            raise ValueError(f"is not FIELD=NAME with FIELD one of {', '.join(MAPPABLE)}")
        given[part.strip()] = name.strip()
    return given


def default_kept(samples: int) -> int:
    """How many samples of a round of `samples` keep their text when no cap is given."""
    return samples if samples <= KEEP_ALL_UP_TO else DEFAULT_KEPT


class _Record(NamedTuple):
    start: int  # of its line, in the round's bytes
    end: int
    reward: float | None  # None: no finite reward (not in avg_reward, no text sent)
    correct: float | None  # 0..1, None: no correctness field


class _Round:
    """The records of one step read so far."""

    __slots__ = ("records", "step")

    def __init__(self, step: int | None) -> None:
        self.step = step
        self.records: list[_Record] = []


class ValidationParser:
    """Parses one file of samples into /validation rounds (the `Parser` protocol)."""

    def __init__(self, source: str = "", name_step: int | None = None,
                 mapping: Fields | None = None, kept: int | None = None,
                 secrets: Secrets | None = None, line: int = 0) -> None:
        self.source = source  # the file, in messages; "" says nothing (`sidecar check`)
        self.name_step = name_step  # the number in the file's name
        self.mapping = mapping or Fields.of({})
        self.kept = kept  # samples whose text is sent; None: default_kept
        self.secrets = secrets or Secrets()
        self.line = line  # lines read (for messages)
        self._base_line = line  # lines before the first byte not consumed
        self.rounds = 0
        self.samples = 0
        self.unscored = 0  # samples without a finite reward
        self.unusable = 0  # lines that are no sample (not JSON, not an object)
        self.steps: list[int] = []
        self.found: dict[str, set[str]] = {part: set() for part in MAPPABLE}
        self.extra: set[str] = set()
        self.step_from_name = False
        self.problem = ""  # the first problem of the file, for `sidecar check`
        self._open = _Round(None)
        self._read = 0  # bytes at the start of the data whose lines were read
        self._seen = 0  # length of the data last offered
        self._grew_at: float | None = None  # when (the caller's clock) the data last grew
        self._said: set[str] = set()
        self._held_said = False  # the open round's wait was said (at DEBUG)

    @classmethod
    def resume(cls, state: dict[str, Any], **kwargs: Any) -> ValidationParser:
        return cls(line=int(state.get("line", 0)), **kwargs)

    def state(self) -> dict[str, Any]:
        return {"line": self._base_line}

    # -- the Parser protocol ----------------------------------------------------------------

    def parse(self, data: bytes, now: float) -> Parsed:
        return self._take(data, now, final=False, quiet=False)

    def quiet(self, data: bytes, now: float, final: bool = False) -> Parsed:
        return self._take(data, now, final=final, quiet=True)

    # -- rounds -------------------------------------------------------------------------------

    def _take(self, data: bytes, now: float, final: bool, quiet: bool) -> Parsed:
        """Read the lines of `data` not read yet, post the rounds they complete, and the open
        one too when its file settled (`quiet`) or at the stop (`final`)."""
        out = Parsed(consumed=0)
        if len(data) < self._read:  # a shorter slice of what was read: wait for the whole
            return out
        if self._grew_at is None or len(data) > self._seen:
            self._grew_at, self._seen = now, len(data)
        end = data.rfind(b"\n") + 1
        closed: list[_Round] = []  # the rounds complete
        at = self._read
        while at < end:
            stop = data.index(b"\n", at) + 1
            self._line(data, at, stop, closed, out)
            at = stop
        self._read = max(self._read, end)
        settled = quiet and self._grew_at is not None and now - self._grew_at >= ROUND_SETTLE_S
        if final and end < len(data):  # a last line without its newline: the writer stopped
            self._line(data, end, len(data), closed, out)
            self._read = end = len(data)
        if self._open.records and (final or (settled and end == len(data))):
            closed.append(self._open)
            self._open = _Round(None)
            self._held_said = False
        elif self._open.records and quiet and not self._held_said:
            self._held_said = True
            log.debug("--validation %s: the round of step %s (%d samples so far) waits until "
                      "the file has not grown for %.0f s", self.source, self._open.step,
                      len(self._open.records), ROUND_SETTLE_S,
                      extra={"source": "validation", "path": self.source})
        for round_ in closed:
            out.documents += self._post(round_, data)
        # what lies before the open round is done with: its rounds, blank and bad lines
        consumed = self._open.records[0].start if self._open.records else end
        if consumed:
            self._consume(data, consumed, out)
        return out

    def _consume(self, data: bytes, consumed: int, out: Parsed) -> None:
        out.consumed = consumed
        self._base_line += data.count(b"\n", 0, consumed)
        self._read -= consumed
        self._seen -= consumed
        self._open.records = [r._replace(start=r.start - consumed, end=r.end - consumed)
                              for r in self._open.records]

    def _line(self, data: bytes, start: int, stop: int, closed: list[_Round],
              out: Parsed) -> None:
        """One line of the file: a sample of the open round, or of a new one it closes."""
        raw = data[start:stop]
        self.line += 1
        if not raw.strip():
            return
        out.records += 1
        try:
            obj = _loads(raw)
        except (ValueError, RecursionError):
            self._bad(out, f"line {self.line}: not JSON; write each sample with json.dumps, "
                      "one a line")
            return
        if not isinstance(obj, dict):
            self._bad(out, f"line {self.line}: not a JSON object; each line should be one "
                      "sample, as in {\"input\": ..., \"output\": ..., \"score\": 1.0}")
            return
        step = self._step(obj)
        used = self._used(obj)
        for part, name in used.items():
            if name is not None:
                self.found[part].add(name)
        self.extra.update(key for key in obj if key not in used.values()
                          or key == used["correct"])
        opened = self._open
        size = sum(r.end - r.start for r in opened.records)
        if opened.records and (step != opened.step or size + len(raw) > MAX_ROUND_BYTES):
            if step == opened.step:
                self._say("large", f"the round of step {step} holds more than "
                          f"{MAX_ROUND_BYTES >> 20} MiB of samples: it is posted in parts of "
                          "that size, each with the statistics of its own samples")
            closed.append(opened)
            self._open = opened = _Round(step)
            self._held_said = False
        opened.step = step
        reward = self._number(obj, "reward")
        correct = self._number(obj, "correct")
        opened.records.append(_Record(start, stop, reward, correct))

    def _step(self, obj: dict[str, Any]) -> int | None:
        name = self.mapping.find(obj, "step")
        if name is not None:
            value = obj[name]
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        if self.name_step is not None:
            self.step_from_name = True
        return self.name_step

    def _number(self, obj: dict[str, Any], part: str) -> float | None:
        name = self.mapping.find(obj, part)
        if name is None:
            return None
        value = obj[name]
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int | float):
            return None
        number = float(value)
        return number if math.isfinite(number) else None

    def _bad(self, out: Parsed, what: str) -> None:
        out.unusable += 1
        self.unusable += 1
        self._say("bad", what + "; each such line is counted and skipped")

    def _say(self, key: str, what: str) -> None:
        """A problem of this file: kept for `check`, and said once in a WARNING."""
        self.problem = self.problem or what
        if self.source and key not in self._said:
            self._said.add(key)
            log.warning("--validation %s: %s (said once for this file)", self.source, what,
                        extra={"source": "validation", "path": self.source})

    def _post(self, round_: _Round, data: bytes) -> list[dict[str, Any]]:
        """The payloads of one complete round (without run_id), or none when it cannot be
        posted, said."""
        records = round_.records
        scored = [r for r in records if r.reward is not None]
        self.unscored += len(records) - len(scored)
        if len(scored) < len(records):
            self._say("unscored", f"{len(records) - len(scored)} of the {len(records)} samples "
                      f"of step {round_.step} have no finite reward (tried: "
                      f"{', '.join(self.mapping.names['reward'])}); they count in no statistic "
                      "and their text is not sent; --validation-map reward=NAME names the field")
        if round_.step is None:
            self._say("step", f"a round of {len(records)} samples has no step: its records "
                      f"carry none of {', '.join(self.mapping.names['step'])} and the file's "
                      "name no number; it is not posted. Name the files <step>.jsonl as verl "
                      "does, or give --validation-map step=NAME")
            return []
        if not scored:
            return []
        self.rounds += 1
        self.samples += len(records)
        self.steps.append(round_.step)
        stats: dict[str, Any] = {
            "step": round_.step,
            "avg_reward": math.fsum(r.reward for r in scored if r.reward is not None) / len(scored)}
        judged = [r.correct for r in scored if r.correct is not None]
        if judged:
            stats["accuracy"] = math.fsum(judged) / len(judged)
        kept = _spread(scored, default_kept(len(scored)) if self.kept is None else self.kept)
        samples = [self._sample(_loads(data[r.start:r.end]), r.reward) for r in kept]
        return _chunks(stats, samples)

    def _sample(self, obj: dict[str, Any], reward: float | None) -> dict[str, Any]:
        """One sample as /validation takes it: its texts masked and cut, the rest in extra."""
        used = self._used(obj)
        extra = {key: value for key, value in obj.items() if key not in used.values()
                 or key == used["correct"]}
        cut: dict[str, dict[str, int]] = {}
        sample: dict[str, Any] = {
            "user": self._text(obj.get(used["user"] or ""), "user", cut),
            "assistant": self._text(obj.get(used["assistant"] or ""), "assistant", cut),
            "reward": reward,
            "extra": {key: self._value(value, key, cut) for key, value in extra.items()}}
        if cut:
            sample["extra"][CUT_KEY] = cut
        if len(orjson.dumps(sample)) > MAX_SAMPLE_BYTES:
            sample["extra"] = {CUT_KEY: cut, "extra_dropped": sorted(extra)}
        return sample

    def _used(self, obj: dict[str, Any]) -> dict[str, str | None]:
        """The field each part of a sample is in `obj` (None: absent); the correctness field
        stays in extra too, so that a sample shows whether it was right."""
        return {part: self.mapping.find(obj, part) for part in MAPPABLE}

    def _value(self, value: Any, name: str, cut: dict[str, dict[str, int]]) -> Any:
        """An extra field's value with its strings masked and cut (nested ones too)."""
        if isinstance(value, str):
            return self._text(value, name, cut)
        if isinstance(value, list):
            return [self._value(item, name, cut) for item in value]
        if isinstance(value, dict):
            return {key: self._value(item, name, cut) for key, item in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            return None  # NaN and infinities are never sent as numbers
        return value

    def _text(self, value: Any, name: str, cut: dict[str, dict[str, int]]) -> str:
        """A sample's text: masked first (a cut must not leave half a secret), then cut to
        MAX_TEXT_CHARS, its head and its end kept, the cut said in `cut`."""
        text = self.secrets.mask(_as_text(value))
        if len(text) <= MAX_TEXT_CHARS:
            return text
        head = int(MAX_TEXT_CHARS * HEAD_SHARE)
        tail = MAX_TEXT_CHARS - head
        cut[name] = {"kept": MAX_TEXT_CHARS, "of": len(text)}
        return (f"{text[:head]}\n[... {len(text) - MAX_TEXT_CHARS} characters cut by the "
                f"sidecar ...]\n{text[-tail:]}")


def _as_text(value: Any) -> str:
    """A part of a sample as text: a string as it is; a chat (a list of {role, content}) one
    message a paragraph; anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n\n".join(f"{m.get('role', '')}: {_as_text(m['content'])}".lstrip(": ")
                           for m in value)
    return json.dumps(value, ensure_ascii=False, default=str)


def _spread(scored: list[_Record], kept: int) -> list[_Record]:
    """`kept` of the scored records, spread evenly over their rewards in order (the lowest and
    the highest always among them), in the file's order."""
    if kept >= len(scored):
        return scored
    if kept <= 0:
        return []
    ranked = sorted(range(len(scored)), key=lambda i: (scored[i].reward, i))
    if kept == 1:
        chosen = {ranked[len(ranked) // 2]}
    else:
        chosen = {ranked[round(i * (len(ranked) - 1) / (kept - 1))] for i in range(kept)}
    return [scored[i] for i in sorted(chosen)]


def _chunks(stats: dict[str, Any], samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The round's payloads: its samples in chunks whose bodies stay under MAX_CHUNK_BYTES,
    each with the round's statistics, its chunk_index and total_chunks (one, of no sample, for
    a round of scores only)."""
    # the body around the samples: run_id, the statistics, the chunk fields
    room = MAX_CHUNK_BYTES - len(orjson.dumps(stats)) - 512
    groups: list[list[dict[str, Any]]] = [[]]
    size = 0
    for sample in samples:
        grown = len(orjson.dumps(sample)) + 1
        if groups[-1] and size + grown > room:
            groups.append([])
            size = 0
        groups[-1].append(sample)
        size += grown
    return [{**stats, "samples": group, "chunk_index": index, "total_chunks": len(groups)}
            for index, group in enumerate(groups)]


def name_step(name: str) -> int | None:
    """The step a round file's name gives: its last number (`120.jsonl`, `step_120.jsonl`)."""
    numbers = DIGITS.findall(name.rsplit(".", 1)[0])
    return int(numbers[-1]) if numbers else None


def survey(cfg: Settings, files: list[str]) -> Survey:
    """What the files of one --validation pattern hold, as `watch` would post it: rounds,
    samples, the field each part of a sample comes from, and what goes to extra."""
    import os
    import time


    fields = Fields.of(parse_map(cfg.validation_map))
    parsers = []
    for path in files:
        parser = ValidationParser(name_step=name_step(os.path.basename(path)), mapping=fields,
                                  kept=cfg.validation_samples)
        try:
            with open(path, "rb") as file:
                parser.quiet(file.read(SURVEYED_BYTES), time.time(), final=True)
        except OSError as exc:
            parser.problem = f"cannot be read ({exc.strerror})"
        parsers.append((path, parser))
    rounds = sum(p.rounds for _, p in parsers)
    samples = sum(p.samples for _, p in parsers)
    steps = sorted(step for _, p in parsers for step in p.steps)
    found = {part: sorted(set().union(*(p.found[part] for _, p in parsers))) for part in MAPPABLE}
    extra = sorted(set().union(*(p.extra for _, p in parsers)))
    from_name = any(p.step_from_name for _, p in parsers)
    problems = [(path, p.problem) for path, p in parsers if p.problem]
    missing = [part for part in ("user", "assistant") if rounds and not found[part]]
    if missing:
        problems.append((files[0] if len(files) == 1 else "the samples", "no " + " and no ".join(
            f"{part} field (tried {', '.join(fields.names[part])})" for part in missing)
            + "; --validation-map " + " ".join(f"{part}=NAME" for part in missing)
            + " names it"))
    mapped = "; ".join(
        f"{part} from {' or '.join(repr(n) for n in names)}" if names else f"no {part} field"
        for part, names in found.items() if names or part != "correct")
    if from_name:
        mapped += " (step from the file name)" if found["step"] else \
            "; step from the file name"
    details: dict[str, Any] = {
        "files": len(files), "rounds": rounds, "samples": samples, "steps": steps[:100],
        "fields": found, "extra": extra[:100], "step_from_name": from_name,
        "problems": [{"file": f, "problem": p} for f, p in problems[:SHOWN_NAMES]]}
    count = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    shown_extra = ", ".join(extra[:SHOWN_NAMES]) + (", ..." if len(extra) > SHOWN_NAMES else "")
    said = "; ".join(f"{path}: {problem}" for path, problem in problems[:2])
    if not rounds:
        status = "fail" if samples or problems else "warn"
        what = said or "no complete round yet; rounds are posted as the trainer writes them"
        return Survey(status, f"{count}, no round that would be posted: {what}", details)
    span = f"steps {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    message = (f"{count}, {rounds} round{'s' if rounds != 1 else ''} ({span}), {samples} "
               f"samples; {mapped}; to extra: {shown_extra or 'nothing'}")
    return Survey("warn" if problems else "ok", message + (f"; but {said}" if said else ""),
                  details)
