"""Cost of reading one snapshot document, in a tight loop over the lines of tests/recordings
(the demo and a DRM fixture tree: synthetic GPU numbers, real documents of 14-17 KB).

Paths, each timed per document, median of `--passes` passes of `--seconds` each:

* ``bytes, typed``: `document.read_document(body)`, what the fleet reader does (msgspec
  decodes into the `docshape` Structs, the objects are built from them);
* ``bytes, reference``: ``json.loads`` then `docfields.read_parsed`, the reader over the
  parsed object (what the fleet did before the typed path, and the typed path's fallback);
* ``dict, typed`` / ``dict, reference``: the same from an already parsed object (record
  files, replay, summary), through ``msgspec.convert`` or not;
* ``decode only``: msgspec into the Structs, and ``json.loads``, for scale.

Run: ``uv run python benchmarks/gtm_doc_read.py [--passes 5] [--seconds 0.5]``.
Numbers depend on the machine and on what else runs; report them with that caveat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputaskman.document.docfields import read_parsed
from gputaskman.document.docshape import DOC_DECODER
from gputaskman.document.jsonfields import parse_json
from gputaskman.document.reader import read_document

RECORDINGS = Path(__file__).resolve().parents[1] / "packages/gputaskman/tests/recordings"


def _lines() -> list[bytes]:
    out = []
    for path in sorted(RECORDINGS.glob("*.jsonl")):
        out += [line for line in path.read_bytes().splitlines() if line.strip()]
    return out


def _per_doc(read: Callable[[Any], object], inputs: list[Any], seconds: float) -> float:
    """Microseconds per document over whole rounds of `inputs` for about `seconds`."""
    n, start = 0, time.perf_counter()
    while True:
        for x in inputs:
            read(x)
        n += len(inputs)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5, help="per path and pass")
    args = p.parse_args(argv)
    bodies = _lines()
    dicts = [parse_json(b) for b in bodies]
    paths: dict[str, tuple[Callable[[Any], object], list[Any]]] = {
        "bytes, typed (read_document)": (read_document, bodies),
        "bytes, reference (json.loads + read_parsed)": (
            lambda b: read_parsed(parse_json(b)),
            bodies,
        ),
        "dict, typed (msgspec.convert)": (read_document, dicts),
        "dict, reference (read_parsed)": (read_parsed, dicts),
        "decode only, msgspec Structs": (DOC_DECODER.decode, bodies),
        "decode only, json.loads": (parse_json, bodies),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.passes):  # interleaved, so drift in the machine's load hits all
        for name, (read, inputs) in paths.items():
            times[name].append(_per_doc(read, inputs, args.seconds))
    size = statistics.mean(map(len, bodies))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{len(bodies)} documents, {size / 1000:.1f} KB on average; load average {load}")
    for name, got in times.items():
        spread = f"passes {min(got):.1f}-{max(got):.1f}"
        print(f"{name:45} {statistics.median(got):7.1f} us/doc  ({spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
