"""gputaskman: what is inside GPU memory, with the provenance of every number."""

__version__ = "0.1.0"
