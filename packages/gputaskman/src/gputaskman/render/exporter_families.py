"""What every module of `serve`'s exporter shares: gauge families made on first use, the
provenance rule for names (`metric_name`), info series, and the labels of a GPU and of a
process row.

A value measured by a driver or the OS is exported under its base name; an inferred,
estimated or runtime-reported value under a name carrying its kind, and every sample has a
``provenance`` label with the kind (`exporter` says why). An unknown reading has no series.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from gputaskman.base.readings import Kind, Reading

GPU_LABELS = ("gpu", "pci_bus_id", "uuid", "gpu_name")
PROC_LABELS = ("pid", "name", *GPU_LABELS)


def metric_name(base: str, unit: str, kind: Kind) -> str:
    """``base_unit`` for measured values, ``base_<kind>_unit`` for every other kind."""
    if kind is Kind.MEASURED:
        return f"{base}_{unit}" if unit else base
    return f"{base}_{kind.value}_{unit}" if unit else f"{base}_{kind.value}"


class Families:
    """Gauge families by name, created on first use with the labels they need."""

    def __init__(self) -> None:
        self.fams: dict[str, GaugeMetricFamily] = {}

    def add(
        self,
        name: str,
        doc: str,
        labels: tuple[str, ...],
        values: tuple[str, ...],
        value: float,
        kind: Kind = Kind.MEASURED,
    ) -> None:
        fam = self.fams.get(name)
        if fam is None:
            fam = self.fams[name] = GaugeMetricFamily(name, doc, labels=[*labels, "provenance"])
        fam.add_metric([*values, kind.value], value)

    def reading(
        self,
        base: str,
        unit: str,
        doc: str,
        labels: tuple[str, ...],
        values: tuple[str, ...],
        r: Reading | None,
        scale: float = 1,
    ) -> None:
        """Export `r` under the name of its kind; nothing when unknown."""
        if r is None or r.value is None:
            return
        kind_doc = "" if r.kind is Kind.MEASURED else f" ({r.kind.value}, not measured)"
        self.add(
            metric_name(base, unit, r.kind), doc + kind_doc, labels, values, r.value * scale, r.kind
        )


def info_series(
    f: Families, name: str, doc: str, labels: tuple[str, ...], values: tuple[str, ...]
) -> None:
    """One series of value 1 whose labels are the facts (the Prometheus info convention)."""
    fam = f.fams.get(name)
    if fam is None:
        fam = f.fams[name] = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(values), 1)
