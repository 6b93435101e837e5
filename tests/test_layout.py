"""The package's shape: layers without import cycles, the core apart from the tools, size budgets, and
the suite's own rules (a test that starts a process is marked e2e).

Read from the source with `ast`, nothing is imported: fast, and a module that does not import
(a missing dependency, a half-finished edit) is still measured. Every import counts, inside functions
and under `if TYPE_CHECKING:` too: a cycle through a function-level or a typing-only import is still
two modules (or rooms) that need each other to be read. A room is a top-level module or a subpackage;
each room imports only rooms below it (docs/layout.md).
The one exception, marked e2e: the reading guide and the bounds on what a default run executes come
from tracing such a run (scripts/trace_run.py).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "distribuuuu"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# The entry points may import the tools (lazily, one per command); everything else is the core.
ENTRY_POINTS = {f"{PACKAGE}.cli", f"{PACKAGE}.__main__", f"{PACKAGE}.api"}
TOOLS = f"{PACKAGE}.tools"

# {qualified name: why it may be longer}; a module is named "distribuuuu.x", a function
# "distribuuuu.x.Class.method" (a nested one "distribuuuu.x.outer.inner"). Keep it short.
ALLOWED_LONG: dict[str, str] = {
    "distribuuuu.cli_help": "what the command shows: each command's help and examples, text as strings",
    "distribuuuu.tools.compare.run_compare": "one table of runs: plan, run each, compare, print, in order",
}


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py file of the package."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()
_TREES: dict[str, ast.Module] = {}


def _tree(module: str) -> ast.Module:
    if module not in _TREES:
        with open(MODULES[module], encoding="utf-8") as f:
            _TREES[module] = ast.parse(f.read(), filename=MODULES[module])
    return _TREES[module]


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under node, at any depth (in functions and under TYPE_CHECKING too)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name `from X import ...` refers to, relative imports resolved."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].endswith("__init__.py")
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str) -> set[str]:
    """The package's modules this module imports: `from pkg import sub` is the submodule when
    there is one, else the package itself (its __init__ runs)."""
    out = set()
    for node in _import_nodes(_tree(module)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _resolve(module, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            while name and name not in MODULES:  # `import distribuuuu.x.attr` -> distribuuuu.x
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE) and name != module:
                out.add(name)
    return out


GRAPH = {m: _targets(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle, as a path that ends where it starts, per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_back(graph, group) for group in groups]


def _describe(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle as `a -> b -> a`, with every module of its group when the group is larger."""
    lines = []
    for cycle in _cycles(graph):
        group = _group_of(graph, cycle[0])
        extra = f"   (the group: {', '.join(sorted(group))})" if len(group) > len(cycle) - 1 else ""
        lines.append(" -> ".join(cycle) + extra)
    return lines


def _group_of(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that start reaches and that reach start back."""
    def reach(v: str, edges) -> set[str]:
        seen, todo = {v}, [v]
        while todo:
            for w in edges(todo.pop()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    return reach(start, lambda v: graph[v]) & reach(start, lambda v: {u for u in graph if v in graph[u]})


def _path_back(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest import path from the group's first module (by name) back to itself."""
    start = min(group)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                todo.append(w)
    raise AssertionError(f"no cycle in {group}")


def _route(graph: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """A shortest import path from start to a module for which goal(name) holds, or None."""
    came_from = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop(0)
        if goal(v):
            path = [v]
            while came_from[path[-1]]:
                path.append(came_from[path[-1]])
            return path[::-1]
        for w in sorted(graph[v]):
            if w not in came_from:
                came_from[w] = v
                todo.append(w)
    return None


def _is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function and method, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, name)
        else:
            yield from _functions(child, prefix)


# ---------------------------------------------------------------------------------------------


def test_the_graph_sees_the_package():
    """Guards the checks below against reading nothing (a wrong root, a parser that skips all):
    cli imports the tools inside its functions only, and those imports are in the graph."""
    assert f"{PACKAGE}.cli" in MODULES and any(_is_tool(m) for m in GRAPH[f"{PACKAGE}.cli"]), GRAPH.get(
        f"{PACKAGE}.cli")


def test_the_reader_sees_function_level_and_typing_only_imports():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
              "def f():\n    from c import d\n")
    found = [ast.unparse(n) for n in _import_nodes(ast.parse(source))]
    assert found == ["from typing import TYPE_CHECKING", "import a", "import b", "from c import d"]


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]  # a self-import is not a cycle between modules


def test_no_import_cycle():
    cycles = _describe(GRAPH)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(cycles)


def _room(module: str) -> str:
    """The room of a module: the subpackage under the package it is in, else the module itself."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    return sub if len(parts) > 2 or MODULES[module].endswith("__init__.py") else module


def test_no_cycle_between_rooms():
    """Layers you can see: the rooms (top-level modules, subpackages) form no cycle either, so each
    imports only rooms below it (the package's own __init__ aside: it only re-exports api lazily)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        if module == PACKAGE:
            continue
        here = rooms.setdefault(_room(module), set())
        here.update(_room(t) for t in targets if t != PACKAGE and _room(t) != _room(module))
    assert len(rooms) > 10, sorted(rooms)  # the rooms are found
    cycles = _describe({r: {t for t in ts if t in rooms} for r, ts in rooms.items()})
    assert not cycles, "rooms that import each other:\n" + "\n".join(cycles)


def test_the_tools_are_a_subpackage():
    assert TOOLS in MODULES, f"{TOOLS.replace('.', '/')}/ does not exist yet"


def test_the_core_never_imports_the_tools():
    """Directly or through another module: only cli/__main__/api may reach distribuuuu.tools."""
    core = [m for m in MODULES if not _is_tool(m) and m not in ENTRY_POINTS]
    core_graph = {m: (GRAPH[m] if m in core else set()) for m in MODULES}  # entry points end a route
    routes = [r for r in (_route(core_graph, m, _is_tool) for m in core) if r]
    assert not routes, "the core reaches the tools:\n" + "\n".join(" -> ".join(r) for r in routes)


def _code_lines(tree: ast.AST) -> set[int]:
    """The lines of tree that hold code: statements and their continuation lines, not blank lines,
    comments or docstrings (as the trace's count.py counts them), so that writing documentation or
    letting the formatter split a long call never moves a budget."""
    lines: set[int] = set()
    docs: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and (
                isinstance(first.value.value, str)
            ):
                docs.update(range(first.lineno, first.end_lineno + 1))
        if isinstance(node, ast.stmt):
            children = [c for f in ("body", "orelse", "finalbody", "handlers") for c in getattr(node, f, []) or []]
            if children:
                lines.update(range(node.lineno, min(c.lineno for c in children)))
            else:
                lines.update(range(node.lineno, node.end_lineno + 1))
    return lines - docs


def _code_size(module: str, node: ast.AST | None = None) -> int:
    """Code lines of a module, or of one function in it (node)."""
    code = _code_lines(_tree(module))
    if node is None:
        return len(code)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return len(code & set(range(start, node.end_lineno + 1)))


def test_the_code_line_count_leaves_out_docstrings_and_comments():
    tree = ast.parse('"""doc\nmore"""\n# a comment\n\ndef f(a,\n      b):\n    """doc"""\n    return (a +\n            b)\n')
    assert _code_lines(tree) == {5, 6, 8, 9}


def test_no_module_over_the_line_budget():
    """Counted in code lines: a module holds one subject, and a cap never decides where code goes:
    one that states why it is longer is listed in ALLOWED_LONG."""
    long = {m: n for m in MODULES if (n := _code_size(m)) > MAX_MODULE_LINES and m not in ALLOWED_LONG}
    assert not long, f"modules over {MAX_MODULE_LINES} code lines: {long}"


def test_no_function_over_the_line_budget():
    long = {}
    for module in MODULES:
        for name, node in _functions(_tree(module), module):
            lines = _code_size(module, node)
            if lines > MAX_FUNCTION_LINES and name not in ALLOWED_LONG:
                long[name] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} code lines: {long}"


def test_the_allowlist_names_only_what_exists_and_is_long():
    """An entry that no longer applies is removed, so the list never hides a new long function."""
    sizes = {}
    for module in MODULES:
        sizes[module] = (_code_size(module), MAX_MODULE_LINES)
        for name, node in _functions(_tree(module), module):
            sizes[name] = (_code_size(module, node), MAX_FUNCTION_LINES)
    stale = [name for name in ALLOWED_LONG if name not in sizes or sizes[name][0] <= sizes[name][1]]
    assert not stale, f"ALLOWED_LONG entries that are gone or within budget: {stale}"


# ---- The tests' tiers: a test that starts a process is marked e2e ----------------------------------
# Calls that start one: the conftest helpers by name, and these attributes (subprocess.run, mp.spawn,
# launch.spawn.spawn, ...). A module's own helpers and fixtures, and those it imports from another
# test module, pass it on to their callers.
_STARTERS = {"distribuuuu", "torchrun", "run"}
_STARTER_ATTRS = {"run", "Popen", "call", "check_call", "check_output", "spawn", "start_processes"}
# {"file.py::test": why it is in-process although it starts a process}
IN_PROCESS_ALTHOUGH: dict[str, str] = {
    "test_run_folder.py::test_lock_of_a_live_process_holds_and_a_reused_pid_does_not":
        "starts `sleep` as a live pid for the lock; the lock code runs in this process",
    "test_distributed.py::test_spawn_refuses_inside_another_launcher": "refused before any process starts",
    "test_distributed.py::test_spawn_rejects_zero_processes": "refused before any process starts",
}


def _test_files() -> dict[str, ast.Module]:
    folder = os.path.join(ROOT, "tests")
    return {name: ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
            for name in sorted(os.listdir(folder)) if name.startswith("test_") and name.endswith(".py")}


def _calls(node: ast.AST) -> tuple[set[str], bool]:
    """(names it calls or takes as fixtures, whether it calls a starter itself)."""
    names, starts = set(), False
    if isinstance(node, ast.FunctionDef):
        names |= {a.arg for a in node.args.args}
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Name):
            names.add(call.func.id)
            starts |= call.func.id in _STARTERS
        elif isinstance(call.func, ast.Attribute):
            starts |= call.func.attr in _STARTER_ATTRS and not (
                isinstance(call.func.value, ast.Name) and call.func.value.id in ("cli", "api"))
    return names, starts


def _starting_functions(files: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(file, function) of every top-level function that starts a process, directly or not."""
    info, aliases = {}, {}
    for name, tree in files.items():
        for node in ast.walk(tree):  # `from tests.test_faults import _run`, at any depth
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                aliases.update({(name, a.asname or a.name): (node.module[6:] + ".py", a.name) for a in node.names})
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                info[(name, node.name)] = _calls(node)
    starting = {key for key, (_, starts) in info.items() if starts}
    while True:
        more = {key for key, (names, _) in info.items() if key not in starting and any(
            (key[0], n) in starting or aliases.get((key[0], n)) in starting for n in names)}
        if not more:
            return starting
        starting |= more


def _marked_e2e(tree: ast.Module, node: ast.FunctionDef) -> bool:
    module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "e2e" in ast.unparse(n.value) for n in tree.body)
    return module_mark or any("e2e" in ast.unparse(d) for d in node.decorator_list)


def test_every_test_that_starts_a_process_is_marked_e2e():
    """`make test-fast` (-m "not e2e") stays in process, so it stays fast."""
    files = _test_files()
    starting = _starting_functions(files)
    unmarked = [f"{name}::{node.name}" for name, tree in files.items() for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
                and (name, node.name) in starting and not _marked_e2e(tree, node)]
    unmarked = [t for t in unmarked if t not in IN_PROCESS_ALTHOUGH]
    assert not unmarked, "these start processes: mark them @pytest.mark.e2e (or say why not):\n" + "\n".join(unmarked)
    stale = [t for t in IN_PROCESS_ALTHOUGH if t.split("::")[0] not in files or t.split("::")[1] not in {
        n.name for n in files[t.split("::")[0]].body if isinstance(n, ast.FunctionDef)}]
    assert not stale, f"IN_PROCESS_ALTHOUGH names tests that are gone: {stale}"


def test_every_test_module_opens_with_its_subject():
    """A module introduced by the issue that added it ("Issue 35 item 2: ...") says when, not what:
    the docstring's first words name the subject; the issue belongs in the history."""
    opening = re.compile(r"^\W*(issue\b|#\d)", re.I)
    bad = [name for name, tree in _test_files().items()
           if opening.match((ast.get_docstring(tree) or "").lstrip())]
    assert not bad, f"these test modules open with an issue number, not their subject: {bad}"


CONFLICT_MARKERS = ("<<<<<<< ", "=======\n", ">>>>>>> ")


def test_no_merge_conflict_markers_in_the_sources():
    """A merge's leftover markers once landed in the README unnoticed (its layout block is code)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "runs", "node_modules")]
        for name in files:
            if not name.endswith((".py", ".md", ".yaml", ".toml", ".txt", ".sh", ".in", ".cfg")) and name != "Makefile":
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                found += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1)
                          if line.startswith(CONFLICT_MARKERS) and (line != "=======\n" or name.endswith(".py"))]
    assert not found, f"merge conflict markers: {found}"


# ---- Names tools skip, and the old name of launch/ -------------------------------------------------
def test_no_package_folder_has_a_name_that_tools_skip():
    """ruff, black and pytest skip folders named dist or build by default: none of ours is one."""
    skipped = {"dist", "build"}
    found = [os.path.relpath(os.path.join(d, n), ROOT) for d, dirs, _ in os.walk(os.path.join(ROOT, "distribuuuu")) for n in dirs if n in skipped]
    assert not found, f"package folders that linters and pytest skip by default: {found}"


def test_the_old_dist_names_still_import_for_one_release():
    import importlib
    import sys
    import warnings

    from distribuuuu.launch import comm, launcher, signals

    saved = {k: v for k, v in sys.modules.items() if k == "distribuuuu.dist" or k.startswith("distribuuuu.dist.")}
    for k in saved:
        del sys.modules[k]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = importlib.import_module("distribuuuu.dist")
            old_signals = importlib.import_module("distribuuuu.dist.signals")
        assert any("distribuuuu.dist is now distribuuuu.launch" in str(w.message) for w in caught)
        assert old_signals.Preempted is signals.Preempted  # what `except Preempted` in user code names
        assert old.launch.detect is launcher.detect and old.comm is comm
    finally:
        for k in [k for k in sys.modules if k == "distribuuuu.dist" or k.startswith("distribuuuu.dist.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# ---- docs/reading-guide.md: what a traced default run executes (scripts/trace_run.py) --------------
_spec = importlib.util.spec_from_file_location("trace_run", os.path.join(ROOT, "scripts", "trace_run.py"))
trace_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_run)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One traced default 2-rank torchrun run (about a minute on 2 cores): what each process entered."""
    return trace_run.trace(str(tmp_path_factory.mktemp("trace")))


@pytest.mark.e2e
def test_the_reading_guide_is_what_the_trace_of_a_default_run_writes(traced: list[dict]):
    with open(trace_run.GUIDE) as f:
        written = f.read()
    traced_guide = trace_run.render(traced)
    assert written == traced_guide, "docs/reading-guide.md is out of date (`make guide` rewrites it):\n" + "".join(
        difflib.unified_diff(written.splitlines(True), traced_guide.splitlines(True), "docs/reading-guide.md", "traced"))


@pytest.mark.e2e
def test_a_default_run_executes_no_more_package_code_than_its_bounds(traced: list[dict]):
    """The numbers are what runs, not a hand list: moving code out of a listed function lowers nothing
    unless the run stops entering it."""
    over = []
    for part, (max_lines, max_files, max_tokens) in trace_run.BOUNDS.items():
        lines, files, functions, tokens = trace_run.totals(trace_run.count(traced, part))
        if lines > max_lines or files > max_files or tokens > max_tokens:
            over.append(f"{part}: {lines:,} code lines, {tokens:,} tokens, in {files} files ({functions} "
                        f"functions); the bound is {max_lines:,}, {max_tokens:,} tokens, in {max_files}")
    assert not over, "a default run executes more of the package than its bounds:\n" + "\n".join(over)
