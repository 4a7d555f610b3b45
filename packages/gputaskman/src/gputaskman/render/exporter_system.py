"""The series `serve` exports from the host sample: RAM, swap and each swap device, CPU (all
measured by the OS) and the duvm pool (reported by its daemons and memservers: runtime).
`fleet.promseries` reads them back by the same names.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from gputaskman.base.frozen import fields_of
from gputaskman.base.readings import Kind
from gputaskman.render.exporter_families import Families
from gputaskman.sampling.host import SystemInfo

# the host sample's numbers `system_families` exports, by the system object's section: the
# series ``gputaskman_system_<section>_<name>_bytes`` (and ``gputaskman_system_cpu_percent``)
SYSTEM_MEMORY = ("total", "available", "used", "cached")
SYSTEM_SWAP = ("total", "used")


def system_families(system: SystemInfo) -> Iterator[Metric]:
    """RAM, swap devices, CPU (OS-measured) and the duvm pool (runtime) of the host sample."""
    f = Families()
    m, s, c = system.memory, system.swap, system.cpu
    memory, swap = fields_of(m), fields_of(s)
    for name in SYSTEM_MEMORY:
        r = memory[f"{name}_bytes"]
        f.reading(f"gputaskman_system_memory_{name}", "bytes", f"System RAM {name}", (), (), r)
    for name in SYSTEM_SWAP:
        r = swap[f"{name}_bytes"]
        f.reading(f"gputaskman_system_swap_{name}", "bytes", f"Swap {name}", (), (), r)
    f.reading("gputaskman_system_cpu", "percent", "CPU busy, all CPUs", (), (), c.percent)
    for d in s.devices or ():
        lv = (d.filename, d.type)
        if d.size_bytes is not None:
            f.add(
                "gputaskman_system_swap_device_size_bytes",
                "Swap device size",
                ("device", "type"),
                lv,
                d.size_bytes,
            )
        if d.used_bytes is not None:
            f.add(
                "gputaskman_system_swap_device_used_bytes",
                "Swap device used",
                ("device", "type"),
                lv,
                d.used_bytes,
            )
    pool = system.duvm
    if pool is not None:
        for d in pool.daemons:
            f.add(
                "gputaskman_duvm_pool_health",
                "duvm pool health from the daemon (1 on the current state)",
                ("socket", "state"),
                (d.socket, d.health),
                1,
                Kind.RUNTIME,
            )
            for p in d.peers:
                f.reading(
                    "gputaskman_duvm_peer_pages",
                    "bytes",
                    "This node's pages held by a duvm peer",
                    ("socket", "peer"),
                    (d.socket, p.peer),
                    p.pages,
                    4096,
                )
        for ln in pool.lending:
            f.reading(
                "gputaskman_duvm_lent",
                "bytes",
                "RAM this node's memserver holds for clients",
                ("socket",),
                (ln.socket,),
                ln.used_bytes,
            )
            f.reading(
                "gputaskman_duvm_lend_capacity",
                "bytes",
                "This node's memserver capacity",
                ("socket",),
                (ln.socket,),
                ln.capacity_bytes,
            )
            for b in ln.borrowers:
                f.reading(
                    "gputaskman_duvm_lent_to",
                    "bytes",
                    "RAM lent to one client",
                    ("socket", "client_id"),
                    (ln.socket, b.client_id),
                    b.stored_bytes,
                )
    yield from f.fams.values()
