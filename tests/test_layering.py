"""The house's layering, read from the source with ``ast`` (no module is imported).

The rules (docs/architecture.md, "Layout"):

- ``report/`` and ``compare/`` read files only: they import neither ``measure/`` (the
  instruments) nor the runner's packages (``RUNNER``: ``launch/``, ``nodes/``,
  ``prediction/``, ``rows/``, ``run/``) nor torch, directly or through another module.
- ``compare/`` starts no process: it imports neither ``subprocess`` (git included) nor
  ``gate/``, directly or through another module.
- ``gate/`` (the sides, their worktrees, the rounds) sits between ``commands/``, the only
  package that imports it, and the readers: it imports neither ``commands/`` nor
  ``measure/`` nor the runner's packages nor torch (each side's ``run`` is a process of
  its own).
- ``measure/`` touches a clock or a device and never imports the runner's packages; nor
  does ``sweep/``, the plan's data.
- The runner's packages are floors, each importing only those below it (``FLOORS``):
  ``launch/`` (one launch's processes), then ``nodes/`` (several nodes) and
  ``prediction/`` (before a case runs), then ``rows/`` (a case's rows), then ``run/`` (the
  ``run`` command's body).
- ``analysis/`` is arithmetic on figures: it imports no torch and no ``bench_lib`` package
  but itself and ``results/``.
- ``results/`` never imports torch, directly or through another module.
- ``processes/`` imports nothing of ``bench_lib`` but itself, nor names one of its modules in
  a string (an ``importlib.import_module`` of it is an import all the same), nor torch.
- ``commands/`` is the only package that sees argparse: no function below it takes an
  ``argparse.Namespace``, and no module below it imports ``argparse`` (``OWN_PARSERS``
  lists the ones that parse an argv of their own, with why: none today).
- No two modules of ``bench_lib`` import each other, through any number of others; nor do
  two of its packages (``KNOWN_PACKAGE_CIRCLES`` lists the one left, with why).

Every import counts: at the top of a module, inside a function (a lazy import defers a
dependency, it does not remove it), and under ``TYPE_CHECKING`` for the circles (a type
that two modules both need belongs to a third). For torch reached through another module,
imports under ``TYPE_CHECKING`` do not count (they never run).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = "bench_lib"


@dataclass(frozen=True)
class Import:
    """One imported name: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    """A ``bench_lib`` module where the name resolves to one, else the module named."""
    line: int
    kind: str
    """``top``, ``local`` (inside a function) or ``typing`` (under ``TYPE_CHECKING``)."""

    def __str__(self) -> str:
        how = "" if self.kind == "top" else f" ({self.kind})"
        return f"{self.source}:{self.line} -> {self.target}{how}"


def modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``package``: dotted name -> (file, whether it is a package)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool,
             known: Mapping[str, object]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        here = name.split(".") if is_package else name.split(".")[:-1]
        here = here[:len(here) - node.level + 1]
        base = ".".join(here + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imports(package: Path) -> list[Import]:
    """Every import statement of every module under ``package``."""
    known = modules(package)
    out: list[Import] = []
    for name, (path, is_package) in known.items():

        def walk(nodes: Iterable[ast.AST], kind: str, name: str = name,
                 is_package: bool = is_package) -> None:
            for node in nodes:
                if isinstance(node, ast.Import | ast.ImportFrom):
                    out.extend(Import(name, t, node.lineno, kind)
                               for t in _targets(node, name, is_package, known))
                    continue
                inner = kind
                if isinstance(node, ast.If) and _is_type_checking(node.test):
                    walk(node.body, "typing")
                    walk(node.orelse, kind)
                    continue
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    inner = "typing" if kind == "typing" else "local"
                walk(ast.iter_child_nodes(node), inner)

        walk([ast.parse(path.read_text(), str(path))], "top")
    return list(dict.fromkeys(out))  # one per module imported, not per name


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def paths_to(edges: Iterable[Import], sources: Iterable[str], to: str = "torch"
             ) -> dict[str, list[Import]]:
    """For each of ``sources`` that reaches ``to`` (a module outside ``bench_lib``: torch
    unless said) through imports that run (not under ``TYPE_CHECKING``), one chain of
    imports from it to ``to``."""
    graph: dict[str, list[Import]] = {}
    for e in edges:
        if e.kind != "typing":
            graph.setdefault(e.source, []).append(e)
    found = {}
    for start in sources:
        seen, frontier = {start}, [(start, list[Import]())]
        while frontier:
            node, path = frontier.pop(0)
            for e in graph.get(node, []):
                if within(e.target, to):
                    found[start] = [*path, e]
                    frontier = []
                    break
                if within(e.target, ROOT) and e.target not in seen:
                    seen.add(e.target)
                    frontier.append((e.target, [*path, e]))
    return found


def circles(edges: Iterable[Import]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if within(e.target, ROOT) and e.target != e.source:
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth: the longest import chain, a few dozen
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


EDGES = imports(REPO / ROOT)
MODULES = modules(REPO / ROOT)


def _broken(source: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()
            ) -> list[str]:
    return [str(e) for e in EDGES if within(e.source, source)
            and any(within(e.target, f) for f in forbidden)
            and not any(within(e.target, a) for a in allowed)]


def _through(package: str, to: str = "torch") -> list[str]:
    sources = [m for m in MODULES if within(m, package)]
    return [f"{m}: " + " -> ".join(str(e) for e in path)
            for m, path in paths_to(EDGES, sources, to).items()]


RUNNER = ("bench_lib.launch", "bench_lib.nodes", "bench_lib.prediction", "bench_lib.rows",
          "bench_lib.run")
"""The runner's packages, which launch cases and make their rows."""
FLOORS = {
    "bench_lib.launch": ("bench_lib.nodes", "bench_lib.prediction", "bench_lib.rows",
                         "bench_lib.run"),
    "bench_lib.nodes": ("bench_lib.prediction", "bench_lib.rows", "bench_lib.run"),
    "bench_lib.prediction": ("bench_lib.nodes", "bench_lib.rows", "bench_lib.run"),
    "bench_lib.rows": ("bench_lib.nodes", "bench_lib.run"),
}
"""Each of the runner's packages -> the ones above it, which it never imports."""


def test_the_readers_import_neither_instruments_nor_runner_nor_torch():
    for package in ("bench_lib.report", "bench_lib.compare"):
        assert not _broken(package, ("bench_lib.measure", *RUNNER, "torch")), package
        assert not _through(package), package


def test_compare_reads_and_never_runs_anything():
    """``compare/`` judges run folders someone else wrote: no process (``subprocess``, git)
    is started from it, directly or through another module, and the gate that starts
    them sits above it."""
    assert not _broken("bench_lib.compare", ("subprocess", "bench_lib.gate"))
    assert not _through("bench_lib.compare", "subprocess")


def test_the_gate_sits_between_the_commands_and_the_readers():
    """``gate/`` runs each side's ``run`` in a process of its own: it imports neither the
    commands above it nor the runner, the instruments or torch; only ``commands/`` imports
    it."""
    assert MODULES.get("bench_lib.gate"), "bench_lib/gate/ is missing"
    assert not _broken("bench_lib.gate", ("bench_lib.commands", "bench_lib.measure",
                                          *RUNNER, "torch"))
    assert not _through("bench_lib.gate")
    assert not [str(e) for e in EDGES if within(e.target, "bench_lib.gate")
                and not within(e.source, "bench_lib.gate")
                and not within(e.source, "bench_lib.commands")]


def test_the_instruments_never_import_the_runner():
    assert not _broken("bench_lib.measure", RUNNER)
    assert not _broken("bench_lib.sweep", RUNNER)  # the plan's data, before anything runs


def test_the_runners_packages_import_only_the_floors_below_them():
    for package, above in FLOORS.items():
        assert MODULES.get(package), f"{package} is missing"
        assert not _broken(package, above), package


def test_analysis_is_arithmetic_on_figures():
    assert MODULES.get("bench_lib.analysis"), "bench_lib/analysis/ is missing"
    assert not _broken("bench_lib.analysis", (ROOT, "torch"),
                       ("bench_lib.analysis", "bench_lib.results"))
    assert not _through("bench_lib.analysis")


def test_results_never_import_torch():
    assert not _broken("bench_lib.results", ("torch",))
    assert not _through("bench_lib.results")


MODULE_NAME = re.compile(r"bench_lib(\.\w+)*")
"""A string that is a module's dotted name (``"bench_lib.launch.worker"``)."""


def named_modules(package: str, known: Mapping[str, tuple[Path, bool]] = MODULES) -> list[str]:
    """Every string constant in ``package``'s modules that is the name of a ``bench_lib``
    module outside ``package`` (a docstring that mentions one is no name)."""
    found = []
    for name, (path, _) in known.items():
        if within(name, package):
            found += [f"{name}:{node.lineno} {node.value!r}"
                      for node in ast.walk(ast.parse(path.read_text(), str(path)))
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)
                      and MODULE_NAME.fullmatch(node.value)
                      and not within(node.value, package)]
    return found


def test_processes_import_nothing_of_ours_above_them():
    """The fork server warms what its caller names (``launch.agent.WARM_MODULES``): no module
    of the runner's reached through a string."""
    assert MODULES.get("bench_lib.processes.forkserver"), "processes/forkserver.py is missing"
    assert not _broken("bench_lib.processes", (ROOT,), ("bench_lib.processes",))
    assert not named_modules("bench_lib.processes")
    assert not _through("bench_lib.processes")


def test_no_import_circle_between_modules():
    found = circles(EDGES)
    described = [[str(e) for e in EDGES if e.source in group and e.target in group]
                 for group in found]
    assert not found, described


def package_of(module: str) -> str:
    """``bench_lib.launch.ranks`` -> ``bench_lib.run``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


KNOWN_PACKAGE_CIRCLES: dict[tuple[str, str], str] = {}
"""Package circles still there, each with why; a circle that is gone must leave the list."""


def test_no_import_circle_between_packages():
    edges = [Import(package_of(e.source), package_of(e.target), e.line, e.kind) for e in EDGES
             if within(e.target, ROOT) and package_of(e.source) != package_of(e.target)]
    found = {tuple(group) for group in circles(edges)}
    assert found <= set(KNOWN_PACKAGE_CIRCLES), [
        [str(e) for e in EDGES if package_of(e.source) in group
         and package_of(e.target) in group and package_of(e.source) != package_of(e.target)]
        for group in found - set(KNOWN_PACKAGE_CIRCLES)]
    gone = set(KNOWN_PACKAGE_CIRCLES) - found
    assert not gone, f"no longer a circle, remove from KNOWN_PACKAGE_CIRCLES: {sorted(gone)}"


def test_the_checks_see_lazy_and_typing_imports(tmp_path):
    """The scanner itself: a circle closed by a function's import or a ``TYPE_CHECKING``
    one is found, a relative import resolves, and torch reached through a module is."""
    pkg = tmp_path / ROOT
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from bench_lib import b\n")
    (pkg / "b.py").write_text("def f():\n    from bench_lib.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from bench_lib.sub.d import D\n")
    (pkg / "sub" / "d.py").write_text("from .. import c\nimport torch\n")
    edges = imports(pkg)
    assert {(e.source, e.target, e.kind) for e in edges} >= {
        ("bench_lib.a", "bench_lib.b", "top"), ("bench_lib.b", "bench_lib.a", "local"),
        ("bench_lib.c", "bench_lib.sub.d", "typing"), ("bench_lib.sub.d", "bench_lib.c", "top")}
    assert circles(edges) == [["bench_lib.a", "bench_lib.b"], ["bench_lib.c", "bench_lib.sub.d"]]
    assert set(paths_to(edges, ["bench_lib.a", "bench_lib.c", "bench_lib.sub.d"])) == {
        "bench_lib.sub.d"}, "an import under TYPE_CHECKING never runs"
    (pkg / "sub" / "e.py").write_text('"""Warms bench_lib.a."""\nimport importlib\n'
                                      'importlib.import_module("bench_lib.a")\n'
                                      'SELF = "bench_lib.sub.e"\n')
    assert named_modules("bench_lib.sub", modules(pkg)) == ["bench_lib.sub.e:3 'bench_lib.a'"]


def below_commands(module: str) -> bool:
    """A module below ``commands/``: any of ``bench_lib`` but ``commands/`` and
    ``__main__`` (which hands ``sys.argv`` to ``commands.main``)."""
    return not within(module, "bench_lib.commands") and module != "bench_lib.__main__"


NAMESPACE = re.compile(r"\b(argparse\.)?Namespace\b")
"""An annotation that names argparse's ``Namespace`` (``types.SimpleNamespace`` is none)."""


def namespace_parameters(known: Mapping[str, tuple[Path, bool]] = MODULES) -> list[str]:
    """Every parameter of a function below ``commands/`` annotated with an
    ``argparse.Namespace`` (or ``Namespace``; quoted or not)."""
    found = []
    for name, (path, _) in known.items():
        if not below_commands(name):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None and NAMESPACE.search(
                        text := ast.unparse(arg.annotation)):
                    found.append(f"{name}:{arg.lineno} {node.name}({arg.arg}: {text})")
    return found


OWN_PARSERS: dict[str, str] = {}
"""Modules below ``commands/`` that import ``argparse`` to parse an argv of their own (a
worker's or a tool's ``python -m`` entry point), each with why; none does today (the
workers read positional arguments from their launcher; ``reference`` takes no flags and
builds the commands' parser through ``commands``), and one that stops must leave the list."""


def argparse_importers(edges: Iterable[Import]) -> dict[str, str]:
    """Module below ``commands/`` -> one of its imports of ``argparse``."""
    return {e.source: str(e) for e in edges
            if within(e.target, "argparse") and below_commands(e.source)}


def test_only_the_commands_see_argparse():
    """A command builds a frozen plan from its flags (``TunePlan``, ``ParityPlan``,
    ``DistancePlan``, ``GatePlan``, ``ComparePlan``) and hands that down: no function below
    ``commands/`` takes an ``argparse.Namespace``, and no module there imports ``argparse``
    unless it parses an argv of its own (``OWN_PARSERS``)."""
    assert not namespace_parameters()
    found = argparse_importers(EDGES)
    assert set(found) <= set(OWN_PARSERS), [v for k, v in found.items() if k not in OWN_PARSERS]
    gone = set(OWN_PARSERS) - set(found)
    assert not gone, f"no longer imports argparse, remove from OWN_PARSERS: {sorted(gone)}"


def test_the_namespace_check_sees_what_it_should(tmp_path):
    """The scanner itself: an annotated parameter below ``commands/`` is found, quoted or
    not, keyword-only too; ``commands/``'s own and a ``SimpleNamespace`` are not."""
    pkg = tmp_path / ROOT
    (pkg / "commands").mkdir(parents=True)
    (pkg / "sub").mkdir()
    for init in (pkg, pkg / "commands", pkg / "sub"):
        (init / "__init__.py").write_text("")
    (pkg / "commands" / "c.py").write_text(
        "import argparse\ndef command(args: argparse.Namespace) -> int:\n    return 0\n")
    (pkg / "sub" / "s.py").write_text(
        "import argparse\nimport types\n"
        "def f(args: argparse.Namespace, x: types.SimpleNamespace) -> None: ...\n"
        "def g(*, flags: 'Namespace | None' = None) -> None: ...\n")
    assert namespace_parameters(modules(pkg)) == [
        "bench_lib.sub.s:3 f(args: argparse.Namespace)",
        "bench_lib.sub.s:4 g(flags: 'Namespace | None')"]
    assert list(argparse_importers(imports(pkg))) == ["bench_lib.sub.s"]
