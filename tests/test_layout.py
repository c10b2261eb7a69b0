"""The package's folders say its architecture (STYLE.md): data enters in `sources/`, leaves in
`delivery/`, is shown in `observe/`, and operators' commands live in `commands/`. These rules are
checked on the import graph read from each module's syntax tree, so the shape stays true."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every `sidecar...` module a file imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "sidecar" or name.startswith("sidecar.")}


GRAPH = {_module_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _importers_of(package: str, among: str) -> dict[str, set[str]]:
    return {
        module: {name for name in names if _within(name, package)}
        for module, names in GRAPH.items()
        if _within(module, among) and any(_within(name, package) for name in names)
    }


def test_the_graph_was_read() -> None:
    assert "sidecar.sources.follow" in GRAPH
    assert "sidecar.records" in GRAPH["sidecar.sources.follow"]


def test_sources_import_neither_delivery_nor_commands() -> None:
    assert _importers_of("sidecar.delivery", among="sidecar.sources") == {}
    assert _importers_of("sidecar.commands", among="sidecar.sources") == {}


def test_delivery_imports_no_source() -> None:
    assert _importers_of("sidecar.sources", among="sidecar.delivery") == {}


def test_commands_are_imported_by_the_cli_alone() -> None:
    importers = {
        module for module in _importers_of("sidecar.commands", among="sidecar")
        if not _within(module, "sidecar.commands")
    }
    assert importers == {"sidecar.cli"}
