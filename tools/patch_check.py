"""Tests that replace a module global of the project's own code (a function or a constant of
`duvm` or `gputaskman`), read from the test files' source (AST). Such a patch couples a test
to a module's private names and hides the seam the code should declare: a parameter with the
real thing as its default. Standing in for the operating system (`os.write`, `sys.platform`)
is not counted: that is how a test reaches a full disk or another platform.

Forms found: `monkeypatch.setattr(mod, "name", v)`, `monkeypatch.setattr("pkg.mod.name", v)`,
`mock.patch("pkg.mod.name")`, `mock.patch.object(mod, "name")` and `mod.name = v`, where `mod`
is bound in the test file to one of the packages' modules (`import pkg.mod as mod`,
`from pkg import mod`, or `mod = importlib.import_module(...)`).
"""

from __future__ import annotations

import ast
from pathlib import Path

PATCHERS = {"setattr", "patch", "object"}  # monkeypatch.setattr, mock.patch, mock.patch.object


def _is_module(package_roots: dict[str, Path], dotted: str) -> bool:
    """Whether `dotted` names a module or package inside one of the packages."""
    head, _, rest = dotted.partition(".")
    root = package_roots.get(head)
    if root is None:
        return False
    path = root.joinpath(*rest.split(".")) if rest else root
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_names(tree: ast.Module, package_roots: dict[str, Path]) -> set[str]:
    """The names a test file binds to the packages' modules."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and _is_module(package_roots, a.name):
                    names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if _is_module(package_roots, f"{node.module}.{a.name}"):
                    names.add(a.asname or a.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr == "import_module":
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _names_package(arg: ast.expr, packages: set[str]) -> bool:
    return (
        isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
        and arg.value.partition(".")[0] in packages
    )


def patches_in(source: str, package_roots: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, what is patched) for each module-global patch in one test file's source."""
    tree = ast.parse(source)
    modules = _module_names(tree, package_roots)
    packages = set(package_roots)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr not in PATCHERS or not node.args:
                continue
            first = node.args[0]
            if isinstance(first, ast.Name) and first.id in modules and len(node.args) > 1:
                name = node.args[1]
                attr = name.value if isinstance(name, ast.Constant) else ast.unparse(name)
                found.append((node.lineno, f"{first.id}.{attr}"))
            elif _names_package(first, packages):
                found.append((node.lineno, first.value))  # type: ignore[attr-defined]
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in modules
                ):
                    found.append((node.lineno, f"{t.value.id}.{t.attr}"))
    return sorted(found)


def module_patches(tests: list[Path], package_roots: dict[str, Path]) -> list[str]:
    """`file:line: name` for each module-global patch in the test files."""
    out: list[str] = []
    for f in tests:
        for line, what in patches_in(f.read_text(), package_roots):
            out.append(f"{f.name}:{line}: {what}")
    return out
