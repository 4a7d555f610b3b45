"""Cost of the DRM backend's per-refresh work (for the README's cost table).

Measures, as the median of repeated runs:

1. ``scan_clients("/")`` over this machine's real /proc: one ``readlink`` per open descriptor
   of every process (this VM has no DRM device, so no fdinfo is read: this is the floor).
2. ``scan_clients`` + ``attribute`` over a fake tree of N processes with 2 DRM descriptors
   each (amdgpu fdinfo in the kernel's format), i.e. the cost that grows with GPU clients.
3. ``DrmBackend.sample()`` over the demo tree (sysfs reads for two cards plus the scan).

Fake trees live on tmpfs-or-disk under /tmp, so (2) and (3) are upper bounds for real
procfs/sysfs, which are served from memory. Numbers are noisy when other work shares the
CPUs. Run: ``uv run python benchmarks/drm_scan.py [N]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gputaskman.backends.drm import DrmBackend
from gputaskman.backends.drm_clients import attribute, scan_clients
from gputaskman.fixtures.drm_fixtures import (
    AMD_PDEV,
    MIB,
    FakeTree,
    Region,
    amdgpu_fdinfo,
    write_demo_tree,
)


def median_ms(fn: Callable[[], object], repeat: int = 21) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    real = scan_clients("/")
    print(
        f"real /proc scan (this machine, {len(real.clients)} DRM clients): "
        f"{median_ms(lambda: scan_clients('/')):.2f} ms"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tree = FakeTree(Path(tmp))
        tree.card(
            "card0", AMD_PDEV, driver="amdgpu", vendor=0x1002, device=0x7550, render="renderD128"
        )
        for i in range(n):
            text = amdgpu_fdinfo(
                i + 1,
                AMD_PDEV,
                vram=Region(private=MIB, resident=MIB),
                engines_ns={"gfx": 1000 * i},
            )
            tree.process(
                10000 + i,
                f"p{i}",
                {
                    5: ("/dev/dri/renderD128", text),
                    6: ("/dev/dri/renderD128", text),
                    0: ("/dev/null", None),
                },
            )
        ms = median_ms(lambda: attribute(scan_clients(tmp).clients))
        print(
            f"fake tree, {n} processes x 2 DRM fds: scan+attribute {ms:.2f} ms "
            f"({ms / n * 1000:.1f} us per process)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        write_demo_tree(Path(tmp))
        backend = DrmBackend(tmp)
        ms = median_ms(backend.sample)
        print(f"demo tree (2 cards, 5 processes): DrmBackend.sample {ms:.2f} ms")


if __name__ == "__main__":
    main()
