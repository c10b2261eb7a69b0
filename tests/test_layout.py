"""The package's folders say its architecture (STYLE.md): data enters in `sources/` (the
command's console, followed files, the node's telemetry: a package each), leaves in `delivery/`,
is shown in `observe/`, and operators' commands live in `commands/`. These rules are checked on
the import graph read from each module's syntax tree, so the shape stays true."""

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
    assert "sidecar.sources.files.follow" in GRAPH
    assert "sidecar.records" in GRAPH["sidecar.sources.files.follow"]


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


SOURCE_KINDS = ("sidecar.sources.console", "sidecar.sources.files", "sidecar.sources.telemetry")

# The one import between two kinds of source, and why: a followed log file is a console captured
# to disk (a CRI log is the same output the wrapper reads from the pipes), so its text goes
# through the console's line assembler, masked and cut exactly as the command's own output is.
ACROSS_KINDS = {("sidecar.sources.files.logfile", "sidecar.sources.console.lines")}


def test_every_source_module_is_in_a_kind() -> None:
    loose = {
        module for module in GRAPH
        if _within(module, "sidecar.sources") and module not in ("sidecar.sources",
                                                                 "sidecar.sources.base")
        and not any(_within(module, kind) for kind in SOURCE_KINDS)
    }
    assert loose == set()
    for kind in SOURCE_KINDS:
        assert kind in GRAPH and ast.get_docstring(
            ast.parse((PACKAGE.parent / kind.replace(".", "/") / "__init__.py").read_text()))


def _module_of(name: str) -> str:
    """The module an imported name lives in (`from m import x` is recorded as `m` and `m.x`)."""
    return name if name in GRAPH else name.rpartition(".")[0]


def test_kinds_of_source_import_each_other_only_where_named() -> None:
    found: set[tuple[str, str]] = set()
    for kind in SOURCE_KINDS:
        for other in SOURCE_KINDS:
            if other != kind:
                for module, names in _importers_of(other, among=kind).items():
                    found.update((module, _module_of(name)) for name in names
                                 if name != other)
    assert found == ACROSS_KINDS

