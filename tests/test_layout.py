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



REGISTRY = "sidecar.sources.files.kinds"


def _kind_names(tree: ast.AST, words: set[str]) -> list[tuple[int, str]]:
    """Where a syntax tree spells one of `words` itself: a string constant that is the word
    exactly (`"jsonl"`, `"--jsonl"`), an attribute read, a keyword argument or a declared field
    of that name (`cfg.jsonl`, `_replace(jsonl=...)`, `jsonl: tuple[str, ...]`). A method
    called is no field read: the logger's `log.log(level, ...)` is not `cfg.log`."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            spelled = node.value
        elif isinstance(node, ast.Attribute) and id(node) not in called:
            spelled = node.attr
        elif isinstance(node, ast.keyword) and node.arg is not None:
            spelled = node.arg
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            spelled = node.target.id
        else:
            continue
        if spelled in words:
            found.append((getattr(node, "lineno", 0), spelled))
    return found


def test_no_module_but_the_registry_and_the_parsers_names_a_file_source_kind() -> None:
    """A new file-source kind is its parser module and one row of sources/files/kinds.py
    (STYLE.md): every other module loops over the rows. So outside the registry and the parser
    modules it imports, no code spells a registered kind by its name, its flag or its variable
    (`"log"`, `"--log"`, `"SIDECAR_LOG"`), as a string constant that is exactly that, an
    attribute read (`cfg.log`), a keyword argument (`log=`) or a field (`log: tuple[str,
    ...]`). Exact, not a substring: "log" is a common word, and prose (docstrings, messages
    naming several options, `--log-format`) is left alone, as are the logger `log` (a name, and
    `log.log(...)` a method call) and the module `sidecar.log` (imported by name)."""
    from sidecar.sources.files.kinds import FILE_KINDS

    words = {word for kind in FILE_KINDS
             for word in (kind.name, kind.flag, "SIDECAR_" + kind.name.upper().replace("-", "_"))}
    parsers = {_module_of(name) for name in GRAPH[REGISTRY]
               if _within(_module_of(name), "sidecar.sources.files")}
    assert {"sidecar.sources.files.logfile", "sidecar.sources.files.jsonl",
            "sidecar.sources.files.tensorboard"} <= parsers
    # A kind may share its name with the ingest route its files go to (`validation`): where
    # the routes are spelled (delivery's table, the local ingest's checks) the word is the route.
    from sidecar.delivery.client import ROUTES

    def spelled(module: str) -> set[str]:
        routes = _within(module, "sidecar.delivery") or module in (
            "sidecar.commands.receive", "sidecar.commands.ingest_checks")
        return words - set(ROUTES) if routes else words

    named = {
        f"{module}:{line} {word!r}"
        for path in PACKAGE.rglob("*.py")
        if (module := _module_name(path)) not in {REGISTRY, *parsers}
        for line, word in _kind_names(ast.parse(path.read_text(), str(path)), spelled(module))
    }
    assert named == set()


def test_the_kind_rule_finds_a_kind_where_one_is_named() -> None:
    spelled = _kind_names(ast.parse(
        'class Config(NamedTuple):\n    tensorboard: tuple[str, ...] = ()\n'
        'if cfg.jsonl or cfg._replace(log=()) or option == "--tensorboard":\n'
        '    log.log(20, "--log-format and --log files, a log")\n'), {"log", "--tensorboard",
                                                                       "jsonl", "tensorboard"})
    assert sorted(word for _, word in spelled) == ["--tensorboard", "jsonl", "log",
                                                   "tensorboard"]


# -- no circles, no arrow back up ------------------------------------------------------------

def _edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> the modules it imports (a name imported from a module counts as the module)."""
    def module_of(name: str) -> str:
        return name if name in graph else name.rpartition(".")[0]

    return {module: {module_of(name) for name in names} & graph.keys() - {module}
            for module, names in graph.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or round a loop: the strongly connected
    components of more than one module (Tarjan's algorithm, iterative)."""
    edges = _edges(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, todo = work[-1]
            for name in todo:
                if name not in index:
                    index[name] = low[name] = len(index)
                    stack.append(name)
                    on_stack.add(name)
                    work.append((name, iter(sorted(edges[name]))))
                    break
                if name in on_stack:
                    low[module] = min(low[module], index[name])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        name = stack.pop()
                        on_stack.discard(name)
                        component.append(name)
                        if name == module:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_modules_import_each_other() -> None:
    """Not even for a type (`if TYPE_CHECKING:`) or inside a function: a circle is two modules
    that cannot be read, tested or moved one without the other. What two modules share goes
    below both (sources/base.py, files/spec.py, nvml/handle.py, records.py)."""
    assert _circles(GRAPH) == []


def test_the_circle_rule_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c.x"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]


# What every part stands on, importing nothing above: the sidecar's own messages, masking, the
# records sources and delivery share, exit statuses, the supervisor, the state folder's files.
BASE = frozenset({"sidecar.aio", "sidecar.exits", "sidecar.log", "sidecar.masking",
                  "sidecar.node", "sidecar.process", "sidecar.records", "sidecar.stall",
                  "sidecar.statefile", "sidecar.supervise", "sidecar.threads"})
# What assembles the parts, and so is above every one of them.
ASSEMBLY = ("sidecar.cli", "sidecar.commands", "sidecar.config", "sidecar.options",
            "sidecar.pipeline", "sidecar.runtime", "sidecar.watch", "sidecar.wrapper")
PARTS = ("sidecar.sources", "sidecar.delivery", "sidecar.observe")


def test_the_base_imports_only_the_base() -> None:
    edges = _edges(GRAPH)
    assert GRAPH.keys() >= BASE
    assert {module: edges[module] - BASE for module in BASE if edges[module] - BASE} == {}


def test_no_part_imports_what_assembles_it() -> None:
    """The configuration is resolved above the sources, delivery and the status endpoint and
    handed down: a part that needs a setting declares it (sources/base.py's Settings), and what
    a part owns (the hand-off's variable, the status address) is defined in it and imported by
    config.py."""
    climbing = {
        f"{module} -> {name}"
        for module, names in _edges(GRAPH).items() if any(_within(module, p) for p in PARTS)
        for name in names if any(_within(name, above) for above in ASSEMBLY)
    }
    assert climbing == set()


# A module past this holds two ideas, or one too big to read at once: split it where they part
# (the options table apart from resolving it, a command's steps apart from its report).
MAX_MODULE_LINES = 700


def test_no_module_is_longer_than_one_idea() -> None:
    long = {f"{path.relative_to(PACKAGE)}: {lines}" for path in PACKAGE.rglob("*.py")
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == set()


def _public_names(paths: list[Path]) -> dict[str, set[str]]:
    """Each public function or class defined at a module's top, with the modules defining it."""
    names: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.parse(path.read_text(), str(path)).body:
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and not node.name.startswith("_")):
                names.setdefault(node.name, set()).add(str(path.relative_to(PACKAGE)))
    return names


def test_no_two_modules_give_one_name_to_two_things() -> None:
    """A name means one thing: two modules' `walk`, `survey`, `Target` or `serve` made a reader
    open both to know which was meant. `main` is the one name many define: each command's
    entry point, which its row of cli.py's SUBCOMMANDS names by its module."""
    paths = [p for p in PACKAGE.rglob("*.py") if "examples" not in p.parts]
    twice = {name: sorted(where) for name, where in _public_names(paths).items()
             if len(where) > 1 and name != "main"}
    assert twice == {}
