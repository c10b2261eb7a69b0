#!/usr/bin/env python3
"""Check a rendered webhook kustomization: cert-manager's objects, and that its names agree
(deploy/validate.sh).

    kubectl kustomize deploy/webhook |
        python3 deploy/webhook/check_webhook.py NAME [--built-in FILE]

kubernetes-validate knows the schemas of Kubernetes' own kinds, not those of cert-manager's
custom resources. --built-in FILE writes the objects of Kubernetes' own API groups to FILE, which
validate.sh validates strictly; the cert-manager objects are checked here instead, by hand and
less thoroughly than a schema would: cert-manager.io/v1 Issuers and Certificates alone, every
field named known, the required ones set, the enumerations' values and durations well-formed.

Then what must agree for the API server to reach the injector and trust it: the webhook calls a
Service of the rendering, whose port leads to the injector's port, which is the one it listens
on; the webhook excludes the injector's own namespace; with cert-manager, the CA injector's
reference names the serving Certificate, which is for the Service's name, signed by a CA Issuer
of a CA Certificate, into the Secret the injector reads its --tls-cert and --tls-key from; the
image the injector passes on (--image) is its own. Each mismatch is one line on stderr, and exit
status 1.
"""

from __future__ import annotations

import re
import sys
from pathlib import PurePosixPath
from typing import Any

import yaml

Manifest = dict[str, Any]

CERT_MANAGER = "cert-manager.io"
INJECT_CA_FROM = "cert-manager.io/inject-ca-from"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_GO_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}

# The fields of cert-manager.io/v1 (cert-manager 1.16) under each path of the objects checked:
# (the fields known, the fields required). A path not listed here is not looked into.
_FIELDS: dict[tuple[str, ...], tuple[set[str], set[str]]] = {
    ("Issuer",): ({"apiVersion", "kind", "metadata", "spec"}, {"spec"}),
    ("Issuer", "spec"): ({"acme", "ca", "selfSigned", "vault", "venafi"}, set()),
    ("Issuer", "spec", "ca"): (
        {"secretName", "crlDistributionPoints", "issuingCertificateURLs", "ocspServers"},
        {"secretName"}),
    ("Issuer", "spec", "selfSigned"): ({"crlDistributionPoints"}, set()),
    ("Certificate",): ({"apiVersion", "kind", "metadata", "spec"}, {"spec"}),
    ("Certificate", "spec"): (
        {"additionalOutputFormats", "commonName", "dnsNames", "duration", "emailAddresses",
         "encodeUsagesInRequest", "ipAddresses", "isCA", "issuerRef", "keystores",
         "literalSubject", "nameConstraints", "otherNames", "privateKey", "renewBefore",
         "renewBeforePercentage", "revisionHistoryLimit", "secretName", "secretTemplate",
         "signatureAlgorithm", "subject", "uris", "usages"},
        {"issuerRef", "secretName"}),
    ("Certificate", "spec", "issuerRef"): ({"name", "kind", "group"}, {"name"}),
    ("Certificate", "spec", "privateKey"): (
        {"algorithm", "encoding", "rotationPolicy", "size"}, set()),
}
_ISSUER_TYPES = _FIELDS[("Issuer", "spec")][0]
_ENUMS: dict[tuple[str, ...], set[str]] = {
    ("Certificate", "spec", "privateKey", "algorithm"): {"RSA", "ECDSA", "Ed25519"},
    ("Certificate", "spec", "privateKey", "encoding"): {"PKCS1", "PKCS8"},
    ("Certificate", "spec", "privateKey", "rotationPolicy"): {"Never", "Always"},
    ("Certificate", "spec", "issuerRef", "kind"): {"Issuer", "ClusterIssuer"},
}
_USAGES = {"signing", "digital signature", "content commitment", "key encipherment",
           "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
           "decipher only", "any", "server auth", "client auth", "code signing",
           "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
           "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}
# cert-manager refuses a Certificate whose duration is under an hour.
_MIN_DURATION_S = 3600


def is_built_in(o: Manifest) -> bool:
    """Whether `o` is of one of Kubernetes' own API groups (a group without a dot, or one of
    *.k8s.io), which kubernetes-validate has the schemas of."""
    group = o.get("apiVersion", "").rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def problems(objects: list[Manifest]) -> list[str]:
    """What is wrong with the cert-manager objects of `objects` (a webhook kustomization as
    rendered) and what disagrees among its names; empty when nothing."""
    found = []
    for o in objects:
        if not is_built_in(o):
            found += _cert_manager_problems(o)
    for webhooks in _all(objects, "MutatingWebhookConfiguration"):
        found += _webhook_problems(webhooks, objects)
    return found


def _all(objects: list[Manifest], kind: str) -> list[Manifest]:
    return [o for o in objects if o.get("kind") == kind]


def _named(objects: list[Manifest], kind: str, name: str, namespace: str | None) -> Manifest | None:
    """The object of `kind` called `name` in `namespace` (none for a ClusterIssuer, which is of
    the cluster), or None."""
    namespace = None if kind == "ClusterIssuer" else namespace
    return next((o for o in _all(objects, kind) if o["metadata"]["name"] == name
                 and o["metadata"].get("namespace") == namespace), None)


def _label(o: Manifest) -> str:
    return f"{o.get('kind')} {o.get('metadata', {}).get('name')}"


def _cert_manager_problems(o: Manifest) -> list[str]:
    if o.get("apiVersion") != f"{CERT_MANAGER}/v1" or (o.get("kind"),) not in _FIELDS:
        return [f"{_label(o)}: {o.get('apiVersion')} {o.get('kind')} is neither a Kubernetes "
                f"kind nor one this check knows (cert-manager.io/v1 Issuer, Certificate): "
                f"nothing would validate it"]
    found = _field_problems(o, (o["kind"],), _label(o))
    spec = o.get("spec") or {}
    if o["kind"] == "Issuer" and len(_ISSUER_TYPES & set(spec)) != 1:
        found.append(f"{_label(o)}: spec names {len(_ISSUER_TYPES & set(spec))} issuer types, "
                     f"cert-manager takes one of {', '.join(sorted(_ISSUER_TYPES))}")
    if o["kind"] == "Certificate":
        found += _certificate_problems(o, spec)
    return found


def _field_problems(value: Any, path: tuple[str, ...], label: str) -> list[str]:
    """The unknown, missing and misspelt fields under `path` of a cert-manager object."""
    found = []
    if path in _ENUMS and (not isinstance(value, str) or value not in _ENUMS[path]):
        found.append(f"{label}: {'.'.join(path[1:])} is {value!r}, cert-manager takes "
                     f"{', '.join(sorted(_ENUMS[path]))}")
    if path not in _FIELDS:
        return found
    if not isinstance(value, dict):
        return [f"{label}: {'.'.join(path[1:])} is not a mapping"]
    known, required = _FIELDS[path]
    where = ".".join(path[1:]) or "the object"
    found += [f"{label}: {where} has no field {k!r} in cert-manager.io/v1"
              for k in sorted(set(value) - known)]
    found += [f"{label}: {where} needs {k!r}" for k in sorted(required - set(value))]
    for key, inner in value.items():
        if key in known:
            found += _field_problems(inner, (*path, key), label)
    return found


def _seconds(duration: str) -> float:
    return sum(float(n) * _SECONDS[unit] for n, unit in _DURATION_PART.findall(duration))


def _certificate_problems(o: Manifest, spec: Manifest) -> list[str]:
    found = []
    for key in ("duration", "renewBefore"):
        if key in spec and not _GO_DURATION.fullmatch(str(spec[key])):
            found.append(f"{_label(o)}: spec.{key} {spec[key]!r} is not a duration (2160h, 30m)")
    if _GO_DURATION.fullmatch(str(spec.get("duration", ""))):
        duration_s = _seconds(spec["duration"])
        if duration_s < _MIN_DURATION_S:
            found.append(f"{_label(o)}: spec.duration {spec['duration']} is under an hour")
        renew = str(spec.get("renewBefore", ""))
        if _GO_DURATION.fullmatch(renew) and _seconds(renew) >= duration_s:
            found.append(f"{_label(o)}: spec.renewBefore {renew} is not shorter than "
                         f"spec.duration {spec['duration']}: it would be renewed forever")
    found += [f"{_label(o)}: spec.usages has {u!r}, not a usage cert-manager knows"
              for u in spec.get("usages", []) if u not in _USAGES]
    return found


def _webhook_problems(configuration: Manifest, objects: list[Manifest]) -> list[str]:
    label = _label(configuration)
    found = []
    for webhook in configuration.get("webhooks", []):
        where = f"{label}, webhook {webhook.get('name')}"
        reference = webhook.get("clientConfig", {}).get("service")
        if reference is None:
            found.append(f"{where}: calls no Service of the rendering")
            continue
        service = _named(objects, "Service", reference["name"], reference.get("namespace"))
        if service is None:
            found.append(f"{where}: calls Service {reference.get('namespace')}/"
                         f"{reference['name']}, which the rendering does not have")
            continue
        namespace = service["metadata"].get("namespace")
        excluded = [value for e in webhook.get("namespaceSelector", {}).get("matchExpressions", [])
                    if e.get("key") == NAMESPACE_NAME_LABEL and e.get("operator") == "NotIn"
                    for value in e.get("values", [])]
        if namespace not in excluded:
            found.append(f"{where}: its namespaces include the injector's own, {namespace} "
                         f"(excluded: {excluded or 'none'}): its pods would wait for themselves")
        injectors = _selected(objects, service)
        if not injectors:
            found.append(f"{where}: Service {reference['name']} selects no Deployment's pods")
        for deployment in injectors:
            found += _injector_problems(deployment, service, reference.get("port", 443), where)
        found += _trust_problems(configuration, service, injectors, objects)
    return found


def _selected(objects: list[Manifest], service: Manifest) -> list[Manifest]:
    selector = (service.get("spec") or {}).get("selector") or {}
    return [d for d in _all(objects, "Deployment")
            if d["metadata"].get("namespace") == service["metadata"].get("namespace") and selector
            and selector.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()]


def _containers(deployment: Manifest) -> list[Manifest]:
    return list(deployment["spec"]["template"]["spec"].get("containers", []))


def _injector(deployment: Manifest) -> Manifest | None:
    """The Deployment's container that runs `inject`."""
    return next((c for c in _containers(deployment) if (c.get("args") or [None])[0] == "inject"),
                None)


def _option(container: Manifest, option: str) -> str | None:
    """`--option=VALUE`'s value, its $(VAR)s expanded from the container's env as the kubelet
    does, or None."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    argv = container.get("command", []) + container.get("args", [])
    values = [a.split("=", 1)[1] for a in argv if a.startswith(option + "=")]
    return _VARIABLE.sub(lambda m: env.get(m[1], m[0]), values[-1]) if values else None


def _injector_problems(deployment: Manifest, service: Manifest, port: int,
                       where: str) -> list[str]:
    name = f"Deployment {deployment['metadata']['name']}"
    container = _injector(deployment)
    if container is None:
        return [f"{name}: no container runs `inject`"]
    found = []
    ports = [p for p in service["spec"].get("ports", []) if p.get("port") == port]
    if not ports:
        return [f"{where}: calls port {port}, which Service {service['metadata']['name']} "
                f"does not have"]
    target = ports[0].get("targetPort", port)
    by_name = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    container_port = by_name.get(target) if isinstance(target, str) else target
    if container_port not in by_name.values():
        found.append(f"{name}: Service port {port} leads to {target!r}, which container "
                     f"{container['name']} does not declare")
    listen = _option(container, "--listen") or "0.0.0.0:8443"  # the injector's default
    if listen.rpartition(":")[2] != str(container_port):
        found.append(f"{name}: the injector listens on {listen}, the Service sends to port "
                     f"{container_port}")
    injected = _option(container, "--image") or "sidecar"  # the injector's default
    if injected != container.get("image"):
        found.append(f"{name}: --image is {injected!r}, its own image {container.get('image')!r}"
                     f" (a kustomization that sets `images:` lists deploy/webhook/names under "
                     f"its `transformers:`)")
    return found


def _trust_problems(configuration: Manifest, service: Manifest, injectors: list[Manifest],
                    objects: list[Manifest]) -> list[str]:
    """With cert-manager: the CA injector's reference, the serving Certificate's names, issuer
    and Secret agree with the Service and the injector. Without: no cert-manager object at all."""
    label = _label(configuration)
    namespace = service["metadata"].get("namespace")
    reference = configuration["metadata"].get("annotations", {}).get(INJECT_CA_FROM)
    certificates = _all(objects, "Certificate") + _all(objects, "Issuer")
    if reference is None:
        if certificates:
            return [f"{label}: no {INJECT_CA_FROM} annotation, yet {_label(certificates[0])} "
                    f"is rendered: nothing would set caBundle from it"]
        return []
    certificate_namespace, _, certificate_name = reference.partition("/")
    certificate = _named(objects, "Certificate", certificate_name, certificate_namespace)
    if certificate is None:
        return [f"{label}: {INJECT_CA_FROM} is {reference!r}, a Certificate the rendering does "
                f"not have"]
    where = _label(certificate)
    spec = certificate.get("spec") or {}
    found = []
    expected = f"{service['metadata']['name']}.{namespace}.svc"
    if expected not in spec.get("dnsNames", []):
        found.append(f"{where}: dnsNames {spec.get('dnsNames')} lack {expected}, the name the "
                     f"API server calls and verifies")
    found += _issuer_problems(certificate, objects)
    for deployment in injectors:
        found += _secret_problems(deployment, spec.get("secretName"), where)
    return found


def _issuer_problems(certificate: Manifest, objects: list[Manifest]) -> list[str]:
    """The serving Certificate's Issuer is a CA Issuer of this namespace whose Secret a CA
    Certificate, issued by an Issuer of the rendering, writes."""
    where = _label(certificate)
    namespace = certificate["metadata"].get("namespace")
    ref = certificate["spec"].get("issuerRef", {})
    issuer = _named(objects, ref.get("kind", "Issuer"), ref.get("name", ""), namespace)
    if issuer is None or "ca" not in (issuer.get("spec") or {}):
        return [f"{where}: issuerRef {ref.get('name')!r} names no CA Issuer of the rendering"]
    secret = issuer["spec"]["ca"].get("secretName")
    cas = [c for c in _all(objects, "Certificate") if c["metadata"].get("namespace") == namespace
           and (c.get("spec") or {}).get("secretName") == secret]
    if not cas or not cas[0]["spec"].get("isCA"):
        return [f"{_label(issuer)}: its Secret {secret!r} is written by no Certificate with "
                f"isCA: true"]
    ca_ref = cas[0]["spec"].get("issuerRef", {})
    if _named(objects, ca_ref.get("kind", "Issuer"), ca_ref.get("name", ""), namespace) is None:
        return [f"{_label(cas[0])}: issuerRef {ca_ref.get('name')!r} names no Issuer of the "
                f"rendering"]
    return []


def _secret_problems(deployment: Manifest, secret: str | None, where: str) -> list[str]:
    """The injector reads --tls-cert and --tls-key from a volume of the Certificate's Secret."""
    container = _injector(deployment)
    if container is None:
        return []
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    found = []
    for option, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")):
        path = _option(container, option)
        if path is None:
            found.append(f"Deployment {deployment['metadata']['name']}: no {option}")
            continue
        mounts = [m for m in container.get("volumeMounts", [])
                  if PurePosixPath(path).parent == PurePosixPath(m["mountPath"])]
        volume = volumes.get(mounts[0]["name"], {}) if mounts else {}
        mounted = volume.get("secret", {}).get("secretName")
        if mounted != secret or PurePosixPath(path).name != key:
            actual = f"Secret {mounted}'s" if mounted else "no Secret's"
            found.append(f"Deployment {deployment['metadata']['name']}: {option} {path} is "
                         f"{actual} {PurePosixPath(path).name}, not {key} of Secret {secret} "
                         f"({where} writes it) mounted as a folder")
    return found


def main(argv: list[str]) -> int:
    label = argv[1] if len(argv) > 1 else "stdin"
    objects = [doc for doc in yaml.safe_load_all(sys.stdin) if doc]
    if "--built-in" in argv:
        target = argv[argv.index("--built-in") + 1]
        with open(target, "w", encoding="utf-8") as out:
            yaml.safe_dump_all([o for o in objects if is_built_in(o)], out, sort_keys=False)
    found = problems(objects)
    for problem in found:
        print(f"FAIL webhook ({label}): {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
