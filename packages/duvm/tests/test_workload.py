"""The verifying workload: catches any changed byte, reports where, and exits accordingly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from duvm.cli import workload
from hypothesis import given, settings
from hypothesis import strategies as st

CHUNK = 64 << 10


def test_chunks_are_deterministic_and_distinct() -> None:
    a = workload.chunk_bytes(1, 0, CHUNK)
    assert a == workload.chunk_bytes(1, 0, CHUNK)
    assert a != workload.chunk_bytes(1, 1, CHUNK)
    assert a != workload.chunk_bytes(2, 0, CHUNK)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=8 * CHUNK - 1), st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_is_found_at_its_offset(offset: int, xor: int) -> None:
    buf = bytearray(8 * CHUNK)
    view = memoryview(buf)
    digests = workload.fill(view, 7, CHUNK)
    assert workload.verify(view, digests, 7, CHUNK) == []
    buf[offset] ^= xor
    assert workload.verify(view, digests, 7, CHUNK) == [
        {"chunk": offset // CHUNK, "offset": offset}
    ]


def test_swapped_chunks_are_caught() -> None:
    """A page stored in the wrong slot (two chunks exchanged) is corruption too."""
    buf = bytearray(4 * CHUNK)
    view = memoryview(buf)
    digests = workload.fill(view, 3, CHUNK)
    first, second = bytes(buf[:CHUNK]), bytes(buf[CHUNK : 2 * CHUNK])
    buf[:CHUNK], buf[CHUNK : 2 * CHUNK] = second, first
    assert [b["chunk"] for b in workload.verify(view, digests, 3, CHUNK)] == [0, 1]


def test_random_order_touches_every_chunk_scattered_and_catches_corruption() -> None:
    """Catches a random order that skips or repeats chunks (an unverified chunk could hide a
    bad page) or that is not random at all (the harness would test sequential swap-ins only)."""
    fill_order = workload.touch_order(64, "random", 5, "fill")
    verify_order = workload.touch_order(64, "random", 5, "verify1")
    assert sorted(fill_order) == sorted(verify_order) == list(range(64))
    assert fill_order != list(range(64)) and fill_order != verify_order
    assert fill_order == workload.touch_order(64, "random", 5, "fill")  # reproducible
    assert workload.touch_order(5, "sequential", 5, "fill") == [0, 1, 2, 3, 4]
    buf = bytearray(16 * CHUNK)
    view = memoryview(buf)
    digests = workload.fill(view, 9, CHUNK, order="random")
    assert digests == workload.fill(memoryview(bytearray(16 * CHUNK)), 9, CHUNK)  # same bytes
    assert workload.verify(view, digests, 9, CHUNK, order="random") == []
    buf[5 * CHUNK + 3] ^= 1
    buf[2 * CHUNK] ^= 1
    assert workload.verify(view, digests, 9, CHUNK, order="random") == [
        {"chunk": 2, "offset": 2 * CHUNK},
        {"chunk": 5, "offset": 5 * CHUNK + 3},
    ]
    with pytest.raises(ValueError):
        workload.touch_order(4, "backwards", 1, "fill")


def test_cli_prints_json_and_exits_zero() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "duvm.cli.workload",
            "--mib",
            "4",
            "--chunk-kib",
            "256",
            "--passes",
            "2",
            "--progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["intact"] is True and out["bad_chunks"] == 0 and out["chunks"] == 16
    assert "progress verify2 16 16" in res.stderr


def test_hold_waits_for_stdin() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "duvm.cli.workload", "--mib", "2", "--hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    assert proc.stderr.readline().strip() == "filled"
    assert proc.poll() is None
    out, _ = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0 and json.loads(out)["intact"] is True


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--mib", "0"],
        ["--mib", "3", "--chunk-kib", "2048"],
        ["--mib", "x"],
        ["--mib", "1", "--chunk-kib", "6"],
    ],
)
def test_bad_arguments_exit_2(args: list[str]) -> None:
    assert workload.main(args) == workload.EXIT_USAGE
