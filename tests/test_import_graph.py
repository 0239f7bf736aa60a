"""The package's import graph: no cycles, and no private names imported across files.

Every module of `moeserve` is parsed with `ast` (nothing is imported). Each `import moeserve.x` and
`from moeserve.x import y` anywhere in a file -- at the top, inside functions, under `if TYPE_CHECKING` --
is an edge to `moeserve.x`, or to `moeserve.x.y` when `y` is itself a module. An edge goes to the named
module only, not to the packages above it (Python runs their `__init__` first, but a package's
`__init__` re-exporting its submodules is not a design cycle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moeserve

PACKAGE = "moeserve"
ROOT = Path(moeserve.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve_from(name: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str | None:
    """The absolute module a `from ... import` statement in module `name` names (None when outside)."""
    if node.level == 0:
        return node.module
    base = name.split(".")
    if not _is_package(name, modules):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, modules: dict[str, Path]):
    """Yield (target module, imported name or None, line) for every in-package import in module `name`."""
    tree = ast.parse(modules[name].read_text(), filename=str(modules[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    target = alias.name
                    while target not in modules:  # `import moeserve.a.b` names a module; be lenient
                        target = target.rsplit(".", 1)[0]
                    yield target, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(name, node, modules)
            if source is None or not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    yield submodule, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name in modules:
        for target, _, _ in _imports(name, modules):
            graph[name].add(target)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in no particular order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_no_import_cycles():
    modules = _modules()
    graph = _graph(modules)
    problems = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            members = set(component)
            edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in members)
            problems.append("cycle among " + ", ".join(component) + ":\n      " + "\n      ".join(edges))
        elif component[0] in graph[component[0]]:
            problems.append(f"{component[0]} imports itself")
    assert not problems, "import cycles in moeserve:\n  " + "\n  ".join(problems)


def test_no_private_names_across_files():
    modules = _modules()
    problems = []
    for name, path in modules.items():
        for target, imported, line in _imports(name, modules):
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                if target != name:
                    problems.append(f"{path.relative_to(ROOT.parent)}:{line}: from {target} import {imported}")
    assert not problems, "private names imported across files:\n  " + "\n  ".join(problems)


def test_scripts_and_tests_use_public_names():
    """bench/ and tests/ drive the package from outside: they get its public names only."""
    problems = []
    for path in sorted([*(ROOT.parent / "bench").glob("*.py"), *(ROOT.parent / "tests").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
                problems += [f"{path.relative_to(ROOT.parent)}:{node.lineno}: from {node.module} import {a.name}"
                             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not problems, "private names imported from moeserve:\n  " + "\n  ".join(problems)


def test_graph_sees_function_level_and_submodule_imports():
    """Sanity checks on the walker itself, so a passing test means something."""
    modules = _modules()
    graph = _graph(modules)
    assert "moeserve.loader" in graph["moeserve"]  # `load_model` imports it inside the function
    assert len(modules) > 50 and sum(len(v) for v in graph.values()) > 100


def test_model_never_imports_engine_or_quant():
    """DESIGN.md: the model is written once and knows nothing of how it is driven, nor of how a checkpoint stores
    its weights (the loader swaps in MXFP4 or low-bit expert backends before it reads them)."""
    modules = _modules()
    graph = _graph(modules)
    upward = sorted(f"{a} -> {b}" for a in graph if a.startswith("moeserve.model")
                    for b in graph[a] if b.startswith(("moeserve.engine", "moeserve.plan", "moeserve.serve",
                                                       "moeserve.quant")))
    assert not upward, "the model imports the engine or quant:\n  " + "\n  ".join(upward)


OPTIONAL = ("triton", "moeserve.kernels.triton", "matplotlib", "fastapi", "uvicorn", "prometheus_client")
DEFERRED = re.compile(r"^#.*\bimport(s|ed)?\b.*\binside\b", re.MULTILINE)  # a module-level comment saying why


def test_imports_inside_functions_say_why():
    """An import inside a function hides an edge of the graph: it is for an optional dependency, or it says why
    (a comment on its line, or a module-level comment about the imports inside this module's functions)."""
    problems = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.splitlines()
        explained_here = DEFERRED.search(text) is not None
        for fn in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    targets = [node.module or ""]
                else:
                    continue
                if all(any(t == o or t.startswith(o + ".") for o in OPTIONAL) for t in targets):
                    continue
                if "#" not in lines[node.lineno - 1] and not explained_here:
                    problems.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: import {', '.join(targets)}")
    assert not problems, "imports inside functions without a reason:\n  " + "\n  ".join(problems)
