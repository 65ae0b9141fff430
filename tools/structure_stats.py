"""The package's shape, read with ``ast`` (nothing is imported): import circles between modules and between
sub-packages, inner (function-level) imports, file and class sizes, files per folder.

``python tools/structure_stats.py [PACKAGE_DIR]`` prints the numbers; tests/unit/test_structure.py asserts on them.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Set


@dataclass
class Module:
    name: str
    path: str
    lines: int
    classes: Dict[str, int]  # class name -> lines
    top_imports: Set[str] = field(default_factory=set)  # package modules imported at import time
    inner_imports: Set[str] = field(default_factory=set)  # package modules imported inside functions
    n_top: int = 0  # import statements (any package) at module/class level
    n_inner: int = 0  # import statements inside functions


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """Yield (import node, inside a function) for every import statement outside ``if TYPE_CHECKING:``."""
    def walk(node, inner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inner
            yield from walk(child, inner or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def _targets(node, mod: Module, modules: Set[str], pkg_root: str) -> Set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = mod.name.split(".")
            is_pkg = mod.path.endswith("__init__.py")
            anchor = parts if is_pkg else parts[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = set()
    for n in names:
        while n and n not in modules:  # `import a.b.c` of a name inside a module: the module
            n = n.rpartition(".")[0]
        if n and n.split(".")[0] == pkg_root:
            out.add(n)
    return out


def scan(pkg_dir: str) -> Dict[str, Module]:
    pkg_dir = os.path.abspath(pkg_dir)
    paths = [os.path.join(d, f) for d, _, fs in os.walk(pkg_dir) for f in fs if f.endswith(".py")]
    mods = {}
    trees = {}
    for p in sorted(paths):
        src = open(p, encoding="utf-8").read()
        tree = ast.parse(src, p)
        classes = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        m = Module(_module_name(pkg_dir, p), p, len(src.splitlines()), classes)
        mods[m.name] = m
        trees[m.name] = tree
    names = set(mods)
    root = os.path.basename(pkg_dir)
    for name, m in mods.items():
        for node, inner in _imports(trees[name]):
            tg = _targets(node, m, names, root) - {name}
            if inner:
                m.n_inner += 1
                m.inner_imports |= tg
            else:
                m.n_top += 1
                m.top_imports |= tg
    return mods


def _sccs(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def module_graph(mods: Dict[str, Module], inner: bool = True) -> Dict[str, Set[str]]:
    """Module -> modules it imports (a package's __init__ is its own node; ``inner`` adds function-level ones)."""
    return {n: set(m.top_imports) | (m.inner_imports if inner else set()) for n, m in mods.items()}


def subpackage(name: str, depth: int = 2) -> str:
    return ".".join(name.split(".")[:depth])


def subpackage_graph(mods: Dict[str, Module], inner: bool = True, depth: int = 2) -> Dict[str, Set[str]]:
    """Sub-package (``megatron_rl.X``; a top-level module is its own) -> sub-packages it imports."""
    g: Dict[str, Set[str]] = {}
    for n, targets in module_graph(mods, inner).items():
        a = subpackage(n, depth)
        g.setdefault(a, set()).update(subpackage(t, depth) for t in targets if subpackage(t, depth) != a)
    return g


def module_circles(mods, inner=True) -> List[List[str]]:
    # a package's __init__ re-exporting its own modules is not a circle: drop edges from a package to its children
    g = {n: {t for t in ts if not t.startswith(n + ".")} for n, ts in module_graph(mods, inner).items()}
    return _sccs(g)


def subpackage_circles(mods, inner=True, depth=2) -> List[List[str]]:
    return _sccs(subpackage_graph(mods, inner, depth))


def stats(pkg_dir: str) -> dict:
    mods = scan(pkg_dir)
    n_top = sum(m.n_top for m in mods.values())
    n_inner = sum(m.n_inner for m in mods.values())
    classes = [(lines, f"{n}.{c}") for n, m in mods.items() for c, lines in m.classes.items()]
    folders = Counter(os.path.relpath(os.path.dirname(m.path), os.path.dirname(os.path.abspath(pkg_dir)))
                      for m in mods.values())
    return {
        "files": len(mods),
        "lines": sum(m.lines for m in mods.values()),
        "biggest_file": max((m.lines, n) for n, m in mods.items()),
        "biggest_class": max(classes),
        "files_per_folder": dict(sorted(folders.items())),
        "imports": n_top + n_inner,
        "inner_imports": n_inner,
        "inner_import_pct": round(100.0 * n_inner / max(1, n_top + n_inner), 1),
        "module_circles_import_time": module_circles(mods, inner=False),
        "module_circles_all": module_circles(mods, inner=True),
        "subpackage_circles_import_time": subpackage_circles(mods, inner=False),
        "subpackage_circles_all": subpackage_circles(mods, inner=True),
    }


def main(argv: List[str]) -> int:
    pkg = argv[0] if argv else os.path.join(os.path.dirname(__file__), "..", "megatron_rl")
    for k, v in stats(pkg).items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"    {kk:<40} {vv}")
        elif isinstance(v, list):
            print(f"{k}: {len(v)}")
            for c in v:
                print(f"    {' -> '.join(c)}")
        else:
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
