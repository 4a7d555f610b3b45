"""Writes docs/MODULES.md, the one module map of both packages, from their docstrings: per
package, per folder (each layer, then the sub-packages inside it) the first paragraph of its
``__init__.py`` docstring and its "May import:" line (read by tools/import_graph.py, which the
layer tests use), then one line per module (``*.py`` and the compiled twins' ``*.pyx``; not
the generated ``.c`` or the built ``.so``) with the first sentence of its docstring. Layers come
lowest first (by what their "May import:" lines allow, then by name); folders and modules in
each by name. Nothing in the page depends on the time or the machine, so a stale page is a
difference in the file, which packages/duvm/tests/test_module_map.py fails on.

A module or folder without a docstring, or a layer that does not say what it may import, is an
error naming it: the map has no holes.

    uv run python tools/module_map.py --write  # write docs/MODULES.md
    uv run python tools/module_map.py --check  # exit 1, naming what differs, if it is stale
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "MODULES.md"
PACKAGES = [
    ROOT / "packages" / "duvm" / "src" / "duvm",
    ROOT / "packages" / "gputaskman" / "src" / "gputaskman",
]
COMMAND = "uv run python tools/module_map.py --write"

_spec = importlib.util.spec_from_file_location(
    "import_graph", Path(__file__).with_name("import_graph.py")
)
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)


class MapError(Exception):
    """What keeps the map from being written: each entry names a file and what it lacks."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def docstring(path: Path) -> str | None:
    """The docstring of a ``.py`` module (from its AST) or of a ``.pyx`` one (its first token
    after comments, when that is a string: Cython is not Python, but its opening string is)."""
    text = path.read_text()
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(text))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in skip:
                continue
            if tok.type == tokenize.STRING:
                value = ast.literal_eval(tok.string)
                if isinstance(value, str):
                    return inspect.cleandoc(value)
            return None
    except (tokenize.TokenError, SyntaxError, ValueError):
        return None
    return None


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


_ABBREVIATIONS = ("e.g", "i.e", "etc", "vs", "cf")


def first_sentence(doc: str) -> str:
    """The first paragraph up to its first full stop that ends a sentence: one followed by a
    space or the paragraph's end, outside code spans (`x.y`, ``a. b``) and parentheses, and
    not ending an abbreviation (e.g., i.e.)."""
    text = first_paragraph(doc)
    code = 0  # the length of the backtick run that opened the code span we are in
    depth = 0
    i = 0
    while i < len(text):
        c = text[i]
        if c == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            if not code:
                code = run
            elif run == code:
                code = 0
            i += run
            continue
        if not code:
            if c in "([":
                depth += 1
            elif c in ")]" and depth:
                depth -= 1
            elif (
                c == "."
                and not depth
                and (i + 1 == len(text) or text[i + 1] == " ")
                and not text[:i].lower().endswith(_ABBREVIATIONS)
            ):
                return text[: i + 1]
        i += 1
    return text


def _modules(folder: Path) -> list[Path]:
    files = [*folder.glob("*.py"), *folder.glob("*.pyx")]
    return sorted(f for f in files if f.name != "__init__.py")


def _folders(folder: Path) -> list[Path]:
    """Sub-packages at any depth below `folder`, by path."""
    return sorted(p.parent for p in folder.rglob("*/__init__.py") if "__pycache__" not in p.parts)


def _layer_order(src: Path) -> list[str]:
    """The top-level layers lowest first: one that may import nothing, then those that import
    only what is above them in the list, and those that may import any layer last; ties by
    name. (A sub-package with a "May import:" line of its own is listed inside its layer.)"""
    rules = {k: v for k, v in ig.layer_rules(src).items() if "." not in k}
    rank: dict[str, int] = {}

    def of(layer: str, seen: frozenset[str] = frozenset()) -> int:
        if layer not in rank:
            allowed = rules[layer]
            if allowed is None:
                rank[layer] = len(rules) + 1
            else:
                tops = {d.split(".")[0] for d in allowed} - seen - {layer}
                deps = [d for d in sorted(tops) if d in rules]
                rank[layer] = 1 + max((of(d, seen | {layer}) for d in deps), default=-1)
        return rank[layer]

    return sorted(rules, key=lambda layer: (of(layer), layer))


def _check(src: Path, root: Path) -> list[str]:
    problems = []
    files = sorted(
        f for f in [*src.rglob("*.py"), *src.rglob("*.pyx")] if "__pycache__" not in f.parts
    )
    for folder in sorted({f.parent for f in files}):
        if not (folder / "__init__.py").exists():
            problems.append(f"{folder.relative_to(root).as_posix()}/ has no __init__.py")
    for f in files:
        where = f.relative_to(root).as_posix()
        if not (f.parent / "__init__.py").exists():
            continue
        try:
            doc = docstring(f)
        except SyntaxError as e:
            problems.append(f"{where} does not parse (line {e.lineno})")
            continue
        if not doc or not first_paragraph(doc):
            problems.append(f"{where} has no docstring")
        elif f.name == "__init__.py" and f.parent.parent == src and ig.may_import(doc) is None:
            problems.append(f"{where} does not say what it may import")
    return problems


def _folder_lines(folder: Path, src: Path) -> list[str]:
    doc = docstring(folder / "__init__.py") or ""
    rel = folder.relative_to(src).as_posix()
    said = ig.may_import(doc)
    if said is None:  # a nested folder (a top-level one without the line is an error)
        up = folder.parent
        while up != src and ig.may_import(docstring(up / "__init__.py") or "") is None:
            up = up.parent
        said = f"as `{up.relative_to(src).as_posix()}/`, the layer it is in"
    lines = ["", f"### `{rel}/`", "", first_paragraph(doc), "", f"May import: {said}."]
    modules = [f"- `{f.name}`: {first_sentence(docstring(f) or '')}" for f in _modules(folder)]
    return [*lines, "", *modules] if modules else lines


def render(packages: list[Path] = PACKAGES, root: Path = ROOT) -> str:
    """The page, or `MapError` naming every file that leaves a hole in it."""
    problems = [p for src in packages for p in _check(src, root)]
    if problems:
        raise MapError(problems)
    lines = [
        "# Module map",
        "",
        "<!-- Generated by tools/module_map.py from the docstrings; do not edit by hand. -->",
        "",
        "Every folder of both packages with the first paragraph of its `__init__.py` docstring",
        'and its "May import:" line, and every module with the first sentence of its docstring',
        "(compiled twins `*.pyx` included). Layers come lowest first; a layer imports only what",
        'its "May import:" line names (each package\'s `tests/test_import_graph.py`). To change',
        f"a line, change the docstring and run `{COMMAND}`;",
        "`packages/duvm/tests/test_module_map.py` fails while this page is stale.",
    ]
    for src in packages:
        lines += [
            "",
            f"## {src.name} (`{src.relative_to(root).as_posix()}`)",
            "",
            first_paragraph(docstring(src / "__init__.py") or ""),
        ]
        loose = _modules(src)
        if loose:
            lines.append("")
            lines += [f"- `{f.name}`: {first_sentence(docstring(f) or '')}" for f in loose]
        for layer in _layer_order(src):
            for folder in [src / layer, *_folders(src / layer)]:
                lines += _folder_lines(folder, src)
    return "\n".join(lines) + "\n"


def _labels(text: str) -> list[str]:
    """Each line of a page named by what it describes: ``duvm/node/daemon.py``, ``duvm/node/``
    for a folder's own lines, the page's heading otherwise."""
    labels = []
    package, folder = "", ""
    for line in text.splitlines():
        if m := re.match(r"## (\S+)", line):
            package, folder = m.group(1), ""
        elif m := re.match(r"### `(.+?)`", line):
            folder = m.group(1)
        m = re.match(r"- `(.+?)`", line)
        where = "/".join(x.strip("/") for x in (package, folder) if x)
        labels.append(f"{where}/{m.group(1)}" if m else (f"{where}/" if package else "heading"))
    return labels


def differences(old: str, new: str) -> list[str]:
    """What differs between two pages, named by module or folder, in page order, each once."""
    a, b = old.splitlines(), new.splitlines()
    la, lb = _labels(old), _labels(new)
    named: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            for name in [*la[i1:i2], *lb[j1:j2]]:
                if name not in named:
                    named.append(name)
    return named


def stale_message(old: str | None, new: str, out: Path = OUT, root: Path = ROOT) -> str | None:
    """One line saying how `out` differs from `new` (None when it does not)."""
    rel = out.relative_to(root).as_posix() if out.is_relative_to(root) else str(out)
    if old is None:
        return f"{rel} does not exist: run {COMMAND}"
    if old == new:
        return None
    names = differences(old, new)
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"{rel} is stale ({shown or 'whitespace'}): run {COMMAND}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    mode.add_argument("--write", action="store_true", help="write the page")
    args = parser.parse_args(argv)
    try:
        new = render()
    except MapError as e:
        print(f"module_map: {e}", file=sys.stderr)
        return 2
    if args.write:
        OUT.write_text(new)
        return 0
    msg = stale_message(OUT.read_text() if OUT.exists() else None, new)
    if msg:
        print(msg, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
