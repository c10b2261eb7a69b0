"""`sidecar inject`, the admission webhook, through the real server over HTTPS: reviews built
from the pods JobSet, Kubeflow's PyTorchJob and KubeRay make, the answered JSON Patch applied
with a real implementation (jsonpatch) and the patched pod validated against Kubernetes'
schemas, 1.29 (native sidecars on by default) and the latest kubernetes-validate has."""

from __future__ import annotations

import base64
import copy
import json
import ssl
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from tests.conftest import Sidecar
from tests.ingest_server import wait_until
from tests.test_check import self_signed_certificate

VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
TOKEN_REF = {"secretKeyRef": {"name": "run-4f2a91-token", "key": "token"}}
PLATFORM_ENV = [
    {"name": "STARFORGE_ENABLED", "value": "1"},
    {"name": "STARFORGE_ENDPOINT", "value": "https://ingest.starforge.example/api/ingest"},
    {"name": "STARFORGE_RUN_ID", "value": "run-4f2a91"},
    {"name": "STARFORGE_TOKEN", "valueFrom": TOKEN_REF},
]

# A pod of a JobSet (a Kubeflow Trainer TrainJob's, node 0): what the Job controller creates.
JOBSET_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {
        "generateName": "llama-sft-node-0-0-", "namespace": "team-a",
        "labels": {"jobset.sigs.k8s.io/jobset-name": "llama-sft",
                   "jobset.sigs.k8s.io/replicatedjob-name": "node",
                   "jobset.sigs.k8s.io/job-index": "0",
                   "batch.kubernetes.io/job-name": "llama-sft-node-0",
                   "batch.kubernetes.io/job-completion-index": "0"},
        "annotations": {"jobset.sigs.k8s.io/jobset-name": "llama-sft",
                        "batch.kubernetes.io/job-completion-index": "0",
                        "sidecar/jsonl": "/workspace/out/metrics.jsonl",
                        "sidecar/checkpoints": "/workspace/checkpoints"},
        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                             "name": "llama-sft-node-0", "uid": str(uuid.uuid4()),
                             "controller": True, "blockOwnerDeletion": True}],
    },
    "spec": {
        "restartPolicy": "Never", "subdomain": "llama-sft", "hostname": "llama-sft-node-0-0",
        "containers": [{
            "name": "node", "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
            "command": ["torchrun", "--nnodes=2", "--nproc-per-node=8", "train.py"],
            "env": [*PLATFORM_ENV,
                    {"name": "PET_NNODES", "value": "2"},
                    {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                        "fieldPath": "metadata.annotations['batch.kubernetes.io/"
                                     "job-completion-index']"}}},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf",
                                                                        "key": "token"}}}],
            "resources": {"limits": {"nvidia.com/gpu": "8"}},
            "volumeMounts": [{"name": "workspace", "mountPath": "/workspace"},
                             {"name": "dshm", "mountPath": "/dev/shm"}]}],
        "volumes": [{"name": "workspace", "emptyDir": {}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    },
}

# The master of a PyTorchJob (Kubeflow's training operator), its data on a volume claim.
PYTORCHJOB_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {
        "name": "bert-master-0", "namespace": "team-b",
        "labels": {"training.kubeflow.org/job-name": "bert",
                   "training.kubeflow.org/operator-name": "pytorchjob-controller",
                   "training.kubeflow.org/replica-type": "master",
                   "training.kubeflow.org/replica-index": "0",
                   "training.kubeflow.org/job-role": "master"},
        "annotations": {"sidecar/tensorboard": "/data/runs/bert",
                        "sidecar/stacks": "true"},
    },
    "spec": {
        "restartPolicy": "OnFailure",
        "initContainers": [{"name": "fetch-data", "image": "busybox:1.36",
                            "command": ["sh", "-c", "true"]}],
        "containers": [{
            "name": "pytorch", "image": "registry.example/bert:3",
            "env": [{"name": "TUNEPLANE_JOB_ENABLED", "value": "1"},
                    {"name": "TUNEPLANE_JOB_ENDPOINT", "value": "https://tuneplane.example/api"},
                    {"name": "TUNEPLANE_JOB_RUN_ID", "value": "job-77"},
                    {"name": "TUNEPLANE_JOB_TOKEN", "valueFrom": TOKEN_REF},
                    {"name": "MASTER_ADDR", "value": "bert-master-0"},
                    {"name": "WORLD_SIZE", "value": "4"}, {"name": "RANK", "value": "0"},
                    {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "volumeMounts": [{"name": "data", "mountPath": "/data", "subPath": "bert"}]}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
    },
}

# The head of a KubeRay RayCluster (a RayJob's), platform variables from a ConfigMap.
RAY_HEAD_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {
        "generateName": "rl-cluster-head-", "namespace": "team-c",
        "labels": {"ray.io/cluster": "rl-cluster", "ray.io/node-type": "head",
                   "ray.io/group": "headgroup", "ray.io/identifier": "rl-cluster-head",
                   "app.kubernetes.io/created-by": "kuberay-operator"},
        "annotations": {"sidecar/validation": "/tmp/ray/outputs/val",
                        "sidecar/hparams": "/tmp/ray/outputs/config.yaml"},
    },
    "spec": {
        "containers": [{
            "name": "ray-head", "image": "rayproject/ray:2.40.0-gpu",
            "command": ["/bin/bash", "-lc", "--"],
            "args": ["ulimit -n 65536; ray start --head --block"],
            "envFrom": [{"configMapRef": {"name": "platform"}}],
            "ports": [{"containerPort": 6379, "name": "gcs"}],
            "volumeMounts": [{"name": "log-volume", "mountPath": "/tmp/ray"}]}],
        "volumes": [{"name": "log-volume", "emptyDir": {}}],
    },
}

PODS = {"jobset": JOBSET_POD, "pytorchjob": PYTORCHJOB_POD, "kuberay": RAY_HEAD_POD}


def review(pod: Any, **request: Any) -> dict[str, Any]:
    """The AdmissionReview the API server sends for the creation of `pod`."""
    namespace = pod.get("metadata", {}).get("namespace", "default") if isinstance(
        pod, dict) else "default"
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "namespace": namespace, "operation": "CREATE",
        "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
        "object": pod, "oldObject": None, "dryRun": False, **request}}


class Webhook:
    """The real `sidecar inject` on loopback, and a client that trusts its certificate."""

    def __init__(self, tmp_path: Path, *options: str) -> None:
        cert, key = self_signed_certificate(tmp_path)
        ready = tmp_path / "url"
        self.proc = Sidecar(["inject", "--listen", "127.0.0.1:0", "--tls-cert", str(cert),
                             "--tls-key", str(key), "--image", "registry.example/sidecar:1.4",
                             "--ready-file", str(ready), *options], {"PATH": "/usr/bin:/bin"},
                            tmp_path / "inject")
        wait_until(lambda: ready.exists() and ready.read_text().endswith("\n"), 30,
                   "the webhook listens")
        self.url = ready.read_text().strip()
        self.context = ssl.create_default_context(cafile=str(cert))

    def post(self, body: bytes, path: str = "/mutate") -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=self.context, timeout=10) as answer:
            assert answer.status == 200
            result: dict[str, Any] = json.loads(answer.read())
        return result

    def answer(self, doc: Any, path: str = "/mutate") -> dict[str, Any]:
        response: dict[str, Any] = self.post(json.dumps(doc).encode(), path)["response"]
        return response

    def healthy(self) -> bool:
        with urllib.request.urlopen(self.url + "/healthz", context=self.context,
                                    timeout=10) as answer:
            return bool(answer.status == 200 and answer.read() == b"ok")


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    server = Webhook(tmp_path_factory.mktemp("webhook"))
    try:
        yield server
    finally:
        server.proc.proc.terminate()
        assert server.proc.wait(20).status == 0


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """`pod` with the answer's JSON Patch applied (unchanged when there is none)."""
    if "patch" not in response:
        return copy.deepcopy(pod)
    assert response["patchType"] == "JSONPatch"
    patch = jsonpatch.JsonPatch(json.loads(base64.b64decode(response["patch"])))
    result: dict[str, Any] = patch.apply(pod)
    return result


def valid(pod: dict[str, Any]) -> None:
    named = copy.deepcopy(pod)
    named["metadata"].setdefault("name", named["metadata"].get("generateName", "p") + "x")
    for version in VERSIONS:
        kubernetes_validate.validate(named, version, strict=True)


def the_sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = pod["spec"]["initContainers"][0]
    assert first["name"] == "sidecar"
    return first


@pytest.mark.parametrize("made_by", list(PODS))
def test_a_training_operator_s_pod_gets_the_native_sidecar_once(webhook: Webhook,
                                                                made_by: str) -> None:
    pod = PODS[made_by]
    sent = review(pod)
    response = webhook.answer(sent)
    assert response["uid"] == sent["request"]["uid"] and response["allowed"] is True
    assert "warnings" not in response, response
    after = patched(pod, response)
    valid(after)
    sidecar = the_sidecar(after)
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: never holds the Job open
    assert sidecar["image"] == "registry.example/sidecar:1.4"
    assert sidecar["args"][0] == "watch"
    trainer = after["spec"]["containers"][0]
    env = {var["name"]: var for var in sidecar["env"]}
    for var in trainer.get("env", []):  # the platform's variables, as the trainer has them
        if var["name"].startswith(("STARFORGE_", "TUNEPLANE_JOB_")):
            assert env[var["name"]] == var
    token = env.get("STARFORGE_TOKEN") or env.get("TUNEPLANE_JOB_TOKEN")
    if trainer.get("env"):
        assert token == {"name": token["name"], "valueFrom": TOKEN_REF}  # type: ignore[index]
        assert "HF_TOKEN" not in env and "MASTER_ADDR" not in env  # nothing else of it
    else:
        assert sidecar["envFrom"] == trainer["envFrom"]
    assert env["POD_UID"] == {"name": "POD_UID",
                              "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
    # every path asked for, on the trainer's volume at the same path, read-only
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    for key, value in pod["metadata"]["annotations"].items():
        if key.removeprefix("sidecar/") in ("jsonl", "tensorboard", "checkpoints",
                                            "validation", "hparams"):
            assert f"--{key.removeprefix('sidecar/')}={value}" in sidecar["args"]
            held = max((m for m in trainer["volumeMounts"]
                        if value.startswith(m["mountPath"] + "/")),
                       key=lambda m: len(m["mountPath"]))
            assert mounts[held["mountPath"]] == {**held, "readOnly": True}
    # the console from the node's CRI files of this pod's trainer container
    assert (f"--log=/var/log/pods/$(POD_NAMESPACE)_$(POD_NAME)_$(POD_UID)/{trainer['name']}"
            "/*.log") in sidecar["args"]
    assert mounts["/var/log/pods"]["readOnly"] is True
    stacks = pod["metadata"]["annotations"].get("sidecar/stacks") == "true"
    assert after["spec"].get("shareProcessNamespace", False) is stacks
    assert ("SYS_PTRACE" in sidecar["securityContext"]["capabilities"].get("add", [])) is stacks
    assert not any("SYS_PTRACE" in c.get("securityContext", {}).get("capabilities", {}).get(
        "add", []) for c in after["spec"]["containers"])  # for the sidecar alone
    # the reinvocation, or a second review of the same pod: nothing more
    again = webhook.answer(review(after))
    assert "patch" not in again and again["allowed"] is True


def test_a_webhook_after_ours_that_strips_restart_policy_is_undone_at_the_reinvocation(
        webhook: Webhook) -> None:
    after = patched(JOBSET_POD, webhook.answer(review(JOBSET_POD)))
    for container in after["spec"]["initContainers"]:  # the other webhook's mutation
        container.pop("restartPolicy", None)
    restored = patched(after, webhook.answer(review(after)))
    assert the_sidecar(restored)["restartPolicy"] == "Always"
    valid(restored)


@pytest.mark.parametrize("how", ["annotation", "no operator label"])
def test_a_pod_not_asking_is_left_alone(webhook: Webhook, how: str) -> None:
    pod = copy.deepcopy(JOBSET_POD)
    if how == "annotation":
        pod["metadata"]["annotations"]["sidecar/inject"] = "false"
    else:
        pod["metadata"]["labels"] = {"app": "web"}
    response = webhook.answer(review(pod))
    assert response["allowed"] is True and "patch" not in response


def test_a_pod_asking_by_annotation_alone_is_injected(webhook: Webhook) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "train", "namespace": "team-a",
                        "annotations": {"sidecar/inject": "true", "sidecar/console": "off"}},
           "spec": {"containers": [{"name": "train", "image": "trainer"}]}}
    after = patched(pod, webhook.answer(review(pod)))
    valid(after)
    assert the_sidecar(after)["args"] == ["watch"]
    assert [v["name"] for v in after["spec"]["volumes"]] == ["sidecar-state"]


def test_a_path_on_no_volume_is_said_and_left_out(webhook: Webhook) -> None:
    pod = copy.deepcopy(JOBSET_POD)
    pod["metadata"]["annotations"]["sidecar/jsonl"] = "/root/metrics.jsonl"
    response = webhook.answer(review(pod))
    assert any("/root/metrics.jsonl lies on no volume that container node mounts" in w
               for w in response["warnings"]), response
    sidecar = the_sidecar(patched(pod, response))
    assert not any(arg.startswith("--jsonl") for arg in sidecar["args"])


MALFORMED: dict[str, Any] = {
    "not JSON": b"{not json",
    "a list": b"[]",
    "no request": json.dumps({"kind": "AdmissionReview"}).encode(),
    "no uid": json.dumps({"request": {"object": JOBSET_POD}}).encode(),
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "1 MB of text": json.dumps({"request": {"uid": "u", "x": "y" * (1 << 20)}}).encode(),
    "4 MB": b" " * (4 << 20),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_review_it_cannot_read_is_allowed_unchanged(webhook: Webhook, name: str) -> None:
    answered = webhook.post(MALFORMED[name])
    assert answered["kind"] == "AdmissionReview"
    assert answered["response"]["allowed"] is True and "patch" not in answered["response"]
    assert webhook.healthy()


def odd(what: str) -> dict[str, Any]:
    """A review that is read but must leave its object unchanged."""
    if what == "a deployment":
        sent = review({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {}})
        sent["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
        return sent
    if what == "a dry run":
        return review(JOBSET_POD, dryRun=True)
    if what == "an update":
        return review(JOBSET_POD, operation="UPDATE")
    if what == "no containers":
        pod = copy.deepcopy(JOBSET_POD)
        pod["spec"]["containers"] = []
        return review(pod)
    if what == "a spec that is a list":
        pod = copy.deepcopy(JOBSET_POD)
        pod["spec"] = ["x"]
        return review(pod)
    if what == "a 1 MB pod":
        pod = copy.deepcopy(PYTORCHJOB_POD)
        pod["metadata"]["labels"] = {}
        pod["metadata"]["annotations"]["notes"] = "n" * (1 << 20)
        return review(pod)
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["a deployment", "a dry run", "an update", "no containers",
                                  "a spec that is a list", "a 1 MB pod"])
def test_a_review_that_is_no_pod_creation_to_inject_is_allowed_unchanged(
        webhook: Webhook, what: str) -> None:
    sent = odd(what)
    response = webhook.answer(sent)
    assert response["uid"] == sent["request"]["uid"]
    assert response["allowed"] is True and "patch" not in response


async def test_a_renewed_certificate_is_served_to_the_next_handshake(tmp_path: Path) -> None:
    """cert-manager renews the Secret's files in place: new handshakes get the new pair with
    no restart, and a pair that cannot be loaded leaves the old one served."""
    import asyncio

    from sidecar.commands.inject import Certificate

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    cert, key = self_signed_certificate(first)
    certificate = Certificate(cert, key)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0,
                                        ssl=certificate.context)
    port = server.sockets[0].getsockname()[1]

    async def trusted_by(ca: Path) -> bool:
        try:
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=ssl.create_default_context(cafile=str(ca)))
        except ssl.SSLCertVerificationError:
            return False
        writer.close()
        return True

    try:
        new_cert, new_key = self_signed_certificate(second)
        assert await trusted_by(cert) and not await trusted_by(new_cert)
        old = tmp_path / "old.pem"
        old.write_bytes(cert.read_bytes())
        cert.write_bytes(new_cert.read_bytes())
        key.write_bytes(new_key.read_bytes())
        certificate.reload_if_changed()
        assert await trusted_by(new_cert) and not await trusted_by(old)
        key.write_text("not a key")  # a renewal cut short: the pair in place stays
        certificate.reload_if_changed()
        assert await trusted_by(new_cert)
    finally:
        server.close()
        await server.wait_closed()


def test_in_a_namespace_enforcing_pod_security_the_sidecar_asks_for_nothing_it_refuses(
        webhook: Webhook) -> None:
    """Baseline and restricted refuse a hostPath volume and an added capability: the pod would
    be refused for what the webhook added. Through /mutate/restricted (the configuration routes
    those namespaces there) the sidecar has neither, says why, and passes restricted itself."""
    response = webhook.answer(review(PYTORCHJOB_POD), "/mutate/restricted")
    [warning] = response["warnings"]
    assert "the console is not read" in warning and "no stacks at a stall" in warning
    after = patched(PYTORCHJOB_POD, response)
    valid(after)
    sidecar = the_sidecar(after)
    assert not any(arg.startswith("--log=") for arg in sidecar["args"])
    assert "hostPath" not in json.dumps(after["spec"]["volumes"])
    assert "shareProcessNamespace" not in after["spec"]
    context = sidecar["securityContext"]
    assert context["runAsNonRoot"] is True and context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is False
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "--tensorboard=/data/runs/bert" in sidecar["args"]  # the rest as anywhere


@pytest.mark.parametrize(("asked", "grace", "expected"), [
    ("900", None, 910), ("900", 1200, 1200), ("5", None, 30), ("soon", None, None)])
def test_a_drain_the_pod_asks_for_is_the_sidecar_s_and_fits_the_grace_period(
        webhook: Webhook, asked: str, grace: int | None, expected: int | None) -> None:
    """A large final checkpoint needs more than the 20 s default drain, and the kubelet kills
    the sidecar once the pod's grace period (30 s unless given) runs out."""
    pod = copy.deepcopy(JOBSET_POD)
    pod["metadata"]["annotations"]["sidecar/drain-timeout"] = asked
    if grace is not None:
        pod["spec"]["terminationGracePeriodSeconds"] = grace
    response = webhook.answer(review(pod))
    after = patched(pod, response)
    valid(after)
    env = {var["name"]: var.get("value") for var in the_sidecar(after)["env"]}
    if expected is None:
        assert "SIDECAR_DRAIN_TIMEOUT" not in env
        assert any("sidecar/drain-timeout='soon'" in w for w in response["warnings"])
        assert "terminationGracePeriodSeconds" not in after["spec"]
        return
    assert env["SIDECAR_DRAIN_TIMEOUT"] == asked
    assert after["spec"].get("terminationGracePeriodSeconds", 30) == expected


def test_a_label_or_annotation_the_operator_names_asks_for_the_sidecar_too(
        tmp_path: Path) -> None:
    """The platform's own executor marks its pods its own way: `--select KEY[=VALUE]`."""
    server = Webhook(tmp_path, "--select", "platform.example/kind=training",
                     "--select", "platform.example/report")
    try:
        def pod(labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
            return {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "p", "labels": labels, "annotations": annotations},
                    "spec": {"containers": [{"name": "train", "image": "trainer"}]}}

        for labels, annotations, injected in (
                ({"platform.example/kind": "training"}, {}, True),
                ({"platform.example/kind": "serving"}, {}, False),
                ({}, {"platform.example/report": "yes"}, True),
                ({"app": "web"}, {}, False)):
            response = server.answer(review(pod(labels, annotations)))
            assert ("patch" in response) is injected, (labels, annotations)
    finally:
        server.proc.proc.terminate()
        assert server.proc.wait(20).status == 0


def test_a_container_of_the_pod_s_own_named_sidecar_is_said_not_taken_for_ours(
        webhook: Webhook) -> None:
    pod = copy.deepcopy(JOBSET_POD)
    pod["spec"]["containers"].append({"name": "sidecar", "image": "envoy"})
    response = webhook.answer(review(pod))
    assert "patch" not in response
    assert any("a container named 'sidecar' already" in w for w in response["warnings"])
