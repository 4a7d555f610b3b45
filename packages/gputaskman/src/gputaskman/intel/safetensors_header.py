"""Bounded safetensors header reader: the tensors a ``.safetensors`` file declares, their
dtypes, shapes and byte counts, read without loading (or mapping) any weights.

Theory of operation
-------------------
A safetensors file (the format's spec, huggingface/safetensors ``README.md`` "Format") is::

    8 bytes   N, an unsigned little-endian 64-bit integer: the header's size
    N bytes   a UTF-8 JSON object: {"<tensor>": {"dtype": "BF16", "shape": [..],
              "data_offsets": [begin, end]}, ..., "__metadata__": {"<str>": "<str>"}}
    rest      the tensors' bytes; offsets are relative to the end of the header

:func:`parse_header` takes the first bytes of a file (the caller reads them: `read_header`
opens the file, reads 8 bytes, then exactly N, never maps it, so gputaskman never shows up as
a process that maps the model) and checks what the file declares before using it, as the
safetensors library does: N at most `MAX_HEADER_BYTES` (the library's own limit), a JSON
object whose entries have the documented shape, at most `MAX_TENSORS` tensors of at most
`MAX_DIMS` dims, offsets that are ordered, contiguous from 0 and inside the file. A file that
breaks any of these is `SafetensorsError` with the reason (untrusted input: never a hang, a
huge allocation or a guess).

Bytes: for a dtype in `DTYPE_BITS`, a tensor's bytes are ``prod(shape) * bits / 8`` and must
equal ``end - begin``; a dtype this reader does not know has *unknown* bytes (None), never a
guess from its offsets, and makes the file's total unknown. The total is a fact about the
file; how many of those bytes a runtime puts in VRAM is an estimate (`llm.build_view`).
Packed quantized weights (GPTQ/AWQ store ``I32`` words; FP4 is sub-byte) are named by their
dtype here; `hfmodel` names the quantization from the model's ``config.json``.

Results are cached by ``(realpath, size, mtime_ns)`` in :func:`read_header_cached`, failures
too, like `gguf.read_header_cached`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from gputaskman.base.filecache import ParsedFiles

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "SafetensorsError",
    "SafetensorsHeader",
    "StTensor",
    "clear_cache",
    "parse_header",
    "read_header",
    "read_header_cached",
]

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
MAX_TENSORS = 1_000_000
MAX_DIMS = 16

# dtype -> bits per element: every variant of safetensors 0.8.0's Dtype enum (its
# deserialiser lists them in its "unknown variant" error) with its bitsize().
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class SafetensorsError(ValueError):
    """The bytes are not a safetensors header this reader accepts; ``str()`` says why."""


@dataclass(frozen=True, slots=True)
class StTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        """Bytes of this tensor's data; None for a dtype this reader does not know."""
        return self.end - self.begin if self.dtype in DTYPE_BITS else None


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """What one safetensors file declares. Unknown values are None, never 0."""

    path: str
    file_size: int | None
    header_bytes: int  # 8 + N
    metadata: Mapping[str, str]
    tensors: tuple[StTensor, ...] = field(repr=False)

    @property
    def weights_bytes(self) -> int | None:
        """Sum of tensor bytes; None if any tensor has a dtype this reader does not know."""
        sizes = [t.nbytes for t in self.tensors]
        if any(s is None for s in sizes):
            return None
        return sum(s for s in sizes if s is not None)

    @property
    def bytes_by_dtype(self) -> dict[str, int | None]:
        """Tensor bytes per dtype; an unknown dtype is listed with None."""
        out: dict[str, int | None] = {}
        for t in self.tensors:
            n = t.nbytes
            if n is None or (t.dtype in out and out[t.dtype] is None):
                out[t.dtype] = None
            else:
                out[t.dtype] = (out.get(t.dtype) or 0) + n
        return out

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors)


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tensor(name: str, entry: Any) -> StTensor:
    if not isinstance(entry, dict):
        raise SafetensorsError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise SafetensorsError(f"tensor {name!r}: no dtype")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(map(_uint, shape)):
        raise SafetensorsError(f"tensor {name!r}: shape is not a list of up to {MAX_DIMS} uints")
    if not (isinstance(offs, list) and len(offs) == 2 and all(map(_uint, offs))):
        raise SafetensorsError(f"tensor {name!r}: data_offsets is not [begin, end]")
    begin, end = offs
    if end < begin:
        raise SafetensorsError(f"tensor {name!r}: data_offsets end before begin")
    t = StTensor(name, dtype, tuple(shape), begin, end)
    bits = DTYPE_BITS.get(dtype)
    if bits is not None:
        nbits = t.n_elements * bits
        if nbits % 8 or nbits // 8 != end - begin:
            raise SafetensorsError(
                f"tensor {name!r}: {dtype} {list(shape)} needs {nbits / 8:g} bytes, "
                f"data_offsets give {end - begin}"
            )
    return t


def parse_header(data: bytes, path: str = "", file_size: int | None = None) -> SafetensorsHeader:
    """Parse a header from the first bytes of a file (at least ``8 + N``; more is ignored).
    ``file_size``, when known, must hold every tensor. Raises `SafetensorsError`."""
    if len(data) < 8:
        raise SafetensorsError(f"truncated: {len(data)} bytes, the length prefix needs 8")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"header of {n} bytes is over the {MAX_HEADER_BYTES} byte cap")
    if len(data) < 8 + n:
        raise SafetensorsError(f"truncated: header of {n} bytes, {len(data) - 8} present")
    raw = bytes(data[8 : 8 + n])
    if not raw.lstrip().startswith(b"{"):
        raise SafetensorsError("not safetensors: the header is not a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsError(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SafetensorsError("header is not a JSON object")
    meta_raw = doc.pop("__metadata__", None)
    if meta_raw is not None and not (
        isinstance(meta_raw, dict) and all(isinstance(v, str) for v in meta_raw.values())
    ):
        raise SafetensorsError("__metadata__ is not an object of strings")
    if len(doc) > MAX_TENSORS:
        raise SafetensorsError(f"declares {len(doc)} tensors, over the cap of {MAX_TENSORS}")
    tensors = sorted((_tensor(k, v) for k, v in doc.items()), key=lambda t: (t.begin, t.end))
    pos = 0
    for t in tensors:
        if t.begin != pos:
            raise SafetensorsError(f"tensor {t.name!r}: data_offsets not contiguous at {pos}")
        pos = t.end
    if file_size is not None and 8 + n + pos > file_size:
        raise SafetensorsError(
            f"truncated: tensors end at byte {8 + n + pos}, the file has {file_size}"
        )
    return SafetensorsHeader(path, file_size, 8 + n, dict(meta_raw or {}), tuple(tensors))


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and parse the header of the safetensors file at ``path`` (8 + N bytes, no map).
    Raises `SafetensorsError` (bad content) or ``OSError`` (cannot open or read)."""
    with open(os.fspath(path), "rb") as f:
        return _read(f, os.fstat(f.fileno()).st_size)


def _read(f: BinaryIO, size: int) -> SafetensorsHeader:
    head = f.read(8)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= MAX_HEADER_BYTES and 8 + n <= size:
            head += f.read(n)
    return parse_header(head, f.name, size)


_headers: ParsedFiles[SafetensorsHeader | SafetensorsError] = ParsedFiles(512)  # failures kept too


def _parse_or_error(f: BinaryIO, size: int) -> SafetensorsHeader | SafetensorsError:
    try:
        return _read(f, size)
    except SafetensorsError as e:
        return e


def read_header_cached(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """:func:`read_header`, cached by (real path, size, mtime); failures are cached too."""
    hit = _headers.get(os.path.realpath(os.fspath(path)), _parse_or_error)
    if isinstance(hit, SafetensorsError):
        raise SafetensorsError(str(hit))
    return hit


def clear_cache() -> None:
    _headers.clear()
