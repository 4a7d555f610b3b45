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


def may_import(doc: str) -> str | None:
    """A docstring's "May import:" line as one line, without the label and its final full stop
    (None when it has none). The line may wrap: it runs to the next blank line or the
    docstring's end. tools/module_map.py prints it as written."""
    m = re.search(r"^May import: (.+?)(?:\n\s*\n|\Z)", doc, re.MULTILINE | re.DOTALL)
    return " ".join(m.group(1).split()).rstrip(".") if m else None


def layer_rules(src: Path) -> dict[str, set[str] | None]:
    """Layer -> the layers it may import, from each subpackage docstring's "May import:" line
    (None: any layer). Every top-level subpackage is a layer and must have the line; a deeper
    subpackage whose docstring has one is a layer of its own, named by its dotted path below
    the package ("node.daemon"), and one without belongs to the layer around it. The line names
    layers by their module path ("duvm.base, duvm.node.attach")."""
    pkg = src.name
    rules: dict[str, set[str] | None] = {}
    for init in sorted(src.rglob("*/__init__.py")):
        rel = init.parent.relative_to(src).parts
        said = may_import(ast.get_docstring(ast.parse(init.read_text())) or "")
        if len(rel) > 1 and said is None:
            continue
        assert said is not None, f"{init} does not say what it may import"
        name = ".".join(rel)
        if said == "any layer":
            rules[name] = None
        elif said.startswith("nothing"):
            rules[name] = set()
        else:
            rules[name] = {x.strip().removeprefix(f"{pkg}.") for x in said.split(",")}
    return rules


def _within(layer: str, other: str) -> bool:
    """`layer` is `other` or one of its sub-layers."""
    return layer == other or layer.startswith(f"{other}.")


def layer_violations(graph: dict[str, set[str]], rules: dict[str, set[str] | None]) -> list[str]:
    """Each import from one layer into another that the importer's rule does not allow
    (allowing a layer allows its sub-layers), and each sub-layer rule that allows a layer
    outside its parent that its parent's rule does not."""

    def layer(mod: str) -> str | None:
        rest = mod.split(".", 1)[1] if "." in mod else ""
        inside = [k for k in rules if _within(rest, k)]
        return max(inside, key=len) if inside else None

    def allows(allowed: set[str] | None, other: str) -> bool:
        return allowed is None or any(_within(other, a) for a in allowed)

    bad = []
    for sub, allowed in sorted(rules.items()):
        parents = [k for k in rules if k != sub and _within(sub, k)]
        if not parents:
            continue
        parent = max(parents, key=len)
        for other in sorted(allowed) if allowed is not None else ["any layer"]:
            if not _within(other, parent) and not allows(rules[parent], other):
                bad.append(f"{sub} may import {other}, which {parent} may not")
    for mod, deps in sorted(graph.items()):
        own = layer(mod)
        if own is None:
            continue
        allowed = rules[own]
        for dep in sorted(deps):
            other = layer(dep)
            if other is None or other == own or allows(allowed, other):
                continue
            bad.append(f"{mod} imports {dep} ({own} may import {sorted(allowed or ())})")
    return bad
