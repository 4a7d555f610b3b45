"""Which request path runs: the compiled hot loop or the pure-Python reference.

Theory of operation: each compiled module (Cython, built by setup.py when the machine has a C
compiler and the headers it needs) sits beside the pure-Python module it accelerates, which
stays the reference and the fallback. `load(name)` returns the compiled module, or None when
the pure path must run:

- DUVM_PURE_PYTHON=1 in the environment chooses the reference on purpose;
- the module was not built (no compiler, no OpenSSL headers), or does not load;
- it was built from an older source than the .pyx beside it (a stale build: its
  SOURCE_DIGEST is not the SHA-256 of the .pyx and of the .pxd beside it, if any: the C
  interface other compiled modules cimport), which would run code nobody reads.

`report()` says which path runs and why, for `duvm doctor` and `duvm status`; `announce()`
logs it once at a daemon's or memserver's start, a warning when the pure path runs for want
of a build, since that costs several times the CPU per request.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ENV = "DUVM_PURE_PYTHON"
# The compiled modules setup.py builds (COMPILED there; a test keeps the two lists equal).
MODULES = (
    "duvm.store._pagecipher",
    "duvm.memserver._hotloop",
    "duvm.wire._nbdcodec",
    "duvm.store._replies",
    "duvm.store._fanout",
    "duvm.store._cryptpath",
    "duvm.store._readpath",
    "duvm.store._sendqueue",
    "duvm.node.daemon._transmission",
    "duvm.store._slabtable",
)
BUILD_FIX = (
    "install a C compiler and the OpenSSL headers (Debian: apt install gcc libssl-dev), then "
    "rebuild duvm (uv sync --reinstall-package duvm)"
)

_loaded: dict[str, tuple[ModuleType | None, str]] = {}
_announced = False


@dataclass(frozen=True, slots=True)
class Report:
    """`path` is "compiled" when every compiled module runs, else "pure"; `why` says why
    not; `modules` maps each module to "compiled" or the reason it is not."""

    path: str
    why: str
    chosen: bool  # the pure path was asked for (DUVM_PURE_PYTHON), not forced by the build
    modules: dict[str, str] = field(default_factory=dict)


def pure_chosen() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


def _stale(module: ModuleType) -> str | None:
    """Why `module` does not match its source, or None (also when no source is beside it)."""
    origin = getattr(module, "__file__", None)
    if origin is None:
        return None
    source = Path(origin).with_name(module.__name__.rsplit(".", 1)[1] + ".pyx")
    pxd = source.with_suffix(".pxd")
    try:
        code = source.read_bytes() + (pxd.read_bytes() if pxd.exists() else b"")
    except OSError:
        return None  # an install without the source: nothing to compare
    digest = hashlib.sha256(code).hexdigest()
    if getattr(module, "SOURCE_DIGEST", None) != digest:
        return f"stale build (older than {source.name}); rebuild: uv sync --reinstall-package duvm"
    return None


def _import(name: str) -> tuple[ModuleType | None, str]:
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        return None, f"not built ({e})"
    except ValueError as e:  # a type it cimports was rebuilt with another layout (Cython)
        return None, f"does not load ({e}); rebuild: uv sync --reinstall-package duvm"
    stale = _stale(module)
    return (None, stale) if stale else (module, "compiled")


def _found(name: str) -> tuple[ModuleType | None, str]:
    if name not in _loaded:
        _loaded[name] = _import(name)
    return _loaded[name]


def load(name: str) -> ModuleType | None:
    """The compiled module `name` when the compiled path runs, else None (see module doc)."""
    return None if pure_chosen() else _found(name)[0]


def state(name: str) -> str:
    """ "compiled" when the compiled module `name` is built, current and loads, else why not
    (whatever DUVM_PURE_PYTHON says)."""
    return _found(name)[1]


def report() -> Report:
    if pure_chosen():
        return Report("pure", f"{ENV} is set: the pure-Python reference path was chosen", True)
    modules = {name: state(name) for name in MODULES}
    missing = {n: why for n, why in modules.items() if why != "compiled"}
    if not missing:
        return Report("compiled", "", False, modules)
    first = next(iter(missing.items()))
    return Report("pure", f"{first[0]}: {first[1]}", False, modules)


def announce(log: logging.Logger) -> Report:
    """Log once per process which path runs: a warning when the build forces the pure path."""
    global _announced
    rep = report()
    if not _announced:
        _announced = True
        if rep.path == "compiled":
            log.info("request path: compiled")
        elif rep.chosen:
            log.info("request path: pure Python (%s)", rep.why)
        else:
            log.warning(
                "request path: pure Python, several times the CPU per request: %s. To build the "
                "compiled path: %s",
                rep.why,
                BUILD_FIX,
            )
    return rep
