"""duvm's modules import each other without cycles, and each layer (subpackage) imports only
the layers its docstring's "May import:" line names. Imports inside functions count; imports
under `if TYPE_CHECKING:` do not (tools/import_graph.py)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "duvm"
_spec = importlib.util.spec_from_file_location(
    "import_graph", Path(__file__).resolve().parents[3] / "tools" / "import_graph.py"
)
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)
module_graph, cycles = ig.module_graph, ig.cycles
layer_rules, layer_violations = ig.layer_rules, ig.layer_violations


def test_duvm_has_no_import_cycles() -> None:
    graph = module_graph(SRC)
    assert "duvm.node.daemon.daemon" in graph and "duvm.store.remote_store" in graph[
        "duvm.node.daemon.daemon"
    ] | {m for d in graph["duvm.node.daemon.daemon"] for m in graph[d]}
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


def test_every_module_is_in_a_layer() -> None:
    rules = layer_rules(SRC)
    assert set(rules) == {
        "base",
        "wire",
        "rdma",
        "store",
        "memserver",
        "node",
        "cli",
        "testing",
    } | {
        "node.daemon",
        "node.attach",
        "node.lifecycle",
        "node.doctor",
    }
    loose = sorted(f.name for f in SRC.glob("*.py") if f.name != "__init__.py")
    assert loose == [], f"modules outside a layer: {loose}"
    # a layer split into sub-layers by job keeps no modules of its own beside them
    split = {k.rsplit(".", 1)[0] for k in rules if "." in k}
    loose = sorted(
        str(f.relative_to(SRC))
        for layer in split
        for f in (SRC / layer.replace(".", "/")).glob("*.py")
        if f.name != "__init__.py"
    )
    assert loose == [], f"modules beside their layer's sub-layers: {loose}"


def test_each_layer_imports_only_what_its_docstring_allows() -> None:
    assert layer_violations(module_graph(SRC), layer_rules(SRC)) == []


def test_the_layer_checker_finds_an_upward_import(tmp_path: Path) -> None:
    """Catches a checker that misses an import from a lower layer up into a higher one (how
    the memserver came to import the client's socket tuning)."""
    pkg = tmp_path / "pkg"
    for sub, rule in (("base", "nothing else of pkg"), ("store", "pkg.base"), ("cli", "any layer")):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text(f'"""Layer.\n\nMay import: {rule}.\n"""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "base" / "b.py").write_text("def f():\n    from pkg.store import s\n")
    (pkg / "store" / "s.py").write_text("from pkg.base import b\n")
    (pkg / "cli" / "c.py").write_text("from pkg.store import s\n")
    rules = layer_rules(pkg)
    assert rules == {"base": set(), "store": {"base"}, "cli": None}
    assert layer_violations(module_graph(pkg), rules) == [
        "pkg.base.b imports pkg.store (base may import [])",
        "pkg.base.b imports pkg.store.s (base may import [])",
    ]


def test_the_layer_checker_reads_sub_layers(tmp_path: Path) -> None:
    """Catches a checker that stops at the top-level folders (node/ was one layer until its
    four jobs became sub-layers): a sub-layer is held to its own rule, also against its
    siblings, a folder without a rule belongs to the layer around it, and a sub-layer's rule
    cannot allow more outside its parent than the parent's rule does."""
    pkg = tmp_path / "pkg"
    for sub, rule in (
        ("base", "nothing else of pkg"),
        ("store", "pkg.base"),
        ("node", "pkg.base"),
        ("node/a", "pkg.base"),
        ("node/b", "pkg.base, pkg.node.a"),
        ("node/c", "pkg.base, pkg.store"),
        ("node/a/inner", None),
    ):
        (pkg / sub).mkdir(parents=True)
        said = f"\n\nMay import: {rule}.\n" if rule else ""
        (pkg / sub / "__init__.py").write_text(f'"""Layer.{said}"""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "base" / "u.py").write_text("")
    (pkg / "node" / "a" / "inner" / "m.py").write_text("from pkg.node.b import n\n")
    (pkg / "node" / "b" / "n.py").write_text("from pkg.node.a.inner import m\n")
    (pkg / "node" / "c" / "k.py").write_text("from pkg.base import u\n")
    rules = layer_rules(pkg)
    assert rules == {
        "base": set(),
        "store": {"base"},
        "node": {"base"},
        "node.a": {"base"},
        "node.b": {"base", "node.a"},
        "node.c": {"base", "store"},
    }
    assert layer_violations(module_graph(pkg), rules) == [
        "node.c may import store, which node may not",
        "pkg.node.a.inner.m imports pkg.node.b (node.a may import ['base'])",
        "pkg.node.a.inner.m imports pkg.node.b.n (node.a may import ['base'])",
    ]


MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_one_sitting() -> None:
    """Catches a module growing past what a reader takes in at once (RemoteStore had grown to
    1143 lines holding placement, replicas, three write paths, two read paths, trim and
    health): split it by job instead, as store/remote_*.py are. Compiled modules count too
    (rdma/_verbs.pyx had grown to 753 lines with its C declarations)."""
    long = {
        str(p.relative_to(SRC)): n
        for p in [*SRC.rglob("*.py"), *SRC.rglob("*.pyx")]
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_importing_a_base_module_loads_no_other_layer() -> None:
    """Catches a package root that imports its layers: `import duvm.base.units` loaded 14
    modules (the store, the wire format) because duvm/__init__.py imported the Pool API."""
    code = (
        "import sys, duvm.base.units, duvm; "
        "print(sorted(m for m in sys.modules if m == 'duvm' or m.startswith('duvm.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert ast.literal_eval(out) == ["duvm", "duvm.base", "duvm.base.units"]
    pool = subprocess.run(
        [sys.executable, "-c", "import duvm; print(duvm.Pool.__module__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert pool.strip() == "duvm.store.pool"  # the API is still there, loaded on first use


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return set(ast.literal_eval(out.splitlines()[-1]))


def _after_command(argv: list[str]) -> set[str]:
    return _modules_after(
        "import contextlib, io\n"
        "from duvm import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        f"    cli.main({argv!r})"
    )


def test_starting_one_command_imports_only_that_commands_module() -> None:
    """Catches a `duvm` command line that imports every subcommand's module to start one: the
    supervisor restarts the daemon under memory pressure, and each extra module read from disk
    then delays the kernel's held swap I/O (in the QEMU guest `duvm daemon --help` took 5 s)."""
    from duvm.cli import SUBCOMMANDS

    commands = {name: module for name, (module, _) in SUBCOMMANDS.items()}
    loaded = _after_command(["daemon", "--help"])
    assert {m for m in commands.values() if m in loaded} == {commands["daemon"]}
    assert not any(m.startswith("duvm.memserver.") for m in loaded), sorted(loaded)
    assert _after_command(["--help"]).isdisjoint(commands.values())
    # the whole command line is still there for whoever builds it all (the tests, the docs)
    built = _modules_after("from duvm import cli; cli.build_parser()")
    assert set(commands.values()) <= built


# What the request path must not do (issue 28): reach into asyncio's private machinery, step
# coroutines by hand, or choose behaviour by a class's identity or an event loop's module name
# rather than through a declared interface. The compiled .pyx modules count too.
FORBIDDEN = {
    "_asyncio_future_blocking": "a private asyncio attribute (coroutines stepped by hand)",
    ".send(None)": "a coroutine stepped by hand (run it as a Task)",
    "__module__": "a module-name check (declare the capability instead)",
}


def _forbidden_uses(root: Path) -> list[str]:
    found = []
    for p in sorted([*root.rglob("*.py"), *root.rglob("*.pyx")]):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            found += [f"{p.name}:{n}: {why}" for s, why in FORBIDDEN.items() if s in code]
            if re.search(r"\btype\([^)]*\) is (?!not)(?!int\b)(?!tuple\b)", code):
                found.append(f"{p.name}:{n}: a class-identity check (use isinstance)")
    return found


def test_no_private_asyncio_hand_stepping_or_identity_checks() -> None:
    assert _forbidden_uses(SRC) == []


def test_the_pattern_check_finds_each_pattern(tmp_path: Path) -> None:
    """Catches a check that cannot fail: each pattern planted in a module is found."""
    (tmp_path / "m.py").write_text(
        "if getattr(f, '_asyncio_future_blocking', None):\n"
        "    coro.send(None)\n"
        "uv = type(loop).__module__\n"
        "if type(x) is memoryview:\n"
        "    pass\n"
        "ok = type(k) is int  # a bool is not a key: the exact type is the rule\n"
    )
    assert len(_forbidden_uses(tmp_path)) == 4
