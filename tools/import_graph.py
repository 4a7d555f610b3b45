"""The import graph of a Python package, read from its source (AST): which of its modules
each module imports, counting imports inside functions (a function-local import hides a cycle
from the interpreter, not from the reader) and not those under `if TYPE_CHECKING:`
(annotations only). Both packages' tests/test_import_graph.py use it: no cycles, and duvm's
layer rules ("May import:" in each subpackage's docstring)."""

from __future__ import annotations

import ast
import re
from pathlib import Path


def module_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file."""
    pkg = src.name
    mods: dict[str, Path] = {}
    for f in src.rglob("*.py"):
        parts = f.relative_to(src.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        tree = ast.parse(f.read_text())
        typing_only = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)
        }
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name and m != pkg}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_rules(src: Path) -> dict[str, set[str] | None]:
    """Layer -> the layers it may import, from each subpackage docstring's "May import:" line
    (None: any layer)."""
    rules: dict[str, set[str] | None] = {}
    for init in sorted(src.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        # the line may wrap: it runs to the next blank line or the docstring's end
        m = re.search(r"^May import: (.+?)(?:\n\s*\n|\Z)", doc, re.MULTILINE | re.DOTALL)
        assert m, f"{init} does not say what it may import"
        said = " ".join(m.group(1).split()).rstrip(".")
        if said == "any layer":
            rules[init.parent.name] = None
        elif said.startswith("nothing"):
            rules[init.parent.name] = set()
        else:
            rules[init.parent.name] = {x.strip().split(".")[-1] for x in said.split(",")}
    return rules


def layer_violations(graph: dict[str, set[str]], rules: dict[str, set[str] | None]) -> list[str]:
    def layer(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in rules else None

    bad = []
    for mod, deps in sorted(graph.items()):
        own = layer(mod)
        if own is None:
            continue
        allowed = rules[own]
        for dep in sorted(deps):
            other = layer(dep)
            if other is None or other == own or allowed is None:
                continue
            if other not in allowed:
                bad.append(f"{mod} imports {dep} ({own} may import {sorted(allowed)})")
    return bad
