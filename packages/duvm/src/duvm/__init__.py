"""duvm: RAM pooled across a cluster through the kernel swap path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from duvm.store.pool import Pool

__all__ = ["Pool", "__version__"]


def __getattr__(name: str) -> Any:
    # `duvm.Pool`, the explicit API, loads the store on first use: `import duvm.base.units`
    # (and every command that needs no store) stays cheap
    if name == "Pool":
        from duvm.store.pool import Pool

        return Pool
    raise AttributeError(f"module 'duvm' has no attribute {name!r}")
