"""Long fuzzing run of duvm's network parsers (the CI run is a short, fixed-budget version).

Usage:
  uv run python tools/fuzz_long.py --minutes 10                  # hypothesis, all targets
  uv run --with atheris python tools/fuzz_long.py --atheris --minutes 10   # coverage-guided

The targets are the functions in packages/duvm/tests/test_fuzz_parsers.py (page decoder in
both roles, a memserver connection after a real handshake and without one, the NBD handshake
and transmission decoders). With hypothesis, each target's test runs in rounds of --round
examples until its share of the time is spent; with atheris, each target gets its share as a
libFuzzer run over raw bytes seeded with valid frames. Prints examples run and failures found
per target; exits 1 when any target failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "packages/duvm/tests/test_fuzz_parsers.py"


def _load_harness():
    spec = importlib.util.spec_from_file_location("fuzz_harness", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def run_hypothesis(h, seconds_each: float, round_size: int) -> dict[str, tuple[int, int]]:
    """Each test runs `round_size` examples per call (DUVM_FUZZ_EXAMPLES, read at import),
    with fresh random inputs every call, until its time is spent."""
    tests = {
        "page_decoder_server": lambda: h.test_fuzz_page_decoder("server"),
        "page_decoder_client": lambda: h.test_fuzz_page_decoder("client"),
        "memserver_conn": h.test_fuzz_memserver_connection,
        "nbd_handshake": h.test_fuzz_nbd_handshake,
        "nbd_transmission": h.test_fuzz_nbd_transmission,
    }
    results: dict[str, tuple[int, int]] = {}
    for name, test in tests.items():
        examples = failures = 0
        end = time.monotonic() + seconds_each
        while time.monotonic() < end:
            try:
                test()
            except Exception:  # a real finding: print it (hypothesis shows the input), count it
                failures += 1
                traceback.print_exc()
            examples += round_size
        results[name] = (examples, failures)
        print(f"{name}: {examples} examples, {failures} failures", flush=True)
    return results


def _seeds(h, name: str) -> list[bytes]:
    pp = h.pp
    if name.startswith("nbd_handshake"):
        return [struct.pack(">I", 1) + struct.pack(">QII", 0x49484156454F5054, 7, 4) + bytes(4)]
    if name.startswith("nbd"):
        return [h._nbd_request(c, 0, 4096) for c in (0, 2, 3, 4)]
    msgs = [
        pp.make_store(1, [1, 2], bytes(8192)),
        pp.make_load(2, [1]),
        pp.make_free(3, [2]),
        pp.Reserve(4, 8),
        pp.Release(5),
        pp.Status(6),
        pp.Hello(7, "x"),
        pp.Auth(8, bytes(32)),
    ]
    if name == "page_decoder_client":
        msgs = [
            pp.StoreReply(1),
            pp.LoadReply(2, memoryview(bytes(4096))),
            pp.FreeReply(3, 1),
            pp.ReserveReply(4, 8, 0),
            pp.StatusReply(5, b"{}"),
            pp.ErrorReply(6, pp.MsgType.LOAD, pp.ErrorCode.NOT_FOUND, "x"),
        ]
    return [h.encode_bytes(m) for m in msgs]


def run_atheris(h, seconds_each: float) -> dict[str, tuple[int, int]]:
    import atheris

    results: dict[str, tuple[int, int]] = {}
    for name, target in h.TARGETS.items():
        count = [0]

        def one(data: bytes, target=target, count=count) -> None:
            count[0] += 1
            fdp = atheris.FuzzedDataProvider(data)
            chunk = fdp.ConsumeIntInRange(1, 9000)
            target(fdp.ConsumeBytes(fdp.remaining_bytes()), chunk)

        corpus = tempfile.mkdtemp(prefix=f"duvm-fuzz-{name}-")
        for i, seed in enumerate(_seeds(h, name)):  # valid frames: past the magic from the start
            Path(corpus, f"seed{i}").write_bytes(b"\x10\x00" + seed)  # 2 bytes: the chunk size
        pid = os.fork()  # libFuzzer ends the process; one child per target
        if pid == 0:
            atheris.Setup(
                [
                    sys.argv[0],
                    f"-max_total_time={int(seconds_each)}",
                    "-max_len=20000",
                    "-print_final_stats=1",
                    corpus,
                ],
                one,
            )
            atheris.Fuzz()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        failed = int(os.waitstatus_to_exitcode(status) != 0)
        results[name] = (-1, failed)  # libFuzzer prints its exec count (number_of_executed_units)
        print(f"{name}: atheris exit {'failure' if failed else 'ok'}", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="total time (default 10)")
    ap.add_argument("--round", type=int, default=2000, help="hypothesis examples per round")
    ap.add_argument("--atheris", action="store_true", help="use atheris (coverage-guided)")
    args = ap.parse_args()
    os.environ["DUVM_FUZZ_EXAMPLES"] = str(args.round)
    if args.atheris:
        import atheris

        with atheris.instrument_imports(include=["duvm"]):  # coverage feedback from duvm
            h = _load_harness()
    else:
        h = _load_harness()
    n = len(h.TARGETS) if args.atheris else 5
    each = args.minutes * 60 / n
    start = time.monotonic()
    res = run_atheris(h, each) if args.atheris else run_hypothesis(h, each, args.round)
    took = time.monotonic() - start
    total = sum(e for e, _ in res.values() if e > 0)
    bad = sum(f for _, f in res.values())
    print(
        f"total: {total if total else 'see libFuzzer stats'} examples in {took:.0f}s, "
        f"{bad} target(s) with failures"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
