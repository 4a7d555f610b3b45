"""duvm: RAM pooled across a cluster through the kernel swap path."""

__version__ = "0.1.0"

from duvm.store.pool import Pool  # the explicit API (after __version__, which cli imports)

__all__ = ["Pool", "__version__"]
