"""duvm's modules import each other without cycles, counting imports inside functions (a
function-local import hides a cycle from the interpreter, not from the reader). Imports under
`if TYPE_CHECKING:` are annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "duvm"


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


def test_duvm_has_no_import_cycles() -> None:
    graph = module_graph(SRC)
    assert "duvm.daemon" in graph and "duvm.remote_store" in graph["duvm.daemon"] | {
        m for d in graph["duvm.daemon"] for m in graph[d]
    }
    assert cycles(graph) == []


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    """Catches a checker that reads only module-level imports (how the auth <-> memclient,
    control <-> supervise <-> resume and remote_store <-> repair cycles stayed hidden)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import x\n")
    (pkg / "c.py").write_text("import pkg.a\nx = 1\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    graph = module_graph(pkg)
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
