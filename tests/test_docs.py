"""What a user reads points at documents that ship: docs/ingest.md for the routes, bodies and
failure handling, never an internal document ("CONTRACT ...") that does not."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INGEST_DOC = ROOT / "docs" / "ingest.md"
# Read by users: the README, the docs, every deployment file, the Dockerfile.
USER_FILES = [ROOT / "README.md", ROOT / "Dockerfile",
              *sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file()),
              *sorted(p for p in (ROOT / "deploy").rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)]
INTERNAL = re.compile(r"CONTRACT|\bthe contract\b")


def message_strings(path: Path) -> Iterator[tuple[int, str]]:
    """Every string literal of a module but its docstrings: what its messages and help say
    (comments, which no user reads, are not strings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_message_of_the_package_names_an_internal_document() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
             for path in sorted((ROOT / "sidecar").rglob("*.py"))
             for line, text in message_strings(path) if INTERNAL.search(text)]
    assert found == []


def test_no_user_file_names_an_internal_document() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in USER_FILES
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if INTERNAL.search(line)]
    assert found == []


def anchors(markdown: str) -> set[str]:
    """The fragment of every heading, as GitHub makes it, and every explicit <a id>."""
    found = set(re.findall(r'<a id="([^"]+)"', markdown))
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        found.add(slug)
    return found


def test_every_link_into_the_ingest_document_lands_on_a_section() -> None:
    known = anchors(INGEST_DOC.read_text(encoding="utf-8"))
    texts = [p.read_text(encoding="utf-8") for p in USER_FILES]
    links = {m for text in texts for m in re.findall(r"ingest\.md#([\w-]+)", text)}
    assert links, "the README points into docs/ingest.md"
    assert links <= known, sorted(links - known)
    inside = set(re.findall(r"\]\(#([\w-]+)\)", INGEST_DOC.read_text(encoding="utf-8")))
    assert inside and inside <= known, sorted(inside - known)


def test_the_ingest_document_names_every_route_the_sidecar_posts_to() -> None:
    from sidecar.delivery.client import ROUTES

    text = INGEST_DOC.read_text(encoding="utf-8")
    for policy in ROUTES.values():
        assert f"| `{policy.path}` |" in text, policy.path
        assert policy.guarantee.value in text
