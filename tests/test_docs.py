"""What a user reads points at documents that ship: docs/ingest.md for the routes, bodies and
failure handling, never an internal document (INTERNAL) that does not. What the code's and the
tests' comments point at exists: a section of docs/, a file, a module, a name."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sidecar"
INGEST_DOC = ROOT / "docs" / "ingest.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
MODULES = sorted(PACKAGE.rglob("*.py"))
# The tests' own text: Python, shell, C, notes (not what a run leaves: caches, built libraries).
TEST_FILES = sorted(p for p in (ROOT / "tests").rglob("*")
                    if p.suffix in (".py", ".sh", ".c", ".md", ".txt")
                    and "__pycache__" not in p.parts)
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
        if not policy.of_ingest:
            continue
        assert f"| `{policy.path}` |" in text, policy.path
        assert policy.guarantee.value in text


# A pointer into the docs, as the code writes it: `docs/ingest.md#routes-and-bodies`.
DOC_POINTER = re.compile(r"\bdocs/([\w/.-]+?\.md)(?:#([\w-]+))?")
# A file named in a comment or docstring: `journal.py`, `sources/console/signatures.py`.
FILE_NAME = re.compile(r"(?<![\w/.-])([\w/-]*\w\.(?:py|md))\b")
# `see X` naming a module or a name of the code (prose such as "see the token" has neither a
# dot, an underscore nor backticks).
SEE = re.compile(r"\b[Ss]ee:? (`?)((?:\w+\.)*\w+)\1")


def notes(path: Path) -> Iterator[tuple[int, str]]:
    """The comments and docstrings of a module, each with its line: what its readers read."""
    text = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def defined_names(path: Path) -> set[str]:
    """What a module defines, as a `see` names it: functions, classes, assignments, attributes
    set on self (`backlog`), methods as `Class.method`, and the labels of comment blocks
    (`# _SIMPLE_EVENT: ...`)."""
    text = path.read_text(encoding="utf-8")
    names = set(re.findall(r"^\s*# (\w+):", text, re.M))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def test_anchors_are_made_as_github_makes_them() -> None:
    headings = "## The platform's variables\n### `sidecar run`: the wrapper\n## At-least-once\n"
    assert anchors(headings) == {"the-platforms-variables", "sidecar-run-the-wrapper",
                                 "at-least-once"}


def test_every_pointer_of_the_code_into_the_docs_lands_on_a_section() -> None:
    pages = {page.name: anchors(page.read_text(encoding="utf-8")) for page in DOC_PAGES}
    found, wrong = 0, []
    for path in (*MODULES, *TEST_FILES):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for page, anchor in DOC_POINTER.findall(line):
                found += 1
                if page not in pages or (anchor and anchor not in pages[page]):
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: docs/{page}#{anchor}")
    assert found >= 40, "the code points at the sections of docs/ that say what it implements"
    assert wrong == []


def shipped() -> list[str]:
    """Every file of the repository, as `/` and its path from the root: what git tracks or
    would (a build/ folder or a virtualenv left in the checkout is neither, and may hold
    modules that are gone)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return ["/" + name for name in listed.splitlines() if (ROOT / name).is_file()]


def test_every_file_a_comment_names_exists() -> None:
    """A name is the file's path from the repository's root, the package's or any folder of
    it (`files/offsets.py`, `journal.py`): the end of the path of a file that exists."""
    files = shipped()
    wrong = []
    for path in MODULES:
        for line, text in notes(path):
            for name in FILE_NAME.findall(text):
                if not any(p.endswith("/" + name) for p in files):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert wrong == []


# A folder of the package as the README and docs/ write it: `sidecar/delivery/`,
# `sources/telemetry/collectors/`.
PACKAGE_FOLDER = re.compile(r"(?<![\w/.-])(?:sidecar/)?((?:sources|delivery|observe|commands)"
                            r"(?:/\w+)*/)")
# A module as they write it: `sidecar/sources/files/kinds.py`, `files/offsets.py`, `follow.py`.
MODULE_NAME = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b")


def missing_paths(text: str, files: list[str], bare: bool) -> list[str]:
    """The folders and modules `text` names that do not exist. A module is the end of the path
    of a file (`files/offsets.py`); one named without a folder (`follow.py`) only where `bare`
    says that the text is about the code, as elsewhere it may be the user's (`train.py`)."""
    missing = [folder for folder in PACKAGE_FOLDER.findall(text) if not (PACKAGE / folder).is_dir()]
    for name in MODULE_NAME.findall(text):
        if ("/" in name or bare) and not any(p.endswith("/" + name) for p in files):
            missing.append(name)
    return missing


def test_the_path_rule_finds_a_module_or_folder_that_is_gone() -> None:
    text = ("`sidecar/delivery/client.py` and `files/offsets.py` under `sources/telemetry/`, but "
            "`sources/telemetry/hardware.py`, `sidecar/sources/gone/` and `gone.py`; "
            "python train.py")
    files = shipped()
    assert missing_paths(text, files, bare=False) == ["sources/gone/",
                                                      "sources/telemetry/hardware.py"]
    assert missing_paths(text, files, bare=True) == ["sources/gone/",
                                                     "sources/telemetry/hardware.py",
                                                     "gone.py", "train.py"]


def test_every_module_and_folder_the_readme_and_docs_name_exists() -> None:
    """Everywhere, a module named with its folder and a folder of the package; in
    docs/design.md, "How it is built", which describes the code, every module named."""
    built = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    files = shipped()
    wrong = [f"{page.relative_to(ROOT)}: {name}" for page in (ROOT / "README.md", *DOC_PAGES)
             for name in missing_paths(page.read_text(encoding="utf-8"), files, bare=False)]
    wrong += [f"docs/design.md, How it is built: {name}"
              for name in missing_paths(built, files, bare=True)]
    assert len(MODULE_NAME.findall(built)) >= 50, "the section names the modules it describes"
    assert wrong == []


def _named_modules(text: str, modules: list[str]) -> set[str]:
    """The modules of `modules` (paths from sidecar/) that `text` names: by their path
    (`config.py` is the top-level one), or by an end of it that no other module shares
    (`nvml/processes.py`, `bindings.py`)."""
    named: set[str] = set()
    for name in MODULE_NAME.findall(text):
        name = name.removeprefix("sidecar/")
        ends = [module for module in modules if module == name or module.endswith("/" + name)]
        if name in modules:
            named.add(name)
        elif len(ends) == 1:
            named.update(ends)
    return named


def test_the_design_page_names_every_module_of_the_package() -> None:
    """docs/design.md is the map of the code both ways: a module it names exists (above), and
    every module of sidecar/ is named there, so a new module comes with its line on the map."""
    modules = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if path.name != "__init__.py")
    built = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert "sources/files/follow.py" in modules
    assert set(modules) - _named_modules(built, modules) == set()


def test_a_name_two_modules_share_names_neither() -> None:
    modules = ["config.py", "commands/config.py", "collectors/processes.py",
               "nvml/processes.py", "nvml/bindings.py"]
    text = "`config.py`, `processes.py`, `bindings.py`, `commands/config.py`"
    assert _named_modules(text, modules) == {"config.py", "nvml/bindings.py",
                                             "commands/config.py"}
    assert _named_modules("`processes.py`", modules) == set()


def test_every_module_and_name_a_see_names_exists() -> None:
    seen, wrong = 0, []
    for path in MODULES:
        names = defined_names(path)
        for line, text in notes(path):
            for quote, name in SEE.findall(text):
                if not (quote or "_" in name or "." in name):
                    continue  # prose: "see the token"
                seen += 1
                if name.startswith("sidecar."):
                    module = ROOT.joinpath(*name.split("."))
                    ok = module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()
                else:
                    ok = name in names
                if not ok:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: see {name}")
    assert seen >= 5, "the form is in use: the test must see it"
    assert wrong == []


def _spells_the_pattern(path: Path, line: str) -> bool:
    """The one line that must spell what it forbids: this module's INTERNAL."""
    return path == Path(__file__) and line.startswith("INTERNAL = re.compile(")


def test_no_file_of_the_package_docs_readme_or_tests_names_an_internal_document() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*")), *sorted(PACKAGE.rglob("*")),
             *TEST_FILES]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in files if path.is_file() and path.suffix != ".pyc"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if INTERNAL.search(line) and not _spells_the_pattern(path, line)]
    assert found == []


def test_every_link_between_the_docs_lands_on_a_section() -> None:
    readme = ROOT / "README.md"
    known = {path.resolve(): anchors(path.read_text(encoding="utf-8"))
             for path in (readme, *DOC_PAGES)}
    wrong, links = [], 0
    for page in DOC_PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?(?:#([\w-]+))?\)",
                                         page.read_text(encoding="utf-8")):
            links += 1
            where = (page.parent / target).resolve() if target else page.resolve()
            if where not in known or (anchor and anchor not in known[where]):
                wrong.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    for target, anchor in re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#([\w-]+))?\)",
                                     readme.read_text(encoding="utf-8")):
        links += 1
        where = (ROOT / target).resolve()
        if where not in known or (anchor and anchor not in known[where]):
            wrong.append(f"README.md: {target}#{anchor}")
    assert links > 20
    assert wrong == []


TEST_MAP = ROOT / "tests" / "MAP.md"
MAP_ROW = re.compile(r"^\| `([\w/.]+\.py)` \| (.+) \|$", re.M)


def test_the_test_map_names_every_module_and_every_test_file() -> None:
    """tests/MAP.md: a module's tests found from its name. Every module of the package has its
    row, every test file is named in it, and nothing it names is gone."""
    text = TEST_MAP.read_text(encoding="utf-8")
    rows = {module: re.findall(r"`(test_\w+\.py)`", tests)
            for module, tests in MAP_ROW.findall(text)}
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    tests = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    named = set(re.findall(r"`(test_\w+\.py)`", text))
    assert set(rows) == modules, (sorted(modules - set(rows)), sorted(set(rows) - modules))
    assert all(rows.values()), [module for module, found in rows.items() if not found]
    assert named == tests, (sorted(tests - named), sorted(named - tests))
