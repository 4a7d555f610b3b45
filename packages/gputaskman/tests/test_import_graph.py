"""The non-UI modules never import Textual or Rich (checked in a fresh interpreter), and no two
modules import each other, directly or round a cycle, counting imports inside functions and,
in a second check, those under ``if TYPE_CHECKING:`` (tools/import_graph.py reads the
source)."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

CORE = [
    "gputaskman.base.readings",
    "gputaskman.backends.nvml",
    "gputaskman.sampling.host",
    "gputaskman.intel.procinfo",
    "gputaskman.sampling.collector",
    "gputaskman.render.report",
    "gputaskman.document.reader",
    "gputaskman.serve.server",
    "gputaskman.fixtures.demo",
    "gputaskman.fleet.poller",
    "gputaskman.fleet.view",
    "gputaskman.cli",
]
UI = ("textual", "rich")


def imported_after(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_ui_library(module):
    loaded = imported_after([module])
    assert module in loaded
    ui = sorted(m for m in loaded if m.split(".")[0] in UI)
    assert ui == [], f"{module} pulls in {ui[:5]}"


def test_nvml_binding_is_imported_lazily():
    loaded = imported_after(["gputaskman.backends.nvml", "gputaskman.sampling.collector"])
    assert "pynvml" not in loaded


def test_the_checker_sees_ui_imports():
    loaded = imported_after(["gputaskman.tui.app"])
    assert "textual" in loaded  # so an empty result above means something


_spec = importlib.util.spec_from_file_location(
    "import_graph", Path(__file__).resolve().parents[3] / "tools" / "import_graph.py"
)
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)
SRC = Path(__file__).resolve().parents[1] / "src" / "gputaskman"


def test_no_import_cycles() -> None:
    """Catches modules that import each other behind a function-local import (how platforms
    and its backends, plot and summary, replay and its app were tied)."""
    graph = ig.module_graph(SRC)
    assert "gputaskman.sampling.collector" in graph and "gputaskman.backends.win.backend" in graph
    assert ig.cycles(graph) == []


def _type_checking_imports(src: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports under ``if TYPE_CHECKING:``, which
    `ig.module_graph` leaves out (they do not run)."""
    out: dict[str, set[str]] = {}
    for f in src.rglob("*.py"):
        parts = f.relative_to(src.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    found |= {a.name for a in sub.names}
                elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                    found |= {sub.module, *(f"{sub.module}.{a.name}" for a in sub.names)}
        out[name] = found
    mods = set(out)
    return {m: {d for d in deps if d in mods and d not in (m, src.name)} for m, deps in out.items()}


def test_no_import_cycles_counting_type_checking_imports() -> None:
    """Catches two modules that reach into each other both ways with one way behind
    ``if TYPE_CHECKING:`` (issue 32: runtimes and procinfo over ``ModelEvidence``, plot and
    summary over ``Run``). An import for annotations is still a dependency: a type both need
    lives below both (``ModelEvidence`` in evidence), or the consumer declares the Protocol
    it reads (plot's ``ChartRun``). A TYPE_CHECKING import of a module that does not import
    back (cli's of the collector and the TUI, kept lazy for start-up time) is no cycle."""
    typing_only = _type_checking_imports(SRC)
    assert "gputaskman.tui.app" in typing_only["gputaskman.cli"]  # the reader sees them
    graph = ig.module_graph(SRC)
    for mod, deps in typing_only.items():
        graph[mod] |= deps
    assert ig.cycles(graph) == []


def test_every_module_is_in_a_layer() -> None:
    rules = ig.layer_rules(SRC)
    assert set(rules) == {
        "base",
        "backends",
        "intel",
        "sampling",
        "document",
        "render",
        "serve",
        "offline",
        "fleet",
        "tui",
        "fixtures",
        "cli",
    }
    loose = sorted(f.name for f in SRC.glob("*.py") if f.name != "__init__.py")
    assert loose == [], f"modules outside a layer: {loose}"


def test_each_layer_imports_only_what_its_docstring_allows() -> None:
    """Catches an import up the layers (a backend reaching into the collector, the core into
    the TUI); each layer's "May import:" line is the rule."""
    assert ig.layer_violations(ig.module_graph(SRC), ig.layer_rules(SRC)) == []


MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_one_sitting() -> None:
    """Modules stay small enough to read in one sitting (issue 20's rule; report.py and
    diff.py were split into the JSON and text halves to meet it, procinfo.py into the one
    process's scan and the budgeted scanner (procscan.py), gguf.py into the header reader and
    the KV-cache estimate (kvcache.py))."""
    long = {
        str(f.relative_to(SRC)): n
        for f in SRC.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, long


def _new_modules(code: str) -> list[str]:
    """The modules a fresh interpreter loads running `code`, beyond what it loads at start."""
    probe = (
        f"import sys; before = set(sys.modules); {code}; print(sorted(set(sys.modules) - before))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return ast.literal_eval(out)


def test_importing_the_package_root_loads_nothing_else() -> None:
    """Catches a package root that imports its layers or a library: every ``gputaskman.X``
    import runs ``gputaskman/__init__.py`` first, so whatever it loads every command, test
    and tool pays for (``python -X importtime -c "import gputaskman"`` shows one module)."""
    assert _new_modules("import gputaskman") == ["gputaskman"]


def test_importing_a_base_module_loads_no_other_layer() -> None:
    """Catches a `base` module (what every layer shares) reaching into another layer."""
    new = _new_modules("import gputaskman.base.readings")
    loaded = [m for m in new if m.startswith("gputaskman.")]
    assert loaded and all(m.startswith("gputaskman.base") for m in loaded), loaded
