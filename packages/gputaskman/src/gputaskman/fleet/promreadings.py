"""What every reader of `serve`'s series in Prometheus shares: where such a reading says it
came from, and the unknown reading of a series Prometheus does not have (never 0).
"""

from __future__ import annotations

from gputaskman.base.readings import Kind, Reading, Reason

SOURCE = "prometheus"
NO_SERIES = "no series in Prometheus"
NOT_EXPORTED = "not exported to Prometheus"
KINDS = {k.value: k for k in Kind}  # a series' provenance label -> its kind


def absent(name: str) -> Reading:
    """The reading of series `name` when Prometheus has none for it."""
    return Reading.missing(Reason.UNAVAILABLE, f"{SOURCE}:{name}", NO_SERIES)


NOT_EXPORTED_READING = Reading.missing(Reason.UNAVAILABLE, SOURCE, NOT_EXPORTED)
