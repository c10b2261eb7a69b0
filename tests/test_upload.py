"""Checkpoint uploads through `artifact/upload-url`: a real `sidecar watch`, the checking ingest
signing real presigned PUT URLs (boto3) for a real S3 protocol server (moto's server mode), every
object read back and compared byte for byte. What moto does not check (expiry, signatures) is
checked by the ingest's own object folder (receive.LocalObjects), which refuses as S3 does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from sidecar.commands.receive import IngestServer
from tests.conftest import RUN_ID, TOKEN
from tests.faulty_ingest import Faults
from tests.ingest_server import (
    RunningIngest,
    S3Store,
    background_loop,
    running_ingest,
    wait_until,
)
from tests.test_checkpoints import QUICK_QUIET, Watch, artifacts

CONTAINER = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
PREFIX = f"s3://{S3Store.BUCKET}/{RUN_ID}/checkpoints"


# `sidecar` as QUICK_QUIET, its checkpoints' first asks spread over 0.5 s rather than 10 s (or,
# with a number, each first ask waiting that long)
def quick_upload(wait_s: float | None = None) -> tuple[str, ...]:
    spread = (f"u.start_wait_s = lambda: {wait_s}" if wait_s is not None
              else "u.START_SPREAD_S = 0.5")
    return (*QUICK_QUIET[:-1], "import sidecar.delivery.upload as u; " + spread + "; "
            + QUICK_QUIET[-1])


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", quick_upload())


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Store]:
    store = S3Store()
    try:
        yield store
    finally:
        store.stop()


def safetensors(size: int, seed: int) -> bytes:
    """A whole safetensors file of `size` data bytes (random, so that no two are alike)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [size],
                               "data_offsets": [0, size]}}).encode()
    return struct.pack("<Q", len(header)) + header + random.Random(seed).randbytes(size)


def hf_export(sizes: list[int], seed: int = 0) -> dict[str, bytes]:
    """The files of a sharded save_pretrained export."""
    shards = {f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors": safetensors(n, seed + i)
              for i, n in enumerate(sizes)}
    index = {"weight_map": {f"t{i}": name for i, name in enumerate(shards)}}
    return {"config.json": b'{"model_type": "demo"}', **shards,
            "model.safetensors.index.json": json.dumps(index).encode()}


def save(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """Write a checkpoint folder beside `folder`, then rename it in: whole when it appears."""
    staging = folder.parent / f"writing-{name}"
    staging.mkdir()
    for rel, data in files.items():
        (staging / rel).write_bytes(data)
    os.rename(staging, folder / name)
    return folder / name


def save_file(folder: Path, name: str, data: bytes) -> Path:
    partial = folder.parent / f"writing-{name}"
    partial.write_bytes(data)
    os.rename(partial, folder / name)
    return folder / name


def asked(ingest: RunningIngest) -> Counter[str]:
    """How many signed URLs the ingest gave out, by object name."""
    return Counter(str(r["name"]) for r in ingest.records("artifact/upload-url"))


def ledger(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "state" / RUN_ID / "uploads.ledger"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_in_a_container_an_unmapped_checkpoint_is_uploaded_to_s3_then_registered_once(
        tmp_path: Path, s3: S3Store) -> None:
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, mapped=False, **CONTAINER).start()
        export = hf_export([300_000, 700_001, 5])
        save(folder, "export-10", export)
        loose = safetensors(1_500_000, 9)
        save_file(folder, "step_20.safetensors", loose)
        ingest.wait_for(lambda: len(artifacts(ingest)) >= 2, 60, "both registered")
        done = watch.stop()
        assert done.status == 0, done.stderr.decode()[-3000:]
        by_path = {a["path"]: a for a in artifacts(ingest)}
        assert sorted(by_path) == [f"{PREFIX}/export-10", f"{PREFIX}/step_20.safetensors"]
        assert by_path[f"{PREFIX}/export-10"]["kind"] == "hf_export"
        assert by_path[f"{PREFIX}/export-10"]["size_bytes"] == sum(map(len, export.values()))
        assert by_path[f"{PREFIX}/step_20.safetensors"]["step"] == 20
        for rel, data in export.items():
            assert s3.read(f"{PREFIX}/export-10/{rel}") == data, rel
        assert s3.read(f"{PREFIX}/step_20.safetensors") == loose
        assert all(n == 1 for n in asked(ingest).values()), asked(ingest)
        # nothing left held in the state folder once uploaded
        staged = tmp_path / "state" / RUN_ID / "staged"
        assert not staged.exists() or not any(staged.iterdir())
        assert len(artifacts(ingest)) == 2


def killed_mid_upload(ingest: RunningIngest, tmp_path: Path, name: str,
                      seed: int) -> tuple[Watch, dict[str, bytes], set[str], Counter[str]]:
    """A watch SIGKILLed once some files of the export `name` are stored and not all: the
    watch, the export, the files stored and the URLs asked by then."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    # 1 MB a second: the small shards are stored long before the large ones
    watch = Watch(ingest, tmp_path, folder, "--checkpoint-upload", "always",
                  "--upload-rate", "1000000", mapped=False).start()
    export = hf_export([20_000, 30_000, 2_500_000, 2_500_000], seed=seed)
    save(folder, name, export)
    wait_until(lambda: any(r["op"] == "stored" for r in ledger(tmp_path)), 60,
               "a file stored", watch.stderr)
    watch.stop(signal.SIGKILL)
    stored = {r["rel"] for r in ledger(tmp_path) if r["op"] == "stored"}
    assert 0 < len(stored) < len(export), stored
    return watch, export, stored, asked(ingest)


def test_a_restart_resumes_with_the_files_not_yet_stored_and_registers_once(
        tmp_path: Path, s3: S3Store) -> None:
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        watch, export, stored, before = killed_mid_upload(ingest, tmp_path, "export-30", 40)
        watch.args[watch.args.index("--upload-rate") + 1] = "0"  # no cap: the rest at once
        watch.start()
        ingest.wait_for(lambda: len(artifacts(ingest)) >= 1, 60, "registered")
        done = watch.stop()
        assert done.status == 0, done.stderr.decode()[-3000:]
        assert [a["path"] for a in artifacts(ingest)] == [f"{PREFIX}/export-30"]
        again = asked(ingest) - before
        assert not {f"checkpoints/export-30/{rel}" for rel in stored} & set(again), again
        assert "resuming 1 checkpoint upload" in watch.stderr()
        for rel, data in export.items():
            assert s3.read(f"{PREFIX}/export-30/{rel}") == data, rel


def test_replay_finishes_an_upload_a_killed_sidecar_left_and_registers_it_once(
        tmp_path: Path, s3: S3Store) -> None:
    from tests.conftest import sidecar

    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        watch, export, stored, before = killed_mid_upload(ingest, tmp_path, "export-40", 41)
        done = sidecar(["replay"], watch.env, tmp_path / "replay")
        assert done.status == 0, done.stderr.decode()[-3000:]
        assert [a["path"] for a in artifacts(ingest)] == [f"{PREFIX}/export-40"]
        again = asked(ingest) - before
        assert not {f"checkpoints/export-40/{rel}" for rel in stored} & set(again), again
        for rel, data in export.items():
            assert s3.read(f"{PREFIX}/export-40/{rel}") == data, rel


def test_a_checkpoint_deleted_by_rotation_while_it_is_uploaded_is_uploaded_whole(
        tmp_path: Path, s3: S3Store) -> None:
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, "--upload-rate", "2000000", mapped=False,
                      **CONTAINER).start()
        export = hf_export([1_000_000, 1_000_000], seed=70)
        saved = save(folder, "export-50", export)
        ingest.wait_for(lambda: asked(ingest), 60, "the upload began")
        for rel in export:  # save_total_limit: the old checkpoint goes as the next one lands
            (saved / rel).unlink()
        saved.rmdir()
        ingest.wait_for(lambda: artifacts(ingest), 60, "registered")
        done = watch.stop()
        assert done.status == 0, done.stderr.decode()[-3000:]
        assert [a["path"] for a in artifacts(ingest)] == [f"{PREFIX}/export-50"]
        for rel, data in export.items():
            assert s3.read(f"{PREFIX}/export-50/{rel}") == data, rel


def test_an_expired_url_is_asked_again_and_a_refused_signature_is_dead_lettered(
        tmp_path: Path) -> None:
    handle: list[RunningIngest] = []
    given: Counter[str] = Counter()

    def signer(run_id: str, name: str, size: int) -> dict[str, Any]:
        given[name] += 1
        # each file's first URL has expired already; those of `bad-` files are forged
        answer = handle[0].sign_locally(run_id, name, size, -60 if given[name] == 1 else 600)
        if "bad-" in name:
            answer["url"] = answer["url"].replace("signature=", "signature=0")
        return answer

    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=signer) as ingest:
        handle.append(ingest)
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, mapped=False, **CONTAINER).start()
        good = safetensors(200_000, 1)
        save_file(folder, "bad-step_1.safetensors", safetensors(1000, 2))
        wait_until(lambda: "is not uploaded nor registered" in watch.stderr(), 60,
                   "the forged one refused", watch.stderr)
        save_file(folder, "step_2.safetensors", good)
        ingest.wait_for(lambda: artifacts(ingest), 60, "the good one registered")
        done = watch.stop()
        assert done.status == 0, done.stderr.decode()[-3000:]
        objects = tmp_path / "received" / "objects" / RUN_ID / "checkpoints"
        assert (objects / "step_2.safetensors").read_bytes() == good
        assert [a["path"] for a in artifacts(ingest)] == [
            (objects / "step_2.safetensors").as_uri()]
        assert given["checkpoints/step_2.safetensors"] == 2  # expired, then asked again
        errors = [line for line in done.stderr.decode().splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "SignatureDoesNotMatch" in errors[0], errors
        letters = (tmp_path / "state" / RUN_ID / "dead-letter.jsonl").read_text().splitlines()
        letter = json.loads(letters[-1])
        assert letter["route"] == "artifact/upload-url" and letter["status"] == 403
        assert "SignatureDoesNotMatch" in json.loads(letter["body"])["reason"]


def test_a_file_too_large_for_one_put_is_dead_lettered_with_the_ingests_reason(
        ingest: RunningIngest, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    staging = tmp_path / "writing"
    staging.mkdir()
    (staging / ".metadata").write_bytes(b"dcp")
    with open(staging / "__0_0.distcp", "wb") as fh:  # sparse: 5 GB that take no room
        fh.truncate(5 * 10**9 + 1)
    os.rename(staging, folder / "step-7")
    watch = Watch(ingest, tmp_path, folder, mapped=False, **CONTAINER).start()
    wait_until(lambda: "is not uploaded nor registered" in watch.stderr(), 60, "refused",
               watch.stderr)
    done = watch.stop()
    assert done.status == 0
    line = next(li for li in done.stderr.decode().splitlines() if "ERROR" in li)
    assert "HTTP 400" in line and "EntityTooLarge" in line, line
    assert not artifacts(ingest)


def test_status_and_prometheus_show_an_upload_under_way_and_what_it_sent(
        tmp_path: Path, s3: S3Store) -> None:
    import urllib.request

    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, "--upload-rate", "1000000", mapped=False,
                      SIDECAR_STATUS_ADDR="127.0.0.1:0", **CONTAINER).start()
        data = safetensors(3_000_000, 5)
        save_file(folder, "step_60.safetensors", data)
        addr_file = tmp_path / "state" / RUN_ID / "status-addr"
        wait_until(addr_file.exists, 20, "the status address written", watch.stderr)
        address = addr_file.read_text().strip()

        def fetch(path: str) -> str:
            with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as answer:
                text: str = answer.read().decode()
            return text

        def under_way() -> list[dict[str, Any]]:
            shown: list[dict[str, Any]] = json.loads(fetch("/status"))["uploads"]
            return shown

        wait_until(lambda: any(0 < u["bytes_sent"] < u["bytes"] for u in under_way()), 30,
                   "an upload under way", watch.stderr)
        (shown,) = under_way()
        assert shown["path"] == str(folder / "step_60.safetensors")
        assert shown["bytes"] == len(data) and shown["files"] == 1
        ingest.wait_for(lambda: artifacts(ingest), 60, "registered")
        metrics = fetch("/metrics")
        assert f"sidecar_upload_bytes_total {float(len(data)):g}" in metrics, metrics
        assert "sidecar_upload_files_total 1.0" in metrics
        assert watch.stop().status == 0
        assert s3.read(f"{PREFIX}/step_60.safetensors") == data


def test_a_first_ask_waits_its_part_of_the_spread_but_not_at_the_stop(
        tmp_path: Path, s3: S3Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.conftest.SIDECAR", quick_upload(wait_s=600))
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, mapped=False, **CONTAINER).start()
        data = safetensors(200_000, 11)
        save_file(folder, "step_80.safetensors", data)
        # staged (held against a rotation) at once, then waiting its part of the spread
        wait_until(lambda: any(r.get("op") == "checkpoint" for r in ledger(tmp_path)), 30,
                   "the checkpoint staged", watch.stderr)
        # an absence, so watched for a while: without the spread the ask follows in milliseconds
        waited_until = time.monotonic() + 2
        while time.monotonic() < waited_until:
            assert not asked(ingest)
            time.sleep(0.05)
        done = watch.stop()  # the drain does not wait out the spread
        assert done.status == 0, done.stderr.decode()[-3000:]
        assert [a["path"] for a in artifacts(ingest)] == [f"{PREFIX}/step_80.safetensors"]
        assert s3.read(f"{PREFIX}/step_80.safetensors") == data


def _nice_values(pid: int) -> dict[int, int]:
    """Each thread's nice value, by native id, from /proc/PID/task/TID/stat (field 19)."""
    values = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        values[int(task.name)] = int(fields[16])
    return values


def test_the_upload_sends_at_the_lowest_cpu_priority_and_nothing_else_does(
        tmp_path: Path, s3: S3Store) -> None:
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                        signer=s3.sign) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, "--upload-rate", "1000000", mapped=False,
                      **CONTAINER).start()
        assert watch.proc is not None
        pid = watch.proc.proc.pid
        data = safetensors(4_000_000, 6)
        save_file(folder, "step_70.safetensors", data)
        wait_until(lambda: 19 in _nice_values(pid).values(), 30,
                   "a thread sending at nice 19", watch.stderr)
        # the loop (its log forwarding, its posts) keeps the sidecar's own priority
        assert _nice_values(pid)[pid] == 0
        ingest.wait_for(lambda: artifacts(ingest), 60, "registered")
        assert watch.stop().status == 0
        assert s3.read(f"{PREFIX}/step_70.safetensors") == data


Scripted = tuple[int, dict[str, str], bytes]  # a status, headers, a body
SLOW_DOWN = (b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
             b"</Error>")


class ScriptedStore:
    """An object store's front: the first PUTs are read and answered as `answers` says, one
    each, the rest sent on to `origin` (the ingest's own objects) as they came. Each PUT's
    arrival time is kept."""

    def __init__(self, origin: str, answers: list[Scripted]) -> None:
        import http.client
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        self.arrivals: list[float] = []
        target = urlsplit(origin)
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                store.arrivals.append(time.monotonic())
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if len(store.arrivals) <= len(answers):
                    status, headers, answer = answers[len(store.arrivals) - 1]
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                conn.request("PUT", self.path, body, {"Content-Length": str(len(body))})
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Behind(NamedTuple):
    """A `sidecar watch` uploading a folder's checkpoints through one ScriptedStore."""

    ingest: RunningIngest
    watch: Watch
    folder: Path
    store: list[ScriptedStore]  # the front, once the first URL was signed
    given: Counter[str]  # signed URLs asked for, by object name


@contextlib.contextmanager
def behind_a_scripted_store(tmp_path: Path, answers: list[Scripted]) -> Iterator[Behind]:
    """The checking ingest, whose signed URLs go through a ScriptedStore answering `answers`
    first, and a `sidecar watch` of tmp_path/ckpt in a container (so it uploads)."""
    handle: list[RunningIngest] = []
    fronts: list[ScriptedStore] = []
    given: Counter[str] = Counter()

    def signer(run_id: str, name: str, size: int) -> dict[str, Any]:
        given[name] += 1
        answer = handle[0].sign_locally(run_id, name, size)
        origin = answer["url"].split("/_objects/")[0]
        if not fronts:
            fronts.append(ScriptedStore(origin, answers))
        answer["url"] = answer["url"].replace(origin, fronts[0].origin)
        return answer

    try:
        with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID,
                            signer=signer) as ingest:
            handle.append(ingest)
            folder = tmp_path / "ckpt"
            folder.mkdir()
            watch = Watch(ingest, tmp_path, folder, mapped=False, **CONTAINER).start()
            yield Behind(ingest, watch, folder, fronts, given)
    finally:
        for front in fronts:
            front.stop()


def test_a_store_that_slows_down_is_waited_for_as_told_with_the_same_url(
        tmp_path: Path) -> None:
    # S3's 503 SlowDown (the first with Retry-After: 2), GCS's 429 between
    with behind_a_scripted_store(tmp_path, [(503, {"Retry-After": "2"}, SLOW_DOWN),
                                            (429, {}, SLOW_DOWN),
                                            (503, {}, SLOW_DOWN)]) as run:
        data = safetensors(300_000, 7)
        save_file(run.folder, "step_3.safetensors", data)
        run.ingest.wait_for(lambda: artifacts(run.ingest), 60, "registered")
        done = run.watch.stop()
        assert done.status == 0, done.stderr.decode()[-3000:]
        assert len(artifacts(run.ingest)) == 1
    objects = tmp_path / "received" / "objects" / RUN_ID / "checkpoints"
    assert (objects / "step_3.safetensors").read_bytes() == data
    # throttled three times (a 429 among them, retried too), the signed URL asked for once:
    # the store's 503 is no reason to ask the ingest again
    arrivals = run.store[0].arrivals
    assert len(arrivals) == 4 and run.given["checkpoints/step_3.safetensors"] == 1, run.given
    # the first answer said Retry-After: 2; a lower bound only, a busy machine is slower
    assert arrivals[1] - arrivals[0] >= 2.0
    assert "SlowDown" in done.stderr.decode()


def test_a_403_of_any_body_asks_for_a_new_url_and_a_redirect_refuses_only_its_checkpoint(
        tmp_path: Path) -> None:
    """The store's 403 means the URL expired, whatever its body says: a new one is asked for.
    A redirect can never store the file: that checkpoint is refused and said, and the next
    is uploaded (it was retried for ever, holding up every later checkpoint)."""
    moved = (301, {"Location": "http://elsewhere.invalid/bucket"}, b"")
    with behind_a_scripted_store(
            tmp_path, [(403, {}, b"<Error><Code>AccessDenied</Code></Error>"), moved]) as run:
        save_file(run.folder, "step_1.safetensors", safetensors(1000, 3))
        wait_until(lambda: "is not uploaded nor registered" in run.watch.stderr(), 60,
                   "the redirected one refused", run.watch.stderr)
        save_file(run.folder, "step_2.safetensors", safetensors(2000, 4))
        run.ingest.wait_for(lambda: artifacts(run.ingest), 60, "the next one registered")
        done = run.watch.stop()
        assert done.status == 0, done.stderr.decode()[-3000:]
        registered = [a["path"] for a in artifacts(run.ingest)]
    # the 403 asked for a second URL, whose PUT was redirected: refused, not retried
    assert run.given["checkpoints/step_1.safetensors"] == 2, run.given
    assert len(run.store[0].arrivals) == 3  # 403, 301, then step_2's PUT sent on
    objects = tmp_path / "received" / "objects" / RUN_ID / "checkpoints"
    assert registered == [(objects / "step_2.safetensors").as_uri()]
    errors = [line for line in done.stderr.decode().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "HTTP 301" in errors[0] and "redirect" in errors[0], errors


class CountedAsks(Faults):
    """The ingest's hooks, answering each `artifact/upload-url` request LATENCY_S late (an
    ingest a round trip away) and noting how many were in flight as each one arrived."""

    LATENCY_S = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.seen: list[int] = []

    async def arrived(self, route: str, stopping: asyncio.Event) -> None:
        if route == "artifact/upload-url":
            self.held += 1
            self.seen.append(self.held)
            try:
                await asyncio.sleep(self.LATENCY_S)
            finally:
                self.held -= 1
        await super().arrived(route, stopping)


def test_a_checkpoint_s_asks_for_signed_urls_begin_alone_and_widen_while_answered(
        tmp_path: Path) -> None:
    """A fleet saving at the same step asked for every file's URL at once: 4,000 requests in
    the signing route's first second for 1,000 nodes of 4 files, 8x what it could answer
    (tests/bench/bench_fleet_upload.py); one request at a time held a checkpoint of 3,001
    small files to one a round trip. The first ask goes alone, each answered lets one more go
    beside it, up to ASKS_IN_FLIGHT."""
    from sidecar.delivery.upload import ASKS_IN_FLIGHT

    hooks = CountedAsks()
    files = {".metadata": b"meta", **{f"__{i}_0.distcp": bytes([i]) * 100 for i in range(40)}}
    with background_loop("ingest-server") as loop:
        server = IngestServer(tmp_path / "received", token=TOKEN, run_id=RUN_ID, hooks=hooks)
        ingest = RunningIngest(server, hooks, loop)
        ingest._run(server.start())
        try:
            folder = tmp_path / "ckpt"
            folder.mkdir()
            watch = Watch(ingest, tmp_path, folder, mapped=False, **CONTAINER).start()
            save(folder, "step-5", files)
            ingest.wait_for(lambda: artifacts(ingest), 60, "registered")
            done = watch.stop()
            given, registered = asked(ingest), artifacts(ingest)
        finally:
            ingest._run(server.stop())
    assert done.status == 0, done.stderr.decode()[-3000:]
    assert len(given) == len(files) and all(n == 1 for n in given.values()), given
    assert len(registered) == 1
    assert hooks.seen[0] == 1, hooks.seen  # the first alone
    assert 2 <= max(hooks.seen) <= ASKS_IN_FLIGHT, hooks.seen
    objects = tmp_path / "received" / "objects" / RUN_ID / "checkpoints" / "step-5"
    assert all((objects / rel).read_bytes() == data for rel, data in files.items())
    # the ledger holds every file's stored answer, however many were written together
    assert sum(1 for r in ledger(tmp_path) if r["op"] == "stored") == len(files)


async def wait_async(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.005)


async def test_the_window_of_asks_widens_one_at_a_time_and_a_failure_puts_it_back_to_one(
) -> None:
    from sidecar.aio import Window

    window = Window(3)
    inside: list[int] = []
    release = asyncio.Event()

    async def one() -> None:
        async with window:
            inside.append(window.inside)
            await release.wait()

    tasks = [asyncio.create_task(one()) for _ in range(5)]
    await wait_async(lambda: len(inside) == 1)
    window.widen()
    window.widen()
    window.widen()  # at most 3
    release.set()
    await asyncio.gather(*tasks)
    assert window.size == 3 and max(inside) <= 3
    window.narrow()
    assert window.size == 1
    release.clear()
    tasks = [asyncio.create_task(one()) for _ in range(2)]
    await wait_async(lambda: window.inside == 1)
    assert window.inside == 1  # the second waits for the first
    release.set()
    await asyncio.gather(*tasks)


def test_a_checkpoint_complete_while_another_uploads_is_held_at_once_and_survives_rotation(
        tmp_path: Path) -> None:
    """The second checkpoint completes while the first is sent (1 MB at 200 kB/s) and is
    deleted (save_total_limit) before its turn: held the moment it was judged complete, it is
    uploaded whole all the same (it was held only at its turn, so the rotation lost it)."""
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, "--upload-rate", "200000", mapped=False,
                      **CONTAINER).start()
        first = hf_export([500_000, 500_000], seed=81)
        save(folder, "export-10", first)
        ingest.wait_for(lambda: asked(ingest), 60, "the first upload began")
        second = hf_export([1000], seed=82)
        saved = save(folder, "export-20", second)
        ledger_path = tmp_path / "state" / RUN_ID / "uploads.ledger"
        wait_until(lambda: ledger_path.exists() and sum(
            1 for r in ledger(tmp_path) if r["op"] == "checkpoint") == 2, 30,
            "the second checkpoint held")
        assert not artifacts(ingest)  # the first is still being sent: the second waits
        for rel in second:
            (saved / rel).unlink()
        saved.rmdir()
        ingest.wait_for(lambda: len(artifacts(ingest)) == 2, 60, "both registered")
        done = watch.stop()
    assert done.status == 0, done.stderr.decode()[-3000:]
    assert "not uploaded" not in done.stderr.decode()
    objects = tmp_path / "received" / "objects" / RUN_ID / "checkpoints"
    for name, files in (("export-10", first), ("export-20", second)):
        assert all((objects / name / rel).read_bytes() == data for rel, data in files.items())


@pytest.mark.skipif(not Path("/dev/shm").is_dir()
                    or os.stat("/dev/shm").st_dev == os.stat(Path.cwd()).st_dev,
                    reason="no second filesystem (/dev/shm) for the state folder")
def test_a_checkpoint_of_more_files_than_the_open_files_limit_is_uploaded_whole(
        tmp_path: Path) -> None:
    """A torch.distributed.checkpoint folder of 401 files, the sidecar under `ulimit -n 300`,
    its state folder on another filesystem (a pod's emptyDir beside the trainer's volume):
    no hard link can hold them, so descriptors do as far as the limit allows and the rest are
    read where they lie, said in a WARNING (every descriptor was asked for, the open failed
    with EMFILE and the checkpoint was refused for good)."""
    import resource
    import shutil
    import tempfile

    state = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="sidecar-state-"))
    files = {".metadata": b"meta", **{f"__{i}_0.distcp": bytes([i % 256]) * 64
                                       for i in range(400)}}
    try:
        with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID) as ingest:
            folder = tmp_path / "ckpt"
            folder.mkdir()
            watch = Watch(ingest, tmp_path, folder, mapped=False, SIDECAR_STATE_DIR=str(state),
                          **CONTAINER)
            watch.preexec_fn = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
            watch.start()
            save(folder, "step-100", files)
            ingest.wait_for(lambda: artifacts(ingest), 60, "registered")
            done = watch.stop()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    said = done.stderr.decode()
    assert done.status == 0, said[-3000:]
    [warning] = [line for line in said.splitlines() if "are not held" in line]
    assert "ulimit -n 300" in warning and "of the 401 files of" in warning
    assert "not uploaded" not in said
    objects = tmp_path / "received" / "objects" / RUN_ID / "checkpoints" / "step-100"
    assert all((objects / rel).read_bytes() == data for rel, data in files.items())


def test_an_upload_that_cannot_end_within_the_drain_is_said_at_the_stop_with_what_it_needs(
        tmp_path: Path) -> None:
    """SIGTERM while 1 MB is sent at 200 kB/s with a 1 s drain: the WARNING comes at once,
    naming about how long the upload needs and what to raise, and the ledger keeps it."""
    with running_ingest(tmp_path / "received", token=TOKEN, run_id=RUN_ID) as ingest:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        watch = Watch(ingest, tmp_path, folder, "--upload-rate", "200000", "--drain-timeout",
                      "1", mapped=False, **CONTAINER).start()
        save(folder, "export-30", hf_export([500_000, 500_000], seed=83))
        ingest.wait_for(lambda: asked(ingest), 60, "the upload began")
        done = watch.stop()
        registered = artifacts(ingest)
    said = done.stderr.decode()
    assert done.status == 0, said[-3000:]
    assert not registered
    [warning] = [line for line in said.splitlines() if "need about" in line]
    assert "1 checkpoint upload(s) need about" in warning
    assert "at 0.2 MB/s), past the " in warning, warning
    assert " s the drain has left (--drain-timeout)" in warning, warning
    assert "terminationGracePeriodSeconds" in warning
    needs = float(warning.split("need about ")[1].split("s more")[0])
    assert 1 < needs <= 6
