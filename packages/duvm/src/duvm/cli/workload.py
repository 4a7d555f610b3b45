"""A workload that holds random data, touches it and proves every byte came back intact.

Theory of operation
-------------------
Run inside a memory cgroup whose limit is a fraction of ``--mib``, this process forces the
kernel to swap most of its pages out while it fills them and to swap them back in while it
verifies them, so it exercises the whole swap path.

Memory is one anonymous mapping, filled chunk by chunk with pseudo-random bytes generated from
``(seed, chunk index)``: incompressible, different in every chunk (a page written to the wrong
slot is caught), and reproducible, so the verifier needs no copy. Per chunk it keeps only a
16-byte BLAKE2b digest. Verification re-hashes every chunk (every byte is read back); for a
chunk whose digest differs it regenerates the expected bytes and reports the first bad offset.

The last line on stdout is one JSON object with the result. Exit status: 0 every byte intact,
1 data differs, 2 bad arguments, 3 the memory could not be allocated.
Progress goes to stderr as ``progress PHASE DONE TOTAL`` lines with ``--progress``; with
``--hold`` it prints ``filled`` after filling and waits for a line on stdin before verifying, so
a caller can look at (or act on) the swapped-out state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import random
import sys
import time
from dataclasses import asdict, dataclass, field

EXIT_INTACT, EXIT_CORRUPT, EXIT_USAGE, EXIT_NOMEM = 0, 1, 2, 3
MAX_REPORTED = 10


@dataclass
class Result:
    mib: int
    chunk_bytes: int
    chunks: int
    seed: int
    passes: int
    order: str = "sequential"
    bad_chunks: int = 0
    first_bad: list[dict[str, int]] = field(default_factory=list)
    fill_s: float | None = None
    verify_s: float | None = None
    # the longest one chunk took to fill or verify, and where: an upper bound on how long any
    # of its pages waited for the swap device (a daemon's crash shows up here)
    max_chunk_s: float | None = None
    max_chunk_phase: str | None = None

    @property
    def intact(self) -> bool:
        return self.bad_chunks == 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "intact": self.intact})


def chunk_bytes(seed: int, index: int, size: int) -> bytes:
    """The content of chunk `index`: deterministic, incompressible, unique per chunk."""
    return random.Random(f"duvm-workload:{seed}:{index}").randbytes(size)


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _progress(enabled: bool, phase: str, done: int, total: int) -> None:
    if enabled:
        print(f"progress {phase} {done} {total}", file=sys.stderr, flush=True)


def touch_order(chunks: int, order: str, seed: int, phase: str) -> list[int]:
    """Chunk indices in the order to touch them: ascending, or a permutation drawn from
    (seed, phase), so fill and each verify pass scatter differently and reproducibly."""
    idx = list(range(chunks))
    if order == "random":
        random.Random(f"duvm-workload-order:{seed}:{phase}").shuffle(idx)
    elif order != "sequential":
        raise ValueError(f"order must be 'sequential' or 'random', not {order!r}")
    return idx


class Slowest:
    """The longest time one chunk took, and in which phase."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.phase: str | None = None

    def note(self, phase: str, seconds: float) -> None:
        if seconds > self.seconds:
            self.seconds, self.phase = seconds, phase


def fill(
    view: memoryview,
    seed: int,
    chunk: int,
    progress: bool = False,
    order: str = "sequential",
    slowest: Slowest | None = None,
) -> list[bytes]:
    """Write every chunk of `view` (in `order`); return each chunk's digest, by index."""
    chunks = len(view) // chunk
    step = max(1, chunks // 100)
    digests = [b""] * chunks
    slowest = slowest or Slowest()
    for n, i in enumerate(touch_order(chunks, order, seed, "fill")):
        data = chunk_bytes(seed, i, chunk)
        t = time.perf_counter()
        view[i * chunk : (i + 1) * chunk] = data
        slowest.note("fill", time.perf_counter() - t)
        digests[i] = _digest(data)
        if n % step == 0:
            _progress(progress, "fill", n, chunks)
    _progress(progress, "fill", chunks, chunks)
    return digests


def verify(
    view: memoryview,
    digests: list[bytes],
    seed: int,
    chunk: int,
    phase: str = "verify",
    progress: bool = False,
    order: str = "sequential",
    slowest: Slowest | None = None,
) -> list[dict[str, int]]:
    """Read every byte back; one {"chunk", "offset"} per chunk that differs (first bad byte)."""
    bad = []
    chunks = len(digests)
    step = max(1, chunks // 100)
    slowest = slowest or Slowest()
    for n, i in enumerate(touch_order(chunks, order, seed, phase)):
        want = digests[i]
        with view[i * chunk : (i + 1) * chunk] as part:
            t = time.perf_counter()
            digest = _digest(part)
            slowest.note(phase, time.perf_counter() - t)
            if digest != want:
                expected = chunk_bytes(seed, i, chunk)
                off = next((k for k in range(chunk) if part[k] != expected[k]), 0)
                bad.append({"chunk": i, "offset": i * chunk + off})
        if n % step == 0:
            _progress(progress, phase, n, chunks)
    _progress(progress, phase, chunks, chunks)
    return sorted(bad, key=lambda b: b["chunk"])


def run(
    mib: int,
    chunk_kib: int = 1024,
    seed: int = 1,
    passes: int = 1,
    progress: bool = False,
    hold: bool = False,
    order: str = "sequential",
) -> Result:
    """Fill `mib` MiB, optionally wait for a line on stdin (`hold`), verify `passes` times."""
    size = mib << 20
    chunk = chunk_kib << 10
    res = Result(mib, chunk, size // chunk, seed, passes, order)
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        with memoryview(mem) as view:
            slowest = Slowest()
            t0 = time.perf_counter()
            digests = fill(view, seed, chunk, progress, order, slowest)
            res.fill_s = round(time.perf_counter() - t0, 3)
            if hold:
                # a test or the demo looks at the swapped-out state, then lets us go on
                print("filled", file=sys.stderr, flush=True)
                sys.stdin.readline()
            t0 = time.perf_counter()
            bad: dict[int, dict[str, int]] = {}
            for p in range(passes):
                for b in verify(
                    view, digests, seed, chunk, f"verify{p + 1}", progress, order, slowest
                ):
                    bad.setdefault(b["chunk"], b)
            res.bad_chunks = len(bad)
            res.first_bad = [bad[k] for k in sorted(bad)][:MAX_REPORTED]
            res.verify_s = round(time.perf_counter() - t0, 3)
            res.max_chunk_s, res.max_chunk_phase = round(slowest.seconds, 3), slowest.phase
    finally:
        mem.close()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m duvm.cli.workload", description=__doc__.split("\n")[0]
    )
    p.add_argument("--mib", type=int, required=True, help="MiB of random data to hold")
    p.add_argument("--chunk-kib", type=int, default=1024, help="bytes per digest (KiB)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--passes", type=int, default=1, help="verification passes over all data")
    p.add_argument(
        "--order",
        choices=("sequential", "random"),
        default="sequential",
        help="touch chunks in ascending order, or in a shuffled order per pass "
        "(scattered swap-ins; pair with a small --chunk-kib)",
    )
    p.add_argument("--progress", action="store_true", help="progress lines on stderr")
    p.add_argument(
        "--hold",
        action="store_true",
        help="after filling, print 'filled' on stderr and wait for a line on stdin",
    )
    try:
        a = p.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    if a.mib <= 0 or a.chunk_kib <= 0 or a.passes <= 0 or a.chunk_kib % 4:
        print(
            "workload: --mib, --passes must be positive, --chunk-kib a positive multiple of 4",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if (a.mib << 10) % a.chunk_kib:
        print("workload: --mib must be a whole number of chunks", file=sys.stderr)
        return EXIT_USAGE
    try:
        res = run(a.mib, a.chunk_kib, a.seed, a.passes, a.progress, a.hold, a.order)
    except (MemoryError, OSError) as exc:
        print(f"workload: cannot hold {a.mib} MiB: {exc}", file=sys.stderr)
        return EXIT_NOMEM
    print(res.to_json(), flush=True)
    return EXIT_INTACT if res.intact else EXIT_CORRUPT


if __name__ == "__main__":
    sys.exit(main())
