#!/usr/bin/env bash
# check.sh on a machine without a GPU: the stand-in NVML library (tests/nvml_stub) and a
# stand-in nvidia-smi that agree on one GPU's values. It exercises everything but the driver:
# the install, the local ingest, the sampler, the comparison and the exit status.
#     tests/gpu/dry_run.sh        (about 40 s; needs gcc for the stand-in library)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
LIB=$(mktemp -d "${TMPDIR:-/tmp}/nvml-stub.XXXXXX")
trap 'rm -rf "$LIB"' EXIT
BUILD_PYTHON=python3  # the stand-in's build needs the test extras (nvidia-nvml-dev)
[[ -x "$REPO/.venv/bin/python" ]] && BUILD_PYTHON="$REPO/.venv/bin/python"
(cd "$REPO" && timeout 120 "$BUILD_PYTHON" -c \
    "import sys; from pathlib import Path; from tests.nvml_stub.build import build; build(Path(sys.argv[1]))" "$LIB")
PATH="$HERE/stand-in:$PATH" LD_LIBRARY_PATH="$LIB" NVML_STUB_SCRIPT="$HERE/stand-in/nvml-script.txt" \
    timeout 300 "$HERE/check.sh" 10
