"""Entry point of the self-contained bundle: the frozen `sidecar` stands in for `python -m sidecar`.

Three things a plain `sidecar.cli:main` entry point would get wrong inside a PyInstaller bundle:

- The bootloader prepends the bundle's own library folder to LD_LIBRARY_PATH and sets _PYI_*
  variables for itself. `sidecar run` passes its environment to the wrapped command, which would
  then load our libssl, libz or libstdc++ instead of the trainer image's own (and a frozen
  trainer would take our _PYI_* variables for its own). LD_LIBRARY_PATH is put back as it was
  and the _PYI_* variables are removed once the bootloader is done with them.
- The bundled OpenSSL looks for CA certificates where the build machine keeps them. On a
  trainer image of another distribution (RHEL, SUSE, Alpine) that folder is absent, so the
  image's own CA bundle is named in SSL_CERT_FILE when nothing else names one.
- There is no Python interpreter in the bundle, so `sys.executable -m sidecar ...` (how
  `sidecar demo` starts `sidecar run`) and `sys.executable SCRIPT.py` for a script shipped in the
  bundle (the demo's example trainer) are understood here.
"""

from __future__ import annotations

import os
import runpy
import ssl
import sys
from collections.abc import MutableMapping
from pathlib import Path

# Where distributions keep their CA bundle (Debian/Ubuntu, RHEL/Fedora, SUSE, Alpine/others).
SYSTEM_CA_FILES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
)


def restore_loader_environment(environ: MutableMapping[str, str], bundle_dir: str) -> None:
    """Undo the bootloader's changes to the environment, so child processes do not inherit them."""
    for name in [n for n in environ if n.startswith("_PYI_")]:
        del environ[name]
    original = environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if original is not None:
        environ["LD_LIBRARY_PATH"] = original
        return
    kept = [p for p in environ.get("LD_LIBRARY_PATH", "").split(":")
            if p and os.path.realpath(p) != os.path.realpath(bundle_dir)]
    if kept:
        environ["LD_LIBRARY_PATH"] = ":".join(kept)
    else:
        environ.pop("LD_LIBRARY_PATH", None)


def name_system_ca_file(environ: MutableMapping[str, str]) -> None:
    """Point OpenSSL at this system's CA bundle when its compiled-in default is missing here."""
    if "SSL_CERT_FILE" in environ or "SSL_CERT_DIR" in environ:
        return
    defaults = ssl.get_default_verify_paths()
    if (defaults.cafile and os.path.exists(defaults.cafile)) or (
            defaults.capath and os.path.isdir(defaults.capath) and os.listdir(defaults.capath)):
        return
    found = next((f for f in SYSTEM_CA_FILES if os.path.isfile(f)), None)
    if found is None:
        import certifi  # a trainer image with no CA bundle at all: the one shipped in the bundle

        found = certifi.where()
    environ["SSL_CERT_FILE"] = found


def main() -> int:
    bundle_dir = getattr(sys, "_MEIPASS", os.path.dirname(os.path.abspath(__file__)))
    restore_loader_environment(os.environ, bundle_dir)
    name_system_ca_file(os.environ)
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "-m" and args[1] == "sidecar":
        args = args[2:]
    elif args and args[0].endswith(".py") and Path(args[0]).resolve().is_relative_to(
            Path(bundle_dir).resolve()):
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
        return 0
    sys.argv = [sys.argv[0], *args]
    from sidecar.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
