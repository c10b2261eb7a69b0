"""Build the stand-in libnvidia-ml.so.1 from nvml_stub.c against the NVML header of nvidia-nvml-dev.

    lib_dir = build(tmp_dir)   # tmp_dir/libnvidia-ml.so.1
    env["LD_LIBRARY_PATH"] = str(lib_dir)   # the real bindings' CDLL("libnvidia-ml.so.1") finds it
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("nvml_stub.c")
SONAME = "libnvidia-ml.so.1"  # what pynvml's _LoadNvmlLibrary asks the dynamic loader for
HEADER_PACKAGE = "nvidia-nvml-dev"


class BuildError(Exception):
    """The stand-in could not be built; the message says what is missing."""


def gcc() -> str | None:
    """The C compiler, or None when there is none."""
    return shutil.which("gcc")


def nvml_include_dir() -> Path:
    """The folder holding nvml.h from the installed nvidia-nvml-dev wheel."""
    try:
        files = importlib.metadata.files(HEADER_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(f"{HEADER_PACKAGE} is not installed: pip install -e '.[test]'") from None
    for file in files:
        if file.name == "nvml.h":
            return Path(str(file.locate())).parent
    raise BuildError(f"{HEADER_PACKAGE} is installed but ships no nvml.h")


def build(out_dir: Path) -> Path:
    """Compile the stand-in into `out_dir` (created): the folder to put on the loader's path."""
    compiler = gcc()
    if compiler is None:
        raise BuildError("gcc is not installed")
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wno-deprecated-declarations",
               f"-I{nvml_include_dir()}", f"-Wl,-soname,{SONAME}", "-o", str(out_dir / SONAME),
               str(SOURCE), "-lpthread"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(f"gcc failed:\n{done.stderr}")
    return out_dir
