"""trnrt's own import graph, read from the source (no import runs): every `import` and
`from ... import` of a trnrt module, at module level or inside a function, as edges between modules.

Used by tests/test_architecture.py to prove there is no import circle, and by the graph
fingerprint cache to find the source files a traced graph can depend on (`closure`); pure
standard library.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(root: Path, f: Path) -> str:
    """`root/trnrt/engine/request.py` -> "trnrt.engine.request" (a package's __init__: the package)."""
    parts = list(f.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _nodes(tree: ast.Module, module_level_only: bool, skip_lazy: bool):
    """The nodes to read: all of them; or only those outside def / lambda bodies (what importing
    the module runs); or all but a module-level `__getattr__` (PEP 562 lazy attributes: it runs
    only when someone reads a name the module lacks, as `trnrt.LLM`)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if skip_lazy and isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and node in tree.body:
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str = "trnrt", module_level_only: bool = False,
                 skip_lazy: bool = False) -> dict[str, set[str]]:
    """{module: the trnrt modules it imports}. `from pkg import name` counts as an import of
    `pkg.name` where that is a module, else of `pkg`. module_level_only: leave out the imports
    inside functions; skip_lazy: leave out those of a module-level `__getattr__` (see _nodes)."""
    files = {module_name(root, f): f for f in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        is_pkg = f.name == "__init__.py"
        tree = ast.parse(f.read_text(), str(f))
        for node in _nodes(tree, module_level_only, skip_lazy):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # `import trnrt.x.y` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != mod and t.split(".")[0] == package:
                    graph[mod].add(t)
    return graph


def closure(root: Path, roots: list[str], package: str = "trnrt") -> dict[str, Path]:
    """{module: its file} for `roots` and every trnrt module they can import, inside functions too
    (a function that a traced forward calls imports at trace time), and the packages above each,
    whose __init__ runs first. Lazy module attributes (a module-level `__getattr__`) are not
    followed: `trnrt/__init__.py` loads `trnrt.LLM` that way, and no graph reads it."""
    files = {module_name(root, f): f for f in sorted((root / package).rglob("*.py"))}
    graph = import_graph(root, package, skip_lazy=True)
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        if mod not in files:
            raise KeyError(f"{mod} is not a module of {package}")
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(graph[mod])
    return {m: files[m] for m in sorted(seen)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
