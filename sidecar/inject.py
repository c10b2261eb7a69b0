"""`sidecar inject`'s answer to an admission review (docs/webhook.md): the pod a training
operator or a person creates, and the JSON Patch that adds the sidecar to it.

A matching pod gets a native sidecar (an init container that keeps running, `restartPolicy:
Always`) running `sidecar watch`: the platform's variables copied from the trainer's container
(a `valueFrom` stays one: the token stays a reference to its Secret), each path the pod's
annotations name mounted read-only from the volume that holds it in the trainer's container,
the console read from the node's CRI log files, and, when the pod asks for stacks, the
process namespace shared and CAP_SYS_PTRACE for the sidecar alone.

The webhook is never in the way: every answer allows the pod, and whatever it cannot read or
does not match is allowed unchanged, with a warning where the pod asked for something it
cannot have. The answer is a function of the pod alone, so a second review of the patched pod
(a reinvocation) answers no patch, unless another webhook stripped the sidecar's
`restartPolicy` since: that is put back.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import posixpath
from typing import Any, NamedTuple

from sidecar.config import FAMILIES
from sidecar.node import NODE_COUNT_VARIABLES, RANK_VARIABLES
from sidecar.sources.files.kinds import FILE_KINDS

CONTAINER = "sidecar"  # the injected container's name: a pod that has it was injected
PREFIX = "sidecar/"  # of the annotations a pod asks with
INJECT = PREFIX + "inject"  # "true": inject; "false": never, whatever the labels say
TRAINER = PREFIX + "container"  # the trainer's container, when it is not the first
STACKS = PREFIX + "stacks"  # "true": the trainer's stacks at a stall (docs/stalls.md)
CONSOLE = PREFIX + "console"  # "cri" (the default) or "off"
DRAIN = PREFIX + "drain-timeout"  # seconds: the sidecar's --drain-timeout, and the pod's grace
GRACE_OVER_DRAIN_S = 10  # the pod's grace period past the drain: the sidecar's exit after it
DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds when a pod gives none
# annotation -> the `watch` option its paths (comma-separated) are given to: each kind of file
# the sidecar follows, the checkpoints' folders and the hyperparameters' file
PATH_OPTIONS = {PREFIX + name: "--" + name for name in (
    *(kind.name for kind in FILE_KINDS), "checkpoints", "hparams")}
STATE_DIR = "/var/lib/sidecar"
POD_LOGS = "/var/log/pods"  # the kubelet's CRI log files, one folder a pod
MAX_REVIEW_BYTES = 3 << 20  # twice etcd's largest object: past it, allowed unread


class Selector(NamedTuple):
    """A label that marks a training operator's pods: a pod that carries it is injected (with
    `value`, only when it has that value)."""

    label: str
    operator: str
    value: str | None = None

    def picks(self, labels: dict[str, Any]) -> bool:
        return self.label in labels and self.value in (None, labels[self.label])

    @classmethod
    def named(cls, text: str) -> Selector:
        """One of `sidecar inject --select`: KEY or KEY=VALUE, a label or an annotation."""
        key, equals, value = text.partition("=")
        return cls(key.strip(), "--select", value.strip() if equals else None)


SELECTORS = (
    Selector("jobset.sigs.k8s.io/jobset-name", "JobSet (and Kubeflow Trainer's TrainJob on it)"),
    Selector("training.kubeflow.org/job-name", "Kubeflow's training operator (PyTorchJob ...)"),
    Selector("ray.io/cluster", "KubeRay (RayJob, RayCluster)"),
    Selector("volcano.sh/job-name", "Volcano's Job"),
)

# the trainer's variables the sidecar reads: the platform's families, its own options, and
# those that say which node of the run this is
_COPIED_PREFIXES = ("SIDECAR_", *(family.enabled.removesuffix("ENABLED") for family in FAMILIES))
_COPIED_NAMES = frozenset({*RANK_VARIABLES, *NODE_COUNT_VARIABLES, "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE"})
# the pod's own facts, for the node's name, the CRI log folder and the status endpoint
_FIELDS = {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name",
           "POD_NAMESPACE": "metadata.namespace", "POD_UID": "metadata.uid"}


class Admission(NamedTuple):
    """The review's answer: the patch (empty: the pod unchanged) and the warnings the API
    server shows whoever created the pod."""

    uid: str
    patch: list[dict[str, Any]]
    warnings: list[str]

    def review(self) -> dict[str, Any]:
        """The AdmissionReview sent back: always allowed, carrying the request's uid."""
        response: dict[str, Any] = {"uid": self.uid, "allowed": True}
        if self.patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(self.patch).encode()).decode()
        if self.warnings:
            response["warnings"] = self.warnings
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": response}


def answer(body: bytes, image: str, restricted: bool = False,
           selectors: tuple[Selector, ...] = ()) -> Admission:
    """The answer to one review's `body`; never raises: a review it cannot read is allowed
    unchanged, with a warning. `restricted`: the pod's namespace enforces Pod Security's
    baseline or restricted level, which would refuse the pod a hostPath volume or an added
    capability: the sidecar then has neither (a pod refused is what the webhook must never
    cause). `selectors`: labels or annotations the operator named that ask for the sidecar
    too, beside the training operators' labels."""
    if len(body) > MAX_REVIEW_BYTES:
        return Admission("", [], [f"sidecar: a review of {len(body)} bytes was not read; the "
                               "pod is admitted without the sidecar"])
    try:
        review = json.loads(body)
    except (ValueError, RecursionError):
        return Admission("", [], ["sidecar: the review is not JSON; admitted unchanged"])
    request = review.get("request") if isinstance(review, dict) else None
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        return Admission("", [], ["sidecar: the review has no request uid; admitted unchanged"])
    uid = request["uid"]
    try:
        patch, warnings = mutate(request, image, restricted, selectors)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        # a pod shaped as no API server sends it: never refused for it
        return Admission(uid, [], [f"sidecar: the pod could not be read ({exc.__class__.__name__}"
                                "); admitted without the sidecar"])
    return Admission(uid, patch, warnings)


def mutate(request: dict[str, Any], image: str, restricted: bool = False,
           selectors: tuple[Selector, ...] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    """The patch for the pod of an admission `request`, and its warnings."""
    kind = request.get("kind") or {}
    pod = request.get("object")
    if (kind.get("kind") != "Pod" or request.get("operation") != "CREATE"
            or not isinstance(pod, dict) or request.get("dryRun")):
        return [], []
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    labels = metadata.get("labels") or {}
    asked = annotations.get(INJECT)
    picked = (any(s.picks(labels) for s in SELECTORS)
              or any(s.picks(labels) or s.picks(annotations) for s in selectors))
    if asked == "false" or (asked != "true" and not picked):
        return [], []
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        return [], ["sidecar: the pod has no containers; admitted without the sidecar"]
    if any(c.get("name") == CONTAINER for c in spec.get("initContainers") or []):
        return _restored(spec), []
    if any(c.get("name") == CONTAINER for c in containers):  # the pod's own, not ours
        return [], [f"sidecar: the pod has a container named {CONTAINER!r} already; admitted "
                    "without the sidecar (rename that container)"]
    trainer_name = annotations.get(TRAINER) or containers[0].get("name")
    trainer = next((c for c in containers if c.get("name") == trainer_name), None)
    if trainer is None:
        return [], [f"sidecar: {TRAINER}={trainer_name!r} names no container of the pod; "
                    "admitted without the sidecar"]
    warnings: list[str] = []
    console = _console(annotations, warnings)
    stacks = annotations.get(STACKS) == "true"
    if restricted and (console or stacks):
        warnings.append(
            "sidecar: the namespace enforces Pod Security baseline or restricted, which refuses "
            + " and ".join(what for what, asked in (
                ("the node's log folder (a hostPath volume): the console is not read", console),
                ("CAP_SYS_PTRACE: no stacks at a stall", stacks)) if asked)
            + "; run the trainer under `sidecar run` for both (docs/webhook.md#pod-security)")
        console = stacks = False
    drain = _drain_s(annotations, warnings)
    sidecar = _container(image, trainer, annotations, console, stacks, drain, warnings)
    return _patch(spec, sidecar, stacks=stacks, console=console, drain=drain), warnings


def _drain_s(annotations: dict[str, Any], warnings: list[str]) -> int | None:
    """The drain the pod asks for, in whole seconds; None: the sidecar's default."""
    asked = annotations.get(DRAIN)
    if asked is None:
        return None
    try:
        seconds = float(asked)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds < 86400:
        warnings.append(f"sidecar: {DRAIN}={asked!r} is not a number of seconds between 0 and "
                        "a day; the sidecar's default drain is used")
        return None
    return math.ceil(seconds)


def _restored(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod injected already: unchanged, but for the sidecar's `restartPolicy`, put back
    where a webhook after ours stripped it (without it the sidecar would hold the pod's other
    containers back until it exits, and a Job would never complete)."""
    for index, container in enumerate(spec.get("initContainers") or []):
        if container.get("name") == CONTAINER and container.get("restartPolicy") != "Always":
            return [{"op": "add", "path": f"/spec/initContainers/{index}/restartPolicy",
                     "value": "Always"}]
    return []


def _console(annotations: dict[str, Any], warnings: list[str]) -> bool:
    """Whether the console is read from the node's CRI log files."""
    console = str(annotations.get(CONSOLE, "cri"))
    if console not in ("cri", "off"):
        warnings.append(f"sidecar: {CONSOLE}={console!r} is neither cri nor off; cri is used")
    return console != "off"


def _container(image: str, trainer: dict[str, Any], annotations: dict[str, Any],
               console: bool, stacks: bool, drain: int | None,
               warnings: list[str]) -> dict[str, Any]:
    """The native sidecar for the pod whose trainer's container is `trainer`."""
    trainer_name = trainer["name"]
    args = ["watch"]
    mounts: dict[str, dict[str, Any]] = {}
    for annotation, option in PATH_OPTIONS.items():
        for path in (p.strip() for p in str(annotations.get(annotation, "")).split(",")):
            if not path:
                continue
            mount = _holding(trainer, path)
            if mount is None:
                warnings.append(f"sidecar: {annotation} {path} lies on no volume that container "
                                f"{trainer_name} mounts, so the sidecar cannot read it; put it "
                                "on a shared volume (an emptyDir mounted in the container)")
                continue
            mounts.setdefault(mount["mountPath"], mount)
            args.append(f"{option}={path}")
    if console:
        args += [f"--log={POD_LOGS}/$(POD_NAMESPACE)_$(POD_NAME)_$(POD_UID)/{trainer_name}/*.log",
                 "--log-format=cri"]
    env = _env(trainer)
    if drain is not None:
        env = [var for var in env if var["name"] != "SIDECAR_DRAIN_TIMEOUT"]
        env.append({"name": "SIDECAR_DRAIN_TIMEOUT", "value": str(drain)})
    container: dict[str, Any] = {
        "name": CONTAINER, "image": image, "restartPolicy": "Always", "args": args,
        "env": env, "volumeMounts": [
            *mounts.values(), {"name": "sidecar-state", "mountPath": STATE_DIR}],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                      "limits": {"cpu": "500m", "memory": "256Mi"}},
        "securityContext": _security(stacks),
    }
    if trainer.get("envFrom"):
        container["envFrom"] = copy.deepcopy(trainer["envFrom"])
    if console:
        container["volumeMounts"].append({"name": "sidecar-pod-logs", "mountPath": POD_LOGS,
                                          "readOnly": True})
    return container


def _holding(trainer: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The trainer's mount that holds `path` (the deepest), as the sidecar mounts it: the
    same volume at the same path, read-only."""
    path = posixpath.normpath(path)
    best: dict[str, Any] | None = None
    for mount in trainer.get("volumeMounts") or []:
        where = posixpath.normpath(str(mount.get("mountPath", "")))
        if (path == where or path.startswith(where.rstrip("/") + "/")) and (
                best is None or len(where) > len(best["mountPath"])):
            best = {key: mount[key] for key in ("name", "subPath", "subPathExpr")
                    if key in mount}
            best["mountPath"] = where
    if best is not None:
        best["readOnly"] = True
    return best


def _env(trainer: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainer's variables the sidecar reads, as the trainer has them, and the pod's facts;
    NVML sees every GPU of the node (the GPUs the pod's processes run on are the ones sampled),
    with the driver's utility libraries alone."""
    env = [copy.deepcopy(var) for var in trainer.get("env") or []
           if isinstance(var, dict) and isinstance(var.get("name"), str)
           and (var["name"].startswith(_COPIED_PREFIXES) or var["name"] in _COPIED_NAMES)]
    names = {var["name"] for var in env}
    env += [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
            for name, field in _FIELDS.items() if name not in names]
    env += [{"name": name, "value": value} for name, value in (
        ("SIDECAR_STATE_DIR", STATE_DIR), ("NVIDIA_VISIBLE_DEVICES", "all"),
        ("NVIDIA_DRIVER_CAPABILITIES", "utility")) if name not in names]
    return env


def _security(stacks: bool) -> dict[str, Any]:
    """Non-root, read-only, nothing escalated; with stacks, root with CAP_SYS_PTRACE alone:
    Kubernetes sets no ambient capabilities, so one added to a non-root container is never
    effective (docs/stalls.md#where-it-cannot-look)."""
    context: dict[str, Any] = {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
        "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    if stacks:
        context.update(runAsNonRoot=False, runAsUser=0, runAsGroup=0,
                       capabilities={"drop": ["ALL"], "add": ["SYS_PTRACE"]})
    return context


def _patch(spec: dict[str, Any], sidecar: dict[str, Any], *, stacks: bool, console: bool,
           drain: int | None) -> list[dict[str, Any]]:
    """The JSON Patch that adds `sidecar` first among the init containers (it sees the others'
    output too), its volumes, the shared process namespace for stacks, and a grace period the
    drain fits in: the kubelet kills the sidecar when the pod's runs out."""
    patch: list[dict[str, Any]] = []
    if spec.get("initContainers"):
        patch.append({"op": "add", "path": "/spec/initContainers/0", "value": sidecar})
    else:
        patch.append({"op": "add", "path": "/spec/initContainers", "value": [sidecar]})
    volumes = [{"name": "sidecar-state", "emptyDir": {"sizeLimit": "1Gi"}}]
    if console:
        volumes.append({"name": "sidecar-pod-logs",
                        "hostPath": {"path": POD_LOGS, "type": "Directory"}})
    if spec.get("volumes"):
        patch += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in volumes]
    else:
        patch.append({"op": "add", "path": "/spec/volumes", "value": volumes})
    if stacks:
        patch.append({"op": "add", "path": "/spec/shareProcessNamespace", "value": True})
    grace = spec.get("terminationGracePeriodSeconds")
    if drain is not None and (grace if isinstance(grace, int) else DEFAULT_GRACE_S) < (
            drain + GRACE_OVER_DRAIN_S):
        patch.append({"op": "add", "path": "/spec/terminationGracePeriodSeconds",
                      "value": drain + GRACE_OVER_DRAIN_S})
    return patch
