#!/usr/bin/env bash
# Build the self-contained sidecar bundle: PyInstaller one-folder, carrying its own interpreter,
# for trainer images that have no compatible Python. Then run it from an unrelated directory
# under `env -i` with a bare PATH, so nothing of ours outside the bundle can be what works.
#
#   deploy/bundle/build.sh [OUT_DIR]       default: dist/bundle; the result is OUT_DIR/sidecar/
#   PYTHON=python3.12 deploy/bundle/build.sh   build with another interpreter
#
# The bundle runs on Linux of the same architecture with a glibc at least as new as the one it
# was built against (printed at the end): build it on the oldest distribution you must support.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(realpath -m "${1:-$root/dist/bundle}")
python=${PYTHON:-python3}

for tool in objdump ldd; do
    command -v "$tool" >/dev/null || { echo "build.sh: PyInstaller needs $tool (Debian: apt-get install binutils libc-bin)" >&2; exit 1; }
done
if [ "$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED"))')" != 1 ]; then
    echo "build.sh: $python has no shared libpython; PyInstaller needs one (Debian's python3, the python:* images and pyenv with --enable-shared have it)" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Install from a copy, so setuptools' in-tree build/ folder never lands in the checkout.
mkdir "$work/src"
cp -R "$root/pyproject.toml" "$root/README.md" "$root/sidecar" "$work/src/"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check "$work/src" certifi "pyinstaller>=6.6"
# Every module must import from a clean install: a dependency missing from pyproject.toml would
# otherwise be left out of the bundle with no more than a PyInstaller warning.
(cd "$work" && "$work/venv/bin/python" - <<'PY'
import importlib, pkgutil, sidecar
for module in pkgutil.walk_packages(sidecar.__path__, "sidecar."):
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
PY
)
"$work/venv/bin/pyinstaller" --noconfirm --clean --log-level WARN \
    --distpath "$out" --workpath "$work/build" "$root/deploy/bundle/sidecar.spec"

bundle=$out/sidecar
echo "== smoke test: cd / && env -i PATH=/usr/bin:/bin $bundle/sidecar --version"
(cd / && env -i PATH=/usr/bin:/bin "$bundle/sidecar" --version)
glibc=$(find "$bundle" -type f \( -name '*.so*' -o -name sidecar \) -exec objdump -T {} + 2>/dev/null \
    | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -n1)
echo "== built $bundle: $(du -sh "$bundle" | cut -f1) on disk, $(find "$bundle" -type f | wc -l) files, needs ${glibc:-an unknown} or newer"
