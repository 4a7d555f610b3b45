"""duvm: RAM pooled across a cluster through the kernel swap path."""

__version__ = "0.1.0"
