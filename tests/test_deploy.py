"""The deployment files say what a reviewer checks (issue 7).

The Kubernetes tests render the kustomize overlays and the injector's webhook with `kubectl
kustomize` (offline) and are skipped where kubectl is absent; make-certs.sh's are skipped where
openssl is. Schema validation, hadolint and systemd-analyze run in deploy/validate.sh; the
bundle is built and run by deploy/bundle/build.sh.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import fnmatch
import functools
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import yaml

from sidecar.options import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kubernetes" / "overlays").iterdir() if p.is_dir())
# Overlays where the sidecar is its own container (the wrapper runs it inside the trainer's).
POD_SIDECAR_OVERLAYS = ["native-sidecar", "cri-logs", "multi-node", "checkpoint-upload"]
KUBECTL = shutil.which("kubectl")
DRAIN_TIMEOUT_S = next(float(o.default) for o in OPTIONS if o.name == "drain-timeout")
# What SIGKILL-free shutdown needs beyond the drain itself: the process's own exit, the kubelet.
SHUTDOWN_MARGIN_S = 5
SOURCE_OPTIONS = ("--log", "--jsonl", "--tensorboard")
# A checkpoint of a 7B model with its optimizer state: fp32 weights and Adam's two moments.
SEVEN_B_CHECKPOINT_GB = 85
RUN = "run-4f2a91"

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")

Manifest = dict[str, Any]


def render(overlay: str) -> list[Manifest]:
    """The overlay's objects as `kubectl kustomize` renders them (a fresh copy each call)."""
    return copy.deepcopy(_rendered(overlay))


def _rendered(overlay: str) -> list[Manifest]:
    return _kustomize(DEPLOY / "kubernetes" / "overlays" / overlay)


@functools.cache
def _kustomize(kustomization: Path) -> list[Manifest]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(kustomization)],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def the(objects: list[Manifest], kind: str) -> Manifest:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(overlay: str) -> Manifest:
    spec: Manifest = the(render(overlay), "Job")["spec"]["template"]["spec"]
    return spec


def container(spec: Manifest, name: str) -> Manifest:
    every = spec.get("initContainers", []) + spec["containers"]
    found: list[Manifest] = [c for c in every if c["name"] == name]
    assert found, f"no container {name!r} in {[c['name'] for c in every]}"
    return found[0]


def env(c: Manifest) -> dict[str, Any]:
    """Each variable's literal value, or its valueFrom."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def option_values(c: Manifest, option: str) -> list[str]:
    """Every value of `--option` given as `--option=VALUE` in the container's command and args."""
    argv = c.get("command", []) + c.get("args", [])
    return [a.split("=", 1)[1] for a in argv if a.startswith(option + "=")]


def drain_timeout_s(c: Manifest) -> float:
    given = [*option_values(c, "--drain-timeout"), env(c).get("SIDECAR_DRAIN_TIMEOUT")]
    return DRAIN_TIMEOUT_S if given[0] is None else float(given[0])


def mount_for(c: Manifest, path: str) -> Manifest:
    """The container's volume mount that holds `path` (the deepest one)."""
    holding = [m for m in c.get("volumeMounts", [])
               if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert holding, f"{c['name']}: nothing mounted at {path}"
    deepest: Manifest = max(holding, key=lambda m: len(m["mountPath"]))
    return deepest


def volume(spec: Manifest, name: str) -> Manifest:
    found: Manifest = next(v for v in spec["volumes"] if v["name"] == name)
    return found


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_one_job(overlay: str) -> None:
    objects = render(overlay)
    assert the(objects, "Job")["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert all(o.get("apiVersion") and o["metadata"].get("name") for o in objects)


@needs_kubectl
def test_native_sidecar_is_an_init_container_that_restarts_always() -> None:
    spec = pod_spec("native-sidecar")
    sidecar = container(spec, "sidecar")
    assert sidecar in spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["args"][0] == "watch"
    assert [c["name"] for c in spec["containers"]] == ["trainer"]


def in_trainer(spec: Manifest, path: str) -> str:
    """`path` as the sidecar sees it, as the trainer sees it (through the same volume)."""
    mount = mount_for(container(spec, "sidecar"), path)
    shared = [m for m in container(spec, "trainer")["volumeMounts"] if m["name"] == mount["name"]]
    assert shared, f"the trainer does not mount the volume holding {path}"
    assert not shared[0].get("readOnly"), f"the trainer cannot write {path}"
    return str(shared[0]["mountPath"]) + path[len(mount["mountPath"]):]


@needs_kubectl
def test_sidecar_follows_files_in_an_emptydir_the_trainer_writes() -> None:
    spec = pod_spec("native-sidecar")
    sidecar, trainer = container(spec, "sidecar"), container(spec, "trainer")
    for option in SOURCE_OPTIONS:
        [path] = option_values(sidecar, option)
        mount = mount_for(sidecar, path)
        assert mount.get("readOnly") is True, "the sidecar only reads the trainer's files"
        assert "emptyDir" in volume(spec, mount["name"])
        in_trainer(spec, path)
    # The trainer is told to write its metrics and events where the sidecar looks.
    written = [a.split("=", 1)[1] for a in trainer["args"] if "=" in a]
    for option in ("--jsonl", "--tensorboard"):
        [path] = option_values(sidecar, option)
        assert [w for w in written if fnmatch.fnmatch(w, in_trainer(spec, path))], option


@needs_kubectl
@pytest.mark.parametrize("overlay", POD_SIDECAR_OVERLAYS)
def test_sidecar_container_is_locked_down(overlay: str) -> None:
    spec = pod_spec(overlay)
    assert_locked_down(container(spec, "sidecar"))


@needs_kubectl
def test_bundle_copier_is_locked_down() -> None:
    assert_locked_down(container(pod_spec("wrapper"), "sidecar-bundle"))


def assert_locked_down(c: Manifest) -> None:
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc.get("runAsUser", 1) != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not sc.get("privileged", False)
    assert {"requests", "limits"} <= set(c["resources"])
    assert "nvidia.com/gpu" not in c["resources"]["limits"]


@needs_kubectl
@pytest.mark.parametrize("overlay", POD_SIDECAR_OVERLAYS)
def test_state_dir_is_a_writable_volume(overlay: str) -> None:
    spec = pod_spec(overlay)
    sidecar = container(spec, "sidecar")
    mount = mount_for(sidecar, env(sidecar)["SIDECAR_STATE_DIR"])
    assert not mount.get("readOnly") and "emptyDir" in volume(spec, mount["name"])


@needs_kubectl
@pytest.mark.parametrize("overlay", POD_SIDECAR_OVERLAYS)
def test_liveness_probe_reaches_the_status_server(overlay: str) -> None:
    sidecar = container(pod_spec(overlay), "sidecar")
    probe = sidecar["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    port = ports.get(probe["port"], probe["port"])
    host, _, bound = env(sidecar)["SIDECAR_STATUS_ADDR"].rpartition(":")
    # The kubelet probes the pod's IP, so loopback (the default) would fail every probe.
    assert host == "0.0.0.0"
    assert int(bound) == port


@needs_kubectl
async def test_probe_path_is_served_by_the_status_server() -> None:
    from sidecar.observe.endpoint import start_status_server

    path = container(pod_spec("native-sidecar"), "sidecar")["livenessProbe"]["httpGet"]["path"]

    def snapshot() -> Any:
        raise AssertionError("a liveness probe must not need a status snapshot")

    server = await start_status_server("127.0.0.1:0", None, snapshot)
    assert server is not None
    try:
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://{server.address}{path}") as response:
            assert response.status == 200
    finally:
        await server.close()


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_exceeds_the_drain_timeout(overlay: str) -> None:
    spec = pod_spec(overlay)
    name = "trainer" if overlay == "wrapper" else "sidecar"
    drain_s = drain_timeout_s(container(spec, name))
    assert spec["terminationGracePeriodSeconds"] >= drain_s + SHUTDOWN_MARGIN_S


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_token_is_a_mounted_secret_file(overlay: str) -> None:
    spec = pod_spec(overlay)
    c = container(spec, "trainer" if overlay == "wrapper" else "sidecar")
    mount = mount_for(c, env(c)["SIDECAR_TOKEN_FILE"])
    assert mount["readOnly"] is True and "secret" in volume(spec, mount["name"])
    every = spec.get("initContainers", []) + spec["containers"]
    assert not [n for x in every for n, v in env(x).items() if "TOKEN" in n and isinstance(v, str)
                and n != "SIDECAR_TOKEN_FILE"], "a token written into the manifest"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_and_pod_come_from_the_downward_api(overlay: str) -> None:
    c = container(pod_spec(overlay), "trainer" if overlay == "wrapper" else "sidecar")
    fields = {n: v["fieldRef"]["fieldPath"] for n, v in env(c).items()
              if isinstance(v, dict) and "fieldRef" in v}
    assert fields["NODE_NAME"] == "spec.nodeName"
    assert fields["POD_NAME"] == "metadata.name"
    assert fields["POD_NAMESPACE"] == "metadata.namespace"


@needs_kubectl
@pytest.mark.parametrize("overlay", POD_SIDECAR_OVERLAYS)
def test_sidecar_sees_gpus_without_requesting_any_and_the_trainers_processes(
        overlay: str) -> None:
    """NVIDIA_VISIBLE_DEVICES=all shows it every GPU of the node; the shared process namespace
    lets it tell the trainer's GPUs from other pods' (by NVML's per-GPU process list)."""
    spec = pod_spec(overlay)
    assert env(container(spec, "sidecar"))["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" in container(spec, "trainer")["resources"]["limits"]
    assert spec["shareProcessNamespace"] is True


@needs_kubectl
def test_the_stacks_overlay_may_trace_the_trainer_and_nothing_more() -> None:
    """docs/stalls.md#where-it-cannot-look: the sidecar sees the trainer's processes and may
    ptrace them (CAP_SYS_PTRACE, effective only for root: Kubernetes sets no ambient
    capabilities); every other capability dropped, no escalation, a read-only root."""
    spec = pod_spec("stacks")
    assert spec["shareProcessNamespace"] is True
    sc = container(spec, "sidecar")["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert not sc.get("privileged", False)
    assert container(spec, "trainer") == container(pod_spec("native-sidecar"), "trainer")
    base = pod_spec("native-sidecar")  # the rest as the base has it
    for key in ("args", "env", "volumeMounts", "resources"):
        assert container(spec, "sidecar")[key] == container(base, "sidecar")[key], key


@needs_kubectl
@pytest.mark.parametrize("overlay", POD_SIDECAR_OVERLAYS)
def test_every_option_the_sidecar_is_given_is_one_of_watch(overlay: str) -> None:
    """A misspelt option or value would stop the sidecar at start (exit 2), and only there."""
    options = {o.name: o for o in OPTIONS if o.only != "run"}
    for argument in container(pod_spec(overlay), "sidecar")["args"][1:]:
        name, _, value = argument.removeprefix("--").partition("=")
        assert name in options, argument
        assert not options[name].choices or value in options[name].choices, argument


@needs_kubectl
def test_checkpoints_hparams_and_validation_are_read_where_the_trainer_writes_them() -> None:
    spec = pod_spec("checkpoint-upload")
    sidecar, trainer = container(spec, "sidecar"), container(spec, "trainer")
    written = [a.split("=", 1)[1] for a in trainer["args"] if "=" in a]
    for option in ("--checkpoints", "--hparams", "--validation"):
        [path] = option_values(sidecar, option)
        mount = mount_for(sidecar, path)
        assert mount.get("readOnly") is True, "the sidecar only reads the trainer's files"
        assert "emptyDir" in volume(spec, mount["name"])
        assert in_trainer(spec, path) in written, option
    # Uploaded wherever the sidecar runs: a local path is gone with the pod.
    assert option_values(sidecar, "--checkpoint-upload") == ["always"]
    # The base's sources, as they were.
    base = container(pod_spec("native-sidecar"), "sidecar")["args"]
    assert sidecar["args"][:len(base)] == base


@needs_kubectl
def test_the_checkpoint_folder_is_sized_by_the_trainers_ephemeral_storage() -> None:
    """Not a fixed sizeLimit (the base's 10Gi is less than one checkpoint of a 7B model with its
    optimizer state): the trainer's ephemeral-storage limit bounds the pod, the emptyDir
    included, and its request places the pod on a node with that much disk."""
    spec = pod_spec("checkpoint-upload")
    [path] = option_values(container(spec, "sidecar"), "--checkpoints")
    folder = volume(spec, mount_for(container(spec, "sidecar"), path)["name"])
    assert "sizeLimit" not in folder["emptyDir"] and "medium" not in folder["emptyDir"]
    resources = container(spec, "trainer")["resources"]
    storage = resources["limits"]["ephemeral-storage"]
    assert resources["requests"]["ephemeral-storage"] == storage
    assert storage.endswith("Gi") and int(storage[:-2]) >= 2 * SEVEN_B_CHECKPOINT_GB
    assert resources["limits"]["nvidia.com/gpu"] == 8


@needs_kubectl
def test_the_drain_leaves_time_to_upload_the_last_checkpoint() -> None:
    """The trainer's last checkpoint is uploaded after it exits: the drain (and the grace period
    above it) lets one of a 7B model with its optimizer state go at --upload-rate."""
    spec = pod_spec("checkpoint-upload")
    sidecar = container(spec, "sidecar")
    rate = next(int(o.default) for o in OPTIONS if o.name == "upload-rate")
    assert not option_values(sidecar, "--upload-rate")
    assert drain_timeout_s(sidecar) * rate >= SEVEN_B_CHECKPOINT_GB * 1e9
    assert spec["terminationGracePeriodSeconds"] >= drain_timeout_s(sidecar) + SHUTDOWN_MARGIN_S


@needs_kubectl
def test_the_wrapper_is_its_containers_pid_1() -> None:
    assert "shareProcessNamespace" not in pod_spec("wrapper")


# A stand-in trainer: prints, exits with argv[1]; on SIGTERM prints again ("checkpointing") and
# exits with argv[2].
TRAINER = """
import signal, sys, time
def stop(*_):
    print("checkpoint saved", flush=True)
    sys.exit(int(sys.argv[2]))
signal.signal(signal.SIGTERM, stop)
print("step 1", flush=True)
if sys.argv[1] == "wait":
    time.sleep(30)
sys.exit(int(sys.argv[1]))
"""


def start_teeing_trainer(tmp_path: Path, *trainer_args: str) -> subprocess.Popen[str]:
    """The native-sidecar overlay's trainer command, run here with the stand-in trainer."""
    trainer = container(pod_spec("native-sidecar"), "trainer")
    assert "$(" not in " ".join(trainer["command"]), "the kubelet would expand $(...)"
    command = [a.replace("/run/sidecar", str(tmp_path)) for a in trainer["command"]]
    return subprocess.Popen([*command, sys.executable, "-c", TRAINER, *trainer_args],
                            stdout=subprocess.PIPE, text=True)


@needs_kubectl
@pytest.mark.parametrize("status", [0, 3])
def test_teeing_trainer_exits_with_its_own_status(tmp_path: Path, status: int) -> None:
    shell = start_teeing_trainer(tmp_path, str(status), "0")
    stdout, _ = shell.communicate(timeout=30)
    assert shell.returncode == status
    assert stdout == "step 1\n" == (tmp_path / "logs" / "train.log").read_text()
    # ...in a file the sidecar follows.
    spec = pod_spec("native-sidecar")
    [log] = option_values(container(spec, "sidecar"), "--log")
    followed = in_trainer(spec, log).replace("/run/sidecar", str(tmp_path))
    assert glob.glob(followed) == [str(tmp_path / "logs" / "train.log")]


@needs_kubectl
@pytest.mark.parametrize("status", [0, 143])
def test_teeing_trainer_gets_sigterm_and_its_last_words_are_kept(tmp_path: Path,
                                                                 status: int) -> None:
    shell = start_teeing_trainer(tmp_path, "wait", str(status))
    assert shell.stdout is not None and shell.stdout.readline() == "step 1\n"
    shell.send_signal(signal.SIGTERM)
    stdout, _ = shell.communicate(timeout=30)
    assert shell.returncode == status
    log = (tmp_path / "logs" / "train.log").read_text()
    assert stdout == "checkpoint saved\n" and log == "step 1\ncheckpoint saved\n"


@needs_kubectl
def test_cri_logs_are_read_through_a_read_only_host_mount() -> None:
    spec = pod_spec("cri-logs")
    sidecar, trainer = container(spec, "sidecar"), container(spec, "trainer")
    assert option_values(sidecar, "--log-format") == ["cri"]
    [log] = option_values(sidecar, "--log")
    assert log.startswith("/var/log/pods/$(POD_NAMESPACE)_$(POD_NAME)_$(POD_UID)/trainer/")
    assert {"POD_NAMESPACE", "POD_NAME", "POD_UID"} <= set(env(sidecar))
    mount = mount_for(sidecar, log)
    assert mount["readOnly"] is True
    assert volume(spec, mount["name"])["hostPath"]["path"] == "/var/log/pods"
    assert "tee" not in trainer["command"] + trainer.get("args", [])


@needs_kubectl
def test_wrapper_runs_the_trainer_under_the_copied_bundle() -> None:
    spec = pod_spec("wrapper")
    trainer, copier = container(spec, "trainer"), container(spec, "sidecar-bundle")
    assert [c["name"] for c in spec["initContainers"]] == ["sidecar-bundle"]
    assert "restartPolicy" not in copier, "the copier must finish before the trainer starts"
    assert trainer["command"][:2] == ["/sidecar/bin/sidecar", "run"]
    assert trainer["command"][-1] == "--"
    copied = mount_for(copier, "/sidecar")["name"]
    assert mount_for(trainer, "/sidecar/bin/sidecar")["name"] == copied
    assert "livenessProbe" not in trainer, "a sidecar hang must never restart the trainer"
    assert "SIDECAR_STATUS_ADDR" not in env(trainer), "loopback: nothing to probe or scrape"
    annotations = the(render("wrapper"), "Job")["spec"]["template"]["metadata"]
    assert "prometheus.io/scrape" not in annotations.get("annotations", {})


@needs_kubectl
def test_multi_node_rank_is_the_completion_index() -> None:
    objects = render("multi-node")
    job, service = the(objects, "Job"), the(objects, "Service")
    spec = job["spec"]["template"]["spec"]
    sidecar, trainer = container(spec, "sidecar"), container(spec, "trainer")
    assert job["spec"]["completionMode"] == "Indexed"
    nodes = job["spec"]["completions"]
    assert nodes > 1 and job["spec"]["parallelism"] == nodes
    assert int(env(sidecar)["SIDECAR_NODES"]) == nodes == int(env(trainer)["NNODES"])
    index = env(sidecar)["JOB_COMPLETION_INDEX"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert service["spec"]["clusterIP"] == "None" and spec["subdomain"] == service["metadata"][
        "name"]
    # The Job controller labels its pods with the Job's name: the Service selects these alone.
    labels = {**job["spec"]["template"]["metadata"]["labels"],
              "batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert service["spec"]["selector"].items() <= labels.items()
    assert check_names().problems(objects) == []


@functools.cache
def check_names() -> ModuleType:
    """deploy/kubernetes/check_names.py, which deploy/validate.sh runs on every rendering."""
    spec = importlib.util.spec_from_file_location("check_names",
                                                  DEPLOY / "kubernetes" / "check_names.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented_run_kustomization() -> str:
    """The per-run kustomization of docs/kubernetes.md#one-run-at-a-time, as a user copies it."""
    page = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    [block] = [b for b in re.findall(r"^```yaml\n(.*?)^```", page, re.M | re.S)
               if b.startswith("# runs/run-4f2a91/kustomization.yaml")]
    return block


def render_run(tmp_path: Path, kustomization: str) -> list[Manifest]:
    """`kustomization` rendered from runs/run-4f2a91/, beside this repository's deploy/."""
    run = tmp_path / "runs" / "run-4f2a91"
    run.mkdir(parents=True)
    (tmp_path / "deploy").symlink_to(DEPLOY)
    (run / "kustomization.yaml").write_text(kustomization)
    (run / "token").write_text("not-a-token\n")
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(run)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@needs_kubectl
def test_documented_per_run_names_reach_the_subdomain_selector_and_rendezvous(
        tmp_path: Path) -> None:
    objects = render_run(tmp_path, documented_run_kustomization())
    job, service = the(objects, "Job"), the(objects, "Service")
    assert job["metadata"]["name"] == service["metadata"]["name"] == "train-run-4f2a91"
    spec = job["spec"]["template"]["spec"]
    assert spec["subdomain"] == "train-run-4f2a91"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "train-run-4f2a91"}
    trainer = container(spec, "trainer")
    [address] = option_values(trainer, "--master-addr")
    assert check_names()._expand(address, {k: v for k, v in env(trainer).items()
                                           if isinstance(v, str)}) == \
        "train-run-4f2a91-0.train-run-4f2a91"
    assert check_names().problems(objects) == []


@needs_kubectl
def test_names_check_catches_a_rename_that_leaves_the_subdomain_behind(tmp_path: Path) -> None:
    """Without the replacements after the renaming, the rendezvous names a Service that is not
    there: the check validate.sh runs says so."""
    kustomization = re.sub(r"^transformers:.*\n(  - .*\n)+", "", documented_run_kustomization(),
                           flags=re.M)
    assert "transformers" not in kustomization
    found = check_names().problems(render_run(tmp_path, kustomization))
    assert any("subdomain 'train' names no Service" in p for p in found), found
    assert any("--master-addr" in p for p in found), found


# -- the injector's webhook (deploy/webhook) ----------------------------------------------------

WEBHOOK = DEPLOY / "webhook"
# The webhook's kustomizations: with cert-manager (the default) and without.
WEBHOOKS = {"cert-manager": WEBHOOK, "without-cert-manager":
            WEBHOOK / "overlays" / "without-cert-manager"}
OPENSSL = shutil.which("openssl")
SERVICE_DNS_NAME = "sidecar-injector.sidecar-system.svc"  # what the API server calls and verifies


def render_webhook(which: str) -> list[Manifest]:
    return copy.deepcopy(_kustomize(WEBHOOKS[which]))


def the_webhooks(objects: list[Manifest]) -> list[Manifest]:
    """The two webhooks: namespaces that enforce Pod Security's baseline or restricted level
    go to the second, whose sidecar asks for nothing those refuse."""
    webhooks: list[Manifest] = the(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert [w["clientConfig"]["service"]["path"] for w in webhooks] == [
        "/mutate", "/mutate/restricted"]
    enforced = [next(e for e in w["namespaceSelector"]["matchExpressions"]
                     if e["key"] == "pod-security.kubernetes.io/enforce") for w in webhooks]
    assert enforced == [{"key": "pod-security.kubernetes.io/enforce", "operator": operator,
                         "values": ["baseline", "restricted"]} for operator in ("NotIn", "In")]
    return webhooks


def injector(objects: list[Manifest]) -> Manifest:
    return container(the(objects, "Deployment")["spec"]["template"]["spec"], "injector")


@functools.cache
def check_webhook() -> ModuleType:
    """deploy/webhook/check_webhook.py, which deploy/validate.sh runs on every rendering."""
    spec = importlib.util.spec_from_file_location("check_webhook", WEBHOOK / "check_webhook.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_kubectl
@pytest.mark.parametrize("which", WEBHOOKS)
def test_the_webhook_never_holds_a_pod_back(which: str) -> None:
    """An injector that is down, errs or is slow costs a pod its sidecar, never its start, and
    not for long: Ignore, and a timeout well under the API server's default of 10 s."""
    for webhook in the_webhooks(render_webhook(which)):
        assert webhook["failurePolicy"] == "Ignore"
        assert webhook["timeoutSeconds"] <= 5
        assert webhook["sideEffects"] == "None" and webhook["admissionReviewVersions"] == ["v1"]
        assert webhook["reinvocationPolicy"] == "IfNeeded"
        assert webhook["matchPolicy"] == "Equivalent"
        assert webhook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""],
                                     "apiVersions": ["v1"], "resources": ["pods"],
                                     "scope": "Namespaced"}]
        assert webhook["name"].count(".") >= 2, "a webhook's name is fully qualified"


@needs_kubectl
@pytest.mark.parametrize("which", WEBHOOKS)
def test_the_webhook_takes_labelled_namespaces_but_its_own(which: str) -> None:
    objects = render_webhook(which)
    own = the(objects, "Namespace")
    for webhook in the_webhooks(objects):
        selector = webhook["namespaceSelector"]
        assert selector["matchLabels"] == {"sidecar-injection": "enabled"}
        assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                "values": [own["metadata"]["name"]]} in selector["matchExpressions"]
    assert "sidecar-injection" not in own["metadata"].get("labels", {})
    assert own["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] not in (
        "Namespace", "MutatingWebhookConfiguration")} == {own["metadata"]["name"]}


@needs_kubectl
def test_two_injectors_on_two_nodes_and_one_always_up() -> None:
    objects = render_webhook("cert-manager")
    deployment, budget = the(objects, "Deployment"), the(objects, "PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


@needs_kubectl
def test_the_injector_is_locked_down_and_needs_no_api_access() -> None:
    objects = render_webhook("cert-manager")
    pod = the(objects, "Deployment")["spec"]["template"]["spec"]
    assert_locked_down(injector(objects))
    assert injector(objects)["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    account = the(objects, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account["automountServiceAccountToken"] is False
    assert not [o for o in objects if o["kind"].endswith(("Role", "RoleBinding"))]


@needs_kubectl
def test_the_injector_is_probed_and_called_on_its_https_port() -> None:
    objects = render_webhook("cert-manager")
    c, service = injector(objects), the(objects, "Service")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert (get["scheme"], get["path"], ports.get(get["port"], get["port"])) == (
            "HTTPS", "/healthz", 8443)
    [port] = service["spec"]["ports"]
    assert {w["clientConfig"]["service"]["port"] for w in the_webhooks(objects)} == {
        port["port"]} == {443}
    assert ports.get(port["targetPort"], port["targetPort"]) == 8443
    assert option_values(c, "--listen") in ([], ["0.0.0.0:8443"])


@needs_kubectl
@pytest.mark.parametrize("which", WEBHOOKS)
def test_the_injector_reads_its_certificate_from_its_secret(which: str) -> None:
    objects = render_webhook(which)
    c = injector(objects)
    pod = the(objects, "Deployment")["spec"]["template"]["spec"]
    assert c["args"][0] == "inject"
    for option, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")):
        [path] = option_values(c, option)
        assert path == f"/etc/sidecar-injector/tls/{key}"
        mount = mount_for(c, path)
        assert mount["readOnly"] is True and "subPath" not in mount, "a subPath is never updated"
        assert volume(pod, mount["name"])["secret"]["secretName"] == "sidecar-injector-tls"
    assert check_webhook().problems(objects) == []


@needs_kubectl
def test_cert_manager_issues_the_serving_certificate_from_a_ca_of_its_own() -> None:
    objects = render_webhook("cert-manager")
    annotations = the(objects, "MutatingWebhookConfiguration")["metadata"]["annotations"]
    namespace, _, name = annotations["cert-manager.io/inject-ca-from"].partition("/")
    certificates = {o["metadata"]["name"]: o["spec"] for o in objects
                    if o["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Issuer"}
    serving = certificates[name]
    assert SERVICE_DNS_NAME in serving["dnsNames"] and namespace == "sidecar-system"
    assert serving["secretName"] == "sidecar-injector-tls"
    ca_issuer = issuers[serving["issuerRef"]["name"]]
    [ca] = [c for c in certificates.values() if c["secretName"] == ca_issuer["ca"]["secretName"]]
    assert ca["isCA"] is True and "selfSigned" in issuers[ca["issuerRef"]["name"]]
    # A renewed CA keeps its key: what it signed before still verifies against the new caBundle.
    assert ca["privateKey"]["rotationPolicy"] == "Never"


@needs_kubectl
def test_without_cert_manager_nothing_of_cert_manager_is_left() -> None:
    objects = render_webhook("without-cert-manager")
    assert not [o for o in objects if o["apiVersion"].startswith("cert-manager.io/")]
    configuration = the(objects, "MutatingWebhookConfiguration")
    assert "cert-manager.io/inject-ca-from" not in configuration["metadata"].get("annotations", {})
    kept = [o for o in render_webhook("cert-manager")
            if not o["apiVersion"].startswith("cert-manager.io/")
            and o["kind"] != "MutatingWebhookConfiguration"]
    assert [o for o in objects if o["kind"] != "MutatingWebhookConfiguration"] == kept


def documented_yaml(page: str, first_line: str) -> str:
    """The ```yaml block of docs/PAGE that starts with `first_line`, as a user copies it."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    [block] = [b for b in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
               if b.startswith(first_line)]
    return block


@needs_kubectl
def test_the_documented_install_elsewhere_carries_namespace_and_image_everywhere(
        tmp_path: Path) -> None:
    """docs/webhook.md's kustomization: `images:` sets the container's image, not the --image
    argument, and `namespace:` leaves the webhook's names alone; names/ carries both there."""
    kustomization = documented_yaml("webhook.md", "# ops/sidecar-injector/kustomization.yaml")
    folder = tmp_path / "ops" / "sidecar-injector"
    folder.mkdir(parents=True)
    (tmp_path / "deploy").symlink_to(DEPLOY)
    (folder / "kustomization.yaml").write_text(kustomization)
    objects = _kustomize(folder)
    c = injector(objects)
    environ = {k: v for k, v in env(c).items() if isinstance(v, str)}
    [image] = option_values(c, "--image")
    assert check_names()._expand(image, environ) == c["image"] == \
        "registry.mycorp.io/ml/sidecar:0.1.0"
    rendered = yaml.safe_dump_all(objects)
    assert "sidecar-system" not in rendered and "registry.example.com" not in rendered
    assert the(objects, "Namespace")["metadata"]["name"] == "ml-platform"
    assert check_webhook().problems(objects) == []


def test_the_documented_pod_template_names_paths_the_sidecar_can_mount() -> None:
    """docs/webhook.md's pod template: every path an annotation names lies on a volume of the
    trainer's container (the sidecar mounts it read-only at the same path), the platform's
    variables are there to copy, the token a reference; wrapped in a Job, it validates."""
    import kubernetes_validate

    template = yaml.safe_load(documented_yaml("webhook.md", "# the pod template"))
    annotations = template["metadata"]["annotations"]
    spec = template["spec"]
    trainer = container(spec, annotations.get("sidecar/container", spec["containers"][0]["name"]))
    named = [path for key in ("jsonl", "tensorboard", "checkpoints", "validation", "hparams")
             for path in annotations[f"sidecar/{key}"].split(",")]
    for path in named:
        assert "emptyDir" in volume(spec, mount_for(trainer, path)["name"]), path
    assert {"STARFORGE_ENABLED", "STARFORGE_ENDPOINT", "STARFORGE_RUN_ID"} <= set(env(trainer))
    assert "secretKeyRef" in env(trainer)["STARFORGE_TOKEN"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
           "spec": {"template": {**template, "spec": {**spec, "restartPolicy": "Never"}}}}
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(job, version, strict=True)


@needs_kubectl
def test_the_webhook_check_catches_what_would_break_a_call() -> None:
    """The check validate.sh runs says so when the webhook would select its own namespace, call
    a port the injector does not listen on, or trust a certificate for another name."""
    objects = render_webhook("cert-manager")
    the_webhooks(objects)[0]["namespaceSelector"].pop("matchExpressions")
    injector(objects)["args"] = [a.replace(":8443", ":9443") for a in injector(objects)["args"]]
    next(o for o in objects if o["kind"] == "Certificate" and o["metadata"]["name"] ==
         "sidecar-injector")["spec"]["dnsNames"] = ["sidecar-injector.default.svc"]
    found = check_webhook().problems(objects)
    assert any("include the injector's own, sidecar-system" in p for p in found), found
    assert any("listens on 0.0.0.0:9443" in p for p in found), found
    assert any(f"lack {SERVICE_DNS_NAME}" in p for p in found), found


def test_the_webhook_check_knows_cert_manager_objects_field_by_field() -> None:
    issuer = {"apiVersion": "cert-manager.io/v1", "kind": "Issuer", "metadata": {"name": "i"},
              "spec": {"ca": {"secretName": "ca"}}}
    certificate = {"apiVersion": "cert-manager.io/v1", "kind": "Certificate",
                   "metadata": {"name": "c"},
                   "spec": {"isCa": True, "issuerRef": {}, "duration": "90d",
                            "privateKey": {"algorithm": "ecdsa"}}}
    other = {"apiVersion": "cert-manager.io/v1alpha2", "kind": "Certificate",
             "metadata": {"name": "old"}}
    found = check_webhook().problems([issuer, certificate, other])
    assert found == [
        "Certificate c: spec has no field 'isCa' in cert-manager.io/v1",
        "Certificate c: spec needs 'secretName'",
        "Certificate c: spec.issuerRef needs 'name'",
        "Certificate c: spec.privateKey.algorithm is 'ecdsa', cert-manager takes ECDSA, Ed25519, "
        "RSA",
        "Certificate c: spec.duration '90d' is not a duration (2160h, 30m)",
        "Certificate old: cert-manager.io/v1alpha2 Certificate is neither a Kubernetes kind nor "
        "one this check knows (cert-manager.io/v1 Issuer, Certificate): nothing would validate it",
    ]


needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")


def make_certs(folder: Path, *options: str, path: str | None = None) -> str:
    """deploy/webhook/make-certs.sh OPTIONS FOLDER; what it printed on stdout."""
    environ = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    if path is not None:
        environ["PATH"] = f"{path}{os.pathsep}{environ['PATH']}"
    return subprocess.run([str(WEBHOOK / "make-certs.sh"), *options, str(folder)], env=environ,
                          stdin=subprocess.DEVNULL, check=True, capture_output=True, text=True,
                          timeout=60).stdout


def handshake(folder: Path, server_name: str) -> None:
    """A TLS handshake with a server on folder's tls.crt and tls.key, by a client that trusts
    folder's ca.crt alone and verifies `server_name`, as the API server does."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    client = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    left, right = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(left, server_side=True):
                pass
        except (ssl.SSLError, OSError) as e:
            errors.append(e)
        finally:
            left.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(right, server_hostname=server_name):
            pass
    finally:
        right.close()
        thread.join(timeout=30)
    assert not errors, errors


@needs_openssl
def test_make_certs_makes_a_certificate_the_api_server_trusts_for_the_service(
        tmp_path: Path) -> None:
    folder = tmp_path / "certs"
    make_certs(folder)
    assert OPENSSL is not None
    verified = subprocess.run([OPENSSL, "verify", "-CAfile", str(folder / "ca.crt"),
                               str(folder / "tls.crt")], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    handshake(folder, SERVICE_DNS_NAME)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(folder, "sidecar-injector.default.svc")
    assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in folder.iterdir())


@needs_openssl
@needs_kubectl
def test_make_certs_applies_the_secret_the_injector_mounts_and_the_ca_bundle(
        tmp_path: Path) -> None:
    """--apply runs the two commands it prints otherwise, with kubectl (here one that records
    what it is given); run again, it keeps the CA: caBundle stays valid for the new certificate."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {tmp_path}/kubectl.log\n')
    (bin_dir / "kubectl").chmod(0o755)
    folder = tmp_path / "certs"
    make_certs(folder, "--apply", path=str(bin_dir))
    first_ca, first_cert = (folder / "ca.crt").read_bytes(), (folder / "tls.crt").read_bytes()
    # The Secret's two commands are a pipeline: they start in either order.
    create, apply, patch = sorted((tmp_path / "kubectl.log").read_text().splitlines(),
                                  key=lambda line: ("create" not in line, "patch" in line))
    mounted = volume(the(render_webhook("without-cert-manager"), "Deployment")["spec"]["template"]
                     ["spec"], "tls")["secret"]["secretName"]
    assert create.startswith(f"--namespace sidecar-system create secret tls {mounted} ")
    assert "--dry-run=client --output=yaml" in create and apply == "apply --filename=-"
    name = the(render_webhook("without-cert-manager"),
               "MutatingWebhookConfiguration")["metadata"]["name"]
    prefix = f"patch mutatingwebhookconfiguration {name} --type=json --patch="
    assert patch.startswith(prefix)
    operations = json.loads(patch.removeprefix(prefix))
    assert [o["path"] for o in operations] == [f"/webhooks/{i}/clientConfig/caBundle"
                                               for i in range(2)]
    assert all(base64.b64decode(o["value"]) == first_ca for o in operations)

    printed = make_certs(folder)
    assert (folder / "ca.crt").read_bytes() == first_ca
    assert (folder / "tls.crt").read_bytes() != first_cert
    handshake(folder, SERVICE_DNS_NAME)
    assert base64.b64encode(first_ca).decode() in printed


def test_dockerfile_runs_sidecar_unprivileged_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^ARG PYTHON_IMAGE=python:\S+-slim", text, re.M)
    assert re.search(r"^USER [1-9][0-9]*:[1-9][0-9]*$", final, re.M), "numeric, non-root"
    assert 'ENTRYPOINT ["sidecar"]' in final
    script = (ROOT / healthcheck_script()).read_text()
    assert "urllib" in script and "/healthz" in script and "curl" not in script
    assert "org.opencontainers.image.version" in final


def healthcheck_script() -> str:
    """The repository path of the script the image's HEALTHCHECK runs (what its COPY copies)."""
    final = (ROOT / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    command = next(line for line in final.splitlines() if line.strip().startswith("CMD ["))
    argv = json.loads(command.strip().removeprefix("CMD "))
    assert argv[0] == "python", "the image's venv Python, first on PATH"
    copied = dict(re.findall(r"^COPY (\S+) (\S+)$", final, re.M))
    sources = [source for source, target in copied.items() if target == argv[1]]
    assert sources, f"the image has no {argv[1]}"
    return sources[0]


async def healthcheck(environ: dict[str, str]) -> tuple[int, str]:
    """The image's HEALTHCHECK command, run here as Docker would run it in the container."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / healthcheck_script()), env=environ,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode()


def refused_addr() -> str:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{closed.getsockname()[1]}"


async def test_healthcheck_with_the_status_endpoint_off_is_healthy(tmp_path: Path) -> None:
    status, out = await healthcheck({"SIDECAR_STATUS_ADDR": "off",
                                     "SIDECAR_STATE_DIR": str(tmp_path)})
    assert (status, out) == (0, "sidecar status endpoint is off: nothing to probe\n")


async def test_healthcheck_probes_the_address_the_daemon_bound(tmp_path: Path) -> None:
    """The address written to the state dir (the default port was busy: an ephemeral one), not
    only the configured one; with nothing answering, unhealthy, naming what it tried."""
    from sidecar.observe.endpoint import start_status_server

    configured = refused_addr()
    environ = {"SIDECAR_STATUS_ADDR": configured, "SIDECAR_STATE_DIR": str(tmp_path)}
    assert (await healthcheck(environ))[0] == 1
    (tmp_path / RUN).mkdir()

    def snapshot() -> Any:
        raise AssertionError("/healthz needs no snapshot")

    server = await start_status_server("127.0.0.1:0", tmp_path / RUN, snapshot)
    assert server is not None
    try:
        status, out = await healthcheck(environ)
    finally:
        await server.close()
    assert (status, out) == (0, f"sidecar answers at {server.address}\n")
    status, out = await healthcheck(environ)
    assert status == 1 and f"does not answer: {configured}" in out


@pytest.mark.parametrize(("argv", "found"), [
    (["sidecar", "watch", "--status-addr", "off"], "off"),
    (["sidecar", "watch", "--status-addr=0.0.0.0:9621", "--log", "x"], "0.0.0.0:9621"),
    (["sidecar", "watch"], None),
])
def test_healthcheck_reads_the_daemons_own_status_addr(argv: list[str], found: str | None,
                                                       tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / healthcheck_script())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes("\0".join(argv).encode() + b"\0")
    assert module.status_addr_flag(argv) == found
    assert module.configured_addr({"SIDECAR_STATUS_ADDR": "1.2.3.4:5"}, cmdline) == (
        found or "1.2.3.4:5")


def unit_settings() -> dict[str, str]:
    unit = (DEPLOY / "systemd" / "sidecar.service").read_text()
    return dict(line.split("=", 1) for line in unit.splitlines()
                if "=" in line and not line.startswith("#"))


def test_systemd_unit_keeps_its_state_in_the_state_directory() -> None:
    unit = unit_settings()
    assert unit["ExecStart"].split()[1] == "watch"
    assert f"--state-dir=/var/lib/{unit['StateDirectory']}" in unit["ExecStart"].split()
    assert unit["EnvironmentFile"].startswith("/etc/sidecar/")
    assert unit["Restart"] == "on-failure" and unit["RestartPreventExitStatus"] == "2"
    assert float(unit["TimeoutStopSec"]) >= DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S
    hardening = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}
    assert hardening.items() <= unit.items()
    assert "PrivateDevices" not in unit, "it would hide /dev/nvidia* from NVML"


@pytest.fixture
def entry() -> Iterator[ModuleType]:
    """deploy/bundle/entry.py, the bundle's entry point, imported as a module."""
    spec = importlib.util.spec_from_file_location("bundle_entry",
                                                  DEPLOY / "bundle" / "entry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module


@pytest.mark.parametrize(("before", "after"), [
    ({"LD_LIBRARY_PATH": "/b/_internal", "_PYI_ARCHIVE_FILE": "/b/sidecar"}, {}),
    ({"LD_LIBRARY_PATH": "/b/_internal:/opt/x", "LD_LIBRARY_PATH_ORIG": "/opt/x"},
     {"LD_LIBRARY_PATH": "/opt/x"}),
    ({"LD_LIBRARY_PATH": "/b/_internal:/usr/local/cuda/lib64", "PATH": "/usr/bin"},
     {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "PATH": "/usr/bin"}),
])
def test_bundle_gives_the_wrapped_command_the_environment_it_was_given(
        entry: ModuleType, before: dict[str, str], after: dict[str, str]) -> None:
    environ = dict(before)
    entry.restore_loader_environment(environ, "/b/_internal")
    assert environ == after


def test_bundle_leaves_a_named_ca_file_alone(entry: ModuleType) -> None:
    environ = {"SSL_CERT_FILE": "/etc/private-ca.pem"}
    entry.name_system_ca_file(environ)
    assert environ == {"SSL_CERT_FILE": "/etc/private-ca.pem"}
