#!/usr/bin/env python3
"""Check that the names in rendered manifests agree with each other (deploy/validate.sh).

    kubectl kustomize OVERLAY | python3 deploy/kubernetes/check_names.py NAME

A Job whose pods have a `subdomain` needs a headless Service of that name, selecting this Job's
pods alone (by the Job controller's `batch.kubernetes.io/job-name` label), and the trainer's
`--master-addr` (its `$(VAR)`s expanded from the container's env, as the kubelet does) is rank
0's name, `<job>-0.<subdomain>`. A rename (a per-run nameSuffix) that leaves any of them behind
makes the rendezvous unresolvable or joins pods of several runs: each such mismatch is one line
on stderr and exit status 1.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import yaml

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on its pods
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def problems(objects: list[dict[str, Any]]) -> list[str]:
    """What disagrees among the names of `objects` (an overlay as rendered); empty when none."""
    services = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "Service"}
    found = []
    for job in (o for o in objects if o.get("kind") == "Job"):
        name = job["metadata"]["name"]
        spec = job["spec"]["template"]["spec"]
        subdomain = spec.get("subdomain")
        if subdomain is None:
            continue
        service = services.get(subdomain)
        if service is None:
            found.append(f"Job {name}: subdomain {subdomain!r} names no Service "
                         f"(Services: {', '.join(sorted(services)) or 'none'})")
        else:
            found += _service_problems(service, name)
        for container in spec.get("containers", []):
            for address in _option_values(container, "--master-addr"):
                expected = f"{name}-0.{subdomain}"
                if address != expected:
                    found.append(f"Job {name}, container {container['name']}: --master-addr is "
                                 f"{address!r}, rank 0 is {expected!r}")
    return found


def _service_problems(service: dict[str, Any], job: str) -> list[str]:
    name = service["metadata"]["name"]
    found = []
    if service["spec"].get("clusterIP") != "None":
        found.append(f"Service {name}: not headless, pods get no DNS names under it")
    selector = service["spec"].get("selector") or {}
    if selector.get(JOB_NAME_LABEL) != job:
        found.append(f"Service {name}: selector {selector} does not select Job {job}'s pods "
                     f"alone ({JOB_NAME_LABEL}: {job})")
    return found


def _option_values(container: dict[str, Any], option: str) -> list[str]:
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    argv = container.get("command", []) + container.get("args", [])
    return [_expand(a.split("=", 1)[1], env) for a in argv if a.startswith(option + "=")]


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it: once, from literal values that may use earlier ones."""
    resolved: dict[str, str] = {}
    for name, value in env.items():
        resolved[name] = _VARIABLE.sub(lambda m: resolved.get(m[1], m[0]), value)
    return _VARIABLE.sub(lambda m: resolved.get(m[1], m[0]), text)


def main(argv: list[str]) -> int:
    label = argv[1] if len(argv) > 1 else "stdin"
    objects = [doc for doc in yaml.safe_load_all(sys.stdin) if doc]
    found = problems(objects)
    for problem in found:
        print(f"FAIL names ({label}): {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
