"""The workload of tools/gpu_pool_check.py: pageable host memory, some of it moved to a GPU and
back in turns, every byte verified; one pinned buffer that must stay resident; where the GPU
can read pageable memory (HMM), a GPU kernel summing the whole pageable buffer in place.

Run inside a memory cgroup whose limit is a fraction of ``--mib``, so the kernel swaps the
pageable buffer out (to the duvm device gpu_pool_check.py enabled) while it is filled, and
back while it is read. Needs only the standard library; uses PyTorch with CUDA when importable
(``--require-gpu`` makes its absence an error), NumPy when importable (for sums), and the CUDA
driver library (libcuda.so.1, present wherever the NVIDIA driver is) through ctypes for the
GPU kernel: a small PTX text the driver compiles, launched with cuLaunchKernel on a pointer
to the pageable buffer. No other dependency.

What each part is, without PyTorch and CUDA (it says so in its output):

* pageable: one anonymous mapping (``mmap``) instead of a ``torch.empty`` CPU tensor, its chunks
  read and rewritten on the CPU instead of copied to the GPU and back;
* pinned: an ``mmap`` locked with ``mlock(2)`` instead of ``torch.empty(pin_memory=True)``
  (cudaHostAlloc); both must stay resident, which ``/proc/self/pagemap`` shows page by page;
* the GPU kernel: skipped, with the reason.

Content is pseudo-random per chunk from ``(seed, index)``, so verification needs no copy: a
16-byte BLAKE2b digest per chunk, and on a mismatch the expected bytes are made again to name
the first bad offset. stdout carries JSON lines: ``{"event": "ready", ...}`` once filled,
``{"event": "round", ...}`` per round, ``{"event": "result", ...}`` last; ``--hold`` waits
for a line on stdin after ready. Exit status 0 every
byte intact and the pinned buffer resident, 1 otherwise, 3 when memory could not be had.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import random
import struct
import sys
import time
from array import array
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
PRESENT, SWAPPED = 1 << 63, 1 << 62  # /proc/PID/pagemap entry bits
WORD_MASK = (1 << 64) - 1
CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88
ROUND_KEYS = (
    "bytes_verified",
    "bad_chunks",
    "pinned_not_resident_max",
    "pinned_swapped_max",
    "pageable_swapped_max",
    "vm_swap_kb_max",
)

# sum_words(src, count, out): *out += the sum (mod 2^64) of count 64-bit words at src, read
# through generic addresses, so src may be any pointer the GPU can reach (with HMM: malloc'd)
PTX = rb"""
.version 6.4
.target sm_70
.address_size 64

.visible .entry sum_words(
    .param .u64 param_src,
    .param .u64 param_count,
    .param .u64 param_out
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [param_src];
    ld.param.u64 %rd2, [param_count];
    ld.param.u64 %rd3, [param_out];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.s64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd7, 0;
$L_loop:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra $L_done;
    shl.b64 %rd8, %rd4, 3;
    add.s64 %rd9, %rd1, %rd8;
    ld.u64 %rd10, [%rd9];
    add.s64 %rd7, %rd7, %rd10;
    add.s64 %rd4, %rd4, %rd6;
    bra.uni $L_loop;
$L_done:
    atom.add.u64 %rd11, [%rd3], %rd7;
    ret;
}
"""


def emit(**doc: Any) -> None:
    print(json.dumps(doc), flush=True)


def chunk_bytes(seed: int, index: int, size: int) -> bytes:
    return random.Random(f"gpu-pool:{seed}:{index}").randbytes(size)


def digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def view(addr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(addr)).cast("B")


def word_sum(data: bytes) -> int:
    """The sum of `data`'s little-endian 64-bit words, mod 2^64 (as the GPU kernel adds)."""
    try:
        import numpy as np
    except ImportError:
        words = array("Q", data)
        if sys.byteorder != "little":
            words.byteswap()
        return sum(words) & WORD_MASK
    return int(np.frombuffer(data, dtype="<u8").sum(dtype=np.uint64))


def pagemap_counts(addr: int, size: int, fd: int) -> tuple[int, int]:
    """(pages not present, pages swapped out) of [addr, addr+size) in this process."""
    first, pages = addr // PAGE, -(-size // PAGE)
    absent = swapped = 0
    done = 0
    while done < pages:
        n = min(pages - done, 65536)
        raw = os.pread(fd, 8 * n, 8 * (first + done))
        for entry in struct.unpack(f"<{len(raw) // 8}Q", raw):
            absent += not entry & PRESENT
            swapped += bool(entry & SWAPPED)
        done += n
    return absent, swapped


def status_kb(*keys: str) -> dict[str, int | None]:
    out: dict[str, int | None] = dict.fromkeys(keys)
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in out and rest.split() and rest.split()[0].isdigit():
                out[key] = int(rest.split()[0])
    return out


class Torch:
    """PyTorch with CUDA where importable; None otherwise, with the reason."""

    def __init__(self, require: bool) -> None:
        self.torch: Any = None
        self.why: str | None = None
        try:
            import torch
        except ImportError as exc:
            self.why = f"PyTorch is not importable ({exc})"
        else:
            if torch.cuda.is_available():
                self.torch = torch
            else:
                self.why = f"PyTorch {torch.__version__} sees no CUDA device"
        if require and self.torch is None:
            raise SystemExit(f"--require-gpu: {self.why}")


def alloc_pageable(size: int, gpu: Torch) -> tuple[Any, int, str]:
    if gpu.torch is not None:
        t = gpu.torch.empty(size, dtype=gpu.torch.uint8)  # not pinned: pageable
        return t, t.data_ptr(), "torch.empty CPU tensor (pageable)"
    m = private_mapping(size)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m)), "anonymous mmap (no PyTorch/CUDA)"


def alloc_pinned(size: int, gpu: Torch) -> tuple[Any, int, str]:
    if gpu.torch is not None:
        t = gpu.torch.empty(size, dtype=gpu.torch.uint8, pin_memory=True)
        return t, t.data_ptr(), "torch.empty(pin_memory=True) (cudaHostAlloc)"
    m = private_mapping(size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
        raise OSError(ctypes.get_errno(), "mlock of the pinned stand-in failed")
    return m, addr, "mmap + mlock(2), the stand-in for pinned memory (no PyTorch/CUDA)"


def private_mapping(size: int) -> mmap.mmap:
    """Private anonymous memory, as malloc gives for large blocks (Python's mmap.mmap(-1, n)
    alone is shared memory, which swaps through shmem and shows no swap entries)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def first_bad(have: memoryview | bytes, want: bytes) -> int:
    return next((i for i in range(len(want)) if have[i] != want[i]), -1)


class CudaKernel:
    """sum_words on GPU 0 through the CUDA driver API (ctypes), or why it cannot run."""

    def __init__(self) -> None:
        self.why: str | None = None
        try:
            self.cu: Any = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self.why = "no CUDA driver library (libcuda.so.1)"
            return
        try:
            self._check(self.cu.cuInit(0), "cuInit")
            dev = ctypes.c_int()
            self._check(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
            pageable = ctypes.c_int()
            self._check(
                self.cu.cuDeviceGetAttribute(
                    ctypes.byref(pageable), CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, dev
                ),
                "cuDeviceGetAttribute",
            )
            if not pageable.value:
                self.why = "GPU 0 reports pageableMemoryAccess = 0: no HMM (nor ATS) here"
                return
            self.ctx = ctypes.c_void_p()
            self._check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "ctx")
            self._check(self.cu.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
            self.mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.cu.cuModuleLoadData(ctypes.byref(self.mod), PTX + b"\0"), "PTX")
            self._check(
                self.cu.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, b"sum_words"),
                "cuModuleGetFunction",
            )
        except RuntimeError as exc:
            self.why = str(exc)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA driver error {rc}")

    def sum_words(self, addr: int, nbytes: int) -> int:
        out = ctypes.c_uint64()
        self._check(self.cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(8)), "cuMemAlloc")
        try:
            self._check(self.cu.cuMemsetD8_v2(out, ctypes.c_ubyte(0), ctypes.c_size_t(8)), "set")
            src, count = ctypes.c_uint64(addr), ctypes.c_uint64(nbytes // 8)
            params = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in (src, count, out)))
            self._check(
                self.cu.cuLaunchKernel(self.fn, 1024, 1, 1, 256, 1, 1, 0, None, params, None),
                "cuLaunchKernel",
            )
            self._check(self.cu.cuCtxSynchronize(), "the kernel")
            got = ctypes.c_uint64()
            self._check(self.cu.cuMemcpyDtoH_v2(ctypes.byref(got), out, ctypes.c_size_t(8)), "DtoH")
            return got.value
        finally:
            self.cu.cuMemFree_v2(out)


def run(args: argparse.Namespace) -> int:
    gpu = Torch(args.require_gpu)
    chunk, chunks = args.chunk_mib * MIB, args.mib // args.chunk_mib
    size, pinned_size = chunk * chunks, args.pinned_mib * MIB
    try:
        _pinned, pinned_addr, pinned_kind = alloc_pinned(pinned_size, gpu)  # kept alive
        pageable, addr, pageable_kind = alloc_pageable(size, gpu)
    except (OSError, MemoryError, RuntimeError) as exc:
        emit(event="result", error=f"memory could not be had: {exc}")
        return 3
    kernel = CudaKernel()  # before the fill: the sums it checks are taken while filling
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    pinned_view = view(pinned_addr, pinned_size)
    pinned_view[:] = chunk_bytes(args.seed, -1, pinned_size)
    pinned_digest = digest(pinned_view)
    t0 = time.monotonic()
    sums: list[int] = []
    digests = []
    for i in range(chunks):
        data = chunk_bytes(args.seed, i, chunk)
        view(addr + i * chunk, chunk)[:] = data
        digests.append(digest(data))
        if kernel.why is None:
            sums.append(word_sum(data))
    fill_s = time.monotonic() - t0
    res: dict[str, Any] = {
        "pageable_bytes": size,
        "pageable_kind": pageable_kind,
        "pinned_bytes": pinned_size,
        "pinned_kind": pinned_kind,
        "gpu_moves": "run" if gpu.torch is not None else f"skipped: {gpu.why}",
        "rounds": args.rounds,
        "bytes_verified": 0,
        "bad_chunks": 0,
        "first_bad": [],
        "pinned_checks": 0,
        "pinned_not_resident_max": 0,
        "pinned_swapped_max": 0,
        "pinned_intact": True,
        "pageable_swapped_max": 0,
        "vm_swap_kb_max": 0,
        "fill_s": round(fill_s, 2),
    }

    def sample() -> None:
        absent, swapped = pagemap_counts(pinned_addr, pinned_size, pagemap)
        res["pinned_checks"] += 1
        res["pinned_not_resident_max"] = max(res["pinned_not_resident_max"], absent)
        res["pinned_swapped_max"] = max(res["pinned_swapped_max"], swapped)
        res["pageable_swapped_max"] = max(
            res["pageable_swapped_max"], pagemap_counts(addr, size, pagemap)[1]
        )
        res["vm_swap_kb_max"] = max(res["vm_swap_kb_max"], status_kb("VmSwap")["VmSwap"] or 0)

    def bad(i: int, have: memoryview | bytes, where: str, rnd: int) -> None:
        res["bad_chunks"] += 1
        if len(res["first_bad"]) < 10:
            want = chunk_bytes(args.seed, i, chunk)
            res["first_bad"].append(
                {"chunk": i, "offset": first_bad(have, want), "where": where, "round": rnd}
            )

    sample()
    emit(
        event="ready",
        pid=os.getpid(),
        pageable_addr=addr,
        pinned_addr=pinned_addr,
        **{k: res[k] for k in ("pageable_kind", "pinned_kind")},
    )
    if args.hold:  # a caller looks at (or acts on) the filled state first
        sys.stdin.readline()
    for rnd in range(args.rounds):
        order = range(chunks) if rnd % 2 == 0 else range(chunks - 1, -1, -1)
        for n, i in enumerate(order):
            host = view(addr + i * chunk, chunk)
            if digest(host) != digests[i]:  # read back in place: from the pool
                bad(i, host, "host", rnd)
            res["bytes_verified"] += chunk
            if gpu.torch is not None:
                part = pageable[i * chunk : (i + 1) * chunk]
                back = part.to("cuda").to("cpu")
                if digest(view(back.data_ptr(), chunk)) != digests[i]:
                    bad(i, view(back.data_ptr(), chunk), "gpu round trip", rnd)
                res["bytes_verified"] += chunk
                part.copy_(back)  # written again: dirty, so it goes out again
                del back
            else:
                host[:] = bytes(host)  # read and written again on the CPU
            if n % 4 == 0:
                sample()
        if digest(pinned_view) != pinned_digest:
            res["pinned_intact"] = False
        res["bytes_verified"] += pinned_size
        sample()
        emit(event="round", round=rnd, **{k: res[k] for k in ROUND_KEYS})
    if kernel.why is not None:
        res["gpu_kernel"] = f"skipped: {kernel.why}"
    else:
        res["gpu_kernel_bytes"] = size
        try:
            got = kernel.sum_words(addr, size)
        except RuntimeError as exc:
            res["gpu_kernel"] = f"FAIL: {exc}"
        else:
            want = sum(sums) & WORD_MASK
            ok = got == want
            res["gpu_kernel"] = "pass" if ok else f"FAIL: sum {got:#x}, expected {want:#x}"
            res["bad_chunks"] += not ok  # a byte the GPU read differs
    res.update(status_kb("VmLck", "VmPin", "VmRSS"))
    res["seconds"] = round(time.monotonic() - t0, 2)
    res["intact"] = res["bad_chunks"] == 0 and res["pinned_intact"]
    res["pinned_resident"] = res["pinned_not_resident_max"] == 0 and not res["pinned_swapped_max"]
    emit(event="result", **res)
    return 0 if res["intact"] and res["pinned_resident"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=192, help="pageable memory, in MiB")
    p.add_argument("--chunk-mib", type=int, default=8, help="what moves to the GPU at a time")
    p.add_argument("--pinned-mib", type=int, default=16, help="the pinned buffer, in MiB")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--require-gpu", action="store_true", help="fail without PyTorch + CUDA")
    p.add_argument("--hold", action="store_true", help="after ready, wait for a line on stdin")
    args = p.parse_args(argv)
    if args.mib < args.chunk_mib or args.chunk_mib < 1 or args.rounds < 1:
        p.error("need --mib >= --chunk-mib >= 1 and --rounds >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
