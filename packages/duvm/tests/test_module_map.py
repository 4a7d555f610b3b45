"""docs/MODULES.md, the module map of both packages, is what tools/module_map.py writes from
the docstrings (each folder's first paragraph and "May import:" line, each module's first
sentence), and the tool refuses to write a map with a hole in it. Both packages are checked
here, beside duvm's layer rules (test_import_graph.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("module_map", ROOT / "tools" / "module_map.py")
mm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mm)


def test_the_module_map_is_the_one_the_docstrings_generate(capsys) -> None:
    """Catches docs/MODULES.md going stale: a module added, moved, removed or redescribed (its
    docstring's first sentence), or a layer's "May import:" line changed, without the page
    written again, and a hand edit of the page (planted: one module's line edited)."""
    rc = mm.main(["--check"])
    assert rc == 0, capsys.readouterr().err.strip()


def _package(root: Path) -> Path:
    src = root / "pkg"
    for layer, rule in (
        ("base", "nothing else of pkg"),
        ("store", "pkg.base"),
        ("cli", "any layer"),
    ):
        (src / layer).mkdir(parents=True)
        (src / layer / "__init__.py").write_text(f'"""The {layer}.\n\nMay import: {rule}.\n"""\n')
    (src / "__init__.py").write_text('"""pkg: a package."""\n')
    (src / "base" / "units.py").write_text('"""Sizes (`x.y` in code. not an end). More."""\n')
    (src / "store" / "ram.py").write_text('"""A store, e.g. this one, in RAM.\n\nDetail."""\n')
    (src / "store" / "_fast.pyx").write_text('# cython: language_level=3\n"""Its twin in C."""\n')
    (src / "store" / "_fast.c").write_text("/* generated */\n")
    (src / "store" / "remote" / "deep").mkdir(parents=True)
    (src / "store" / "remote" / "__init__.py").write_text(
        '"""Remote stores.\n\nMay import: pkg.base.\n"""\n'
    )
    (src / "store" / "remote" / "deep" / "__init__.py").write_text('"""Deeper."""\n')
    (src / "store" / "remote" / "deep" / "d.py").write_text('"""D."""\n')
    (src / "cli" / "sub").mkdir()
    (src / "cli" / "sub" / "__init__.py").write_text('"""Subcommands."""\n')
    (src / "cli" / "sub" / "run.py").write_text('"""``pkg run``: run it."""\n')
    return src


def test_the_map_lists_every_folder_and_module_lowest_layer_first(tmp_path: Path) -> None:
    """Catches a map that drops the compiled twins or nested folders, lists the generated C,
    cuts a first sentence at a full stop inside code or an abbreviation, or orders the
    layers by name instead of by what they may import."""
    page = mm.render([_package(tmp_path)], tmp_path)
    body = page[page.index("## pkg") :]
    assert body.splitlines() == [
        "## pkg (`pkg`)",
        "",
        "pkg: a package.",
        "",
        "### `base/`",
        "",
        "The base.",
        "",
        "May import: nothing else of pkg.",
        "",
        "- `units.py`: Sizes (`x.y` in code. not an end).",
        "",
        "### `store/`",
        "",
        "The store.",
        "",
        "May import: pkg.base.",
        "",
        "- `_fast.pyx`: Its twin in C.",
        "- `ram.py`: A store, e.g. this one, in RAM.",
        "",
        "### `store/remote/`",
        "",
        "Remote stores.",
        "",
        "May import: pkg.base.",
        "",
        "### `store/remote/deep/`",
        "",
        "Deeper.",
        "",
        "May import: as `store/remote/`, the layer it is in.",
        "",
        "- `d.py`: D.",
        "",
        "### `cli/`",
        "",
        "The cli.",
        "",
        "May import: any layer.",
        "",
        "### `cli/sub/`",
        "",
        "Subcommands.",
        "",
        "May import: as `cli/`, the layer it is in.",
        "",
        "- `run.py`: ``pkg run``: run it.",
    ]
    assert mm.render([_package(tmp_path / "again")], tmp_path / "again") == page


def test_a_module_without_a_docstring_is_reported_by_name(tmp_path: Path) -> None:
    """Catches a map with holes: a module or folder without a docstring, a folder without an
    ``__init__.py``, a layer that does not say what it may import and a module that does not
    parse are each named, and nothing is written."""
    src = _package(tmp_path)
    (src / "store" / "bare.py").write_text("import os\n")
    (src / "store" / "_bare.pyx").write_text("# cython: language_level=3\ncdef int x = 1\n")
    (src / "cli" / "sub" / "__init__.py").write_text("")
    (src / "cli" / "loose").mkdir()
    (src / "cli" / "loose" / "m.py").write_text('"""In no package."""\n')
    (src / "base" / "__init__.py").write_text('"""The base, with no rule."""\n')
    (src / "base" / "broken.py").write_text('"""Half-written."""\ndef f(:\n')
    with pytest.raises(mm.MapError) as e:
        mm.render([src], tmp_path)
    assert e.value.problems == [
        "pkg/cli/loose/ has no __init__.py",
        "pkg/base/__init__.py does not say what it may import",
        "pkg/base/broken.py does not parse (line 2)",
        "pkg/cli/sub/__init__.py has no docstring",
        "pkg/store/_bare.pyx has no docstring",
        "pkg/store/bare.py has no docstring",
    ]


def test_a_stale_map_is_named_by_what_differs(tmp_path: Path) -> None:
    """Catches a check that cannot fail, or fails without saying where: a changed docstring,
    a new module and a removed one are each named in the one-line message."""
    src = _package(tmp_path)
    old = mm.render([src], tmp_path)
    out = tmp_path / "MODULES.md"
    assert mm.stale_message(old, old, out, tmp_path) is None
    (src / "base" / "units.py").write_text('"""Sizes and addresses."""\n')
    (src / "store" / "ram.py").unlink()
    (src / "cli" / "sub" / "new.py").write_text('"""New."""\n')
    msg = mm.stale_message(old, mm.render([src], tmp_path), out, tmp_path)
    assert msg == (
        "MODULES.md is stale (pkg/base/units.py, pkg/store/ram.py, pkg/cli/sub/new.py): "
        "run uv run python tools/module_map.py --write"
    )
    assert mm.stale_message(None, old, out, tmp_path).startswith("MODULES.md does not exist")
