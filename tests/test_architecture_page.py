"""docs/architecture.md cannot drift from the package: every module of ``bench_lib`` is named
in its map, and every module the page names exists (a module added, moved or removed without
the page fails here), and every small module with one importer says why it stands alone
there (and only those). Read from the file system and the page; nothing is imported.

How the page names a module: in the map (the fenced block that starts ``bench_lib/``) a
line at two spaces opens an entry, a package (``commands/``, which names its
``__init__.py``) or a module of ``bench_lib`` itself (``rig.py``); a bare ``name.py`` on the
entry's lines is a module of that package. A path (``analysis/bound.py``, anywhere on the
page) names ``bench_lib/analysis/bound.py``, unless it starts with a folder of the
repository (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

PAGE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "bench_lib"
TOP_FOLDERS = ("bench_lib", "benchmarks", "docs", "notebooks", "tests")
PY = re.compile(r"(?<![\w/<.-])[\w/]+\.py\b")
"""A module's name or path; ``<name>.py`` is a placeholder, not a name."""
ENTRY = re.compile(r"^(?P<indent> {0,2})(?P<name>[\w/]+/)\s")
"""A folder's line in the map: a top folder at column 0, a package at two spaces."""


def the_map(text: str) -> list[str]:
    """The lines of the page's map: the fenced block whose first line is ``bench_lib/``."""
    blocks = re.findall(r"^```\n(.*?)^```$", text, flags=re.M | re.S)
    found = [b for b in blocks if b.startswith("bench_lib/")]
    assert len(found) == 1, "docs/architecture.md: no map (a fenced block starting bench_lib/)"
    return found[0].splitlines()


def path_of(token: str) -> Path:
    """The file a path on the page names."""
    return REPO / token if token.split("/")[0] in TOP_FOLDERS else PACKAGE / token


def page_names() -> tuple[set[Path], set[Path]]:
    """(the modules of ``bench_lib`` the map names, every file the page names as a module)."""
    text = PAGE.read_text()
    named: set[Path] = set()
    folder = REPO
    for line in the_map(text):
        if entry := ENTRY.match(line):
            parent = REPO if not entry["indent"] else PACKAGE
            folder = parent / entry["name"]
            if folder.is_relative_to(PACKAGE):  # a package: its line names its __init__.py
                named.add(folder / "__init__.py")
        elif line[:3].strip():  # a module of bench_lib itself (``  rig.py``)
            folder = PACKAGE
        named |= {folder / token for token in PY.findall(line) if "/" not in token}
    referred = named | {path_of(token) for token in PY.findall(text) if "/" in token}
    return {p for p in named if p.is_relative_to(PACKAGE)}, referred


def package_modules() -> set[Path]:
    """Every module of ``bench_lib`` on disk."""
    return {p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def relative(paths: set[Path]) -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in paths)


def test_every_module_is_named_on_the_architecture_page() -> None:
    modules = package_modules()
    named, _ = page_names()
    missing = relative(modules - named)
    assert not missing, (
        "docs/architecture.md does not name these modules: give each a line (what it holds) "
        "under its package in the map: " + ", ".join(missing))


def test_every_module_the_architecture_page_names_exists() -> None:
    _, referred = page_names()
    gone = relative({p for p in referred if not p.is_file()})
    assert not gone, (
        "docs/architecture.md names modules that do not exist (moved or removed?): "
        + ", ".join(gone))


SMALL = 60
"""Under this many lines, a module that only one module imports says on the page why it is
not part of that module."""
REGISTRIES = ("bench_lib.strategies", "bench_lib.commands.parser")
"""The registries: each imports one module per CLI name (a strategy, a command)."""


def standalone_named() -> set[Path]:
    """The modules the page's ``## Small modules that stand alone`` section gives a reason
    for: the module each of its items opens with."""
    section = PAGE.read_text().split("## Small modules that stand alone", 1)
    assert len(section) == 2, "docs/architecture.md: no '## Small modules that stand alone'"
    body = section[1].split("\n## ", 1)[0]
    return {path_of(m) for m in re.findall(r"^- `([\w/]+\.py)`", body, flags=re.M)}


def small_leaves(limit: int = SMALL) -> set[Path]:
    """Modules under ``limit`` lines imported by exactly one other module, that module not
    a registry (``REGISTRIES``)."""
    from tests.test_layering import EDGES, MODULES

    importers: dict[str, set[str]] = {}
    for e in EDGES:
        if e.target != e.source:
            importers.setdefault(e.target, set()).add(e.source)
    found = set()
    for name, (path, is_package) in MODULES.items():
        by = importers.get(name, set())
        if not is_package and len(path.read_text().splitlines()) < limit and len(by) == 1 \
                and not by & set(REGISTRIES):
            found.add(path)
    return found


def standalone_reasons(limit: int = SMALL) -> tuple[list[str], list[str]]:
    """(small leaves the page gives no reason for, modules it gives a reason for that are no
    small leaves)."""
    leaves, named = small_leaves(limit), standalone_named()
    return relative(leaves - named), relative(named - leaves)


def test_every_small_leaf_says_why_it_stands_alone() -> None:
    unexplained, gone = standalone_reasons()
    assert not unexplained, (
        f"these modules are under {SMALL} lines and only one module imports them: fold each "
        "into its reader (or the package whose idea it is), or say why it stands alone under "
        "'## Small modules that stand alone' in docs/architecture.md: " + ", ".join(unexplained))
    assert not gone, (
        "docs/architecture.md says why these stand alone, but they are no longer small "
        "modules with one importer: drop their lines: " + ", ".join(gone))


def test_the_leaf_check_sees_both_ways_of_drifting() -> None:
    # A higher limit finds leaves with no reason given; a limit of 1 finds none, so every
    # reason given is one too many: the check above can fail either way.
    unexplained, _ = standalone_reasons(limit=200)
    _, gone = standalone_reasons(limit=1)
    assert unexplained and "bench_lib/measure/kernels.py" not in unexplained
    assert "bench_lib/measure/kernels.py" in gone
