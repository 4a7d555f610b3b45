"""Bounded GGUF header reader, and the weights' sizes that follow from a header (the KV
cache's are `kvcache`'s).

Theory of operation
-------------------
A GGUF file starts with a little header (magic ``GGUF``, version, tensor count, metadata
count), then metadata key/value pairs, then one info record per tensor (name, dims, ggml type,
offset), then the aligned tensor data. Everything gputaskman needs (architecture, name, file
type, parameter count, weights bytes, KV-cache shape) is in the part before the data, so
:func:`read_header` reads only that part, in chunks, from a plain file handle:

* nothing is memory-mapped (a map would make gputaskman itself show up as a process that
  maps the model file), nothing past the tensor infos is read;
* every length the file declares is checked before it is used: strings are capped at
  ``MAX_STRING``, arrays at ``MAX_ARRAY``, nesting at ``MAX_DEPTH``, tensors at
  ``MAX_TENSORS``, dims at ``MAX_DIMS``, and the whole header at ``MAX_HEADER_BYTES``, so a
  garbled or hostile file gives :class:`GGUFError` with a reason, never a hang or a huge
  allocation;
* versions 2 and 3 are read; version 1 (32-bit counts), unknown versions and big-endian files
  (the version word reads byte-swapped) are refused with a reason;
* large arrays (the tokenizer's vocabulary) are walked but not kept: only arrays of up to
  ``KEEP_ARRAY`` elements keep their values, bigger ones become :class:`ArraySummary`.

Results are cached by ``(realpath, size, mtime_ns)`` in :func:`read_header_cached`.

Why not the ``gguf`` package's ``GGUFReader``: it memory-maps the whole file (see above) and
builds numpy arrays for every field and tensor info; it is a development dependency here (the
tests write real files with its ``GGUFWriter``), not a runtime one. ``benchmarks/
gputaskman_llm_probes.py`` measures both on the same file; see the report/README cost table.

Formulas (all from llama.cpp; ``ggml_row_size(t, n) = n * type_size(t) / block_size(t)``)
--------------------------------------------------------------------------------------------
* parameter count = sum over tensors of the product of their dims.
* weights bytes = sum over tensors of ``ggml_row_size(type, n_elements)`` with the ggml block
  table ``GGML_TYPES`` below (the same numbers as ``ggml.c`` ``type_traits`` and the ``gguf``
  package's ``GGML_QUANT_SIZES``, which a test compares).
* KV cache: see `kvcache`, which estimates it from a header.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from gputaskman.base.filecache import ParsedFiles

__all__ = [
    "GGML_TYPES",
    "ArraySummary",
    "GGUFError",
    "GGUFHeader",
    "NotGGUFError",
    "TensorInfo",
    "clear_cache",
    "file_type_name",
    "parse_header",
    "read_header",
    "read_header_cached",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

MAX_HEADER_BYTES = 64 * 1024 * 1024  # Qwen-size vocabularies need ~10 MiB
MAX_STRING = 16 * 1024 * 1024  # a chat template or merges string; keys are far smaller
MAX_KEY = 64 * 1024
MAX_ARRAY = 16 * 1024 * 1024
MAX_DEPTH = 4
MAX_KV = 1_000_000
MAX_TENSORS = 1_000_000
MAX_DIMS = 8
KEEP_ARRAY = 4096
_CHUNK = 1024 * 1024

# ggml type id -> (name, block size in elements, bytes per block); ggml.c type_traits.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# llama.h llama_ftype -> the name llama.cpp prints ("Q4_K - Medium" is shown as Q4_K_M).
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}

# GGUF metadata value types: id -> (name, struct format or None for string/array).
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("uint8", "<B"),
    1: ("int8", "<b"),
    2: ("uint16", "<H"),
    3: ("int16", "<h"),
    4: ("uint32", "<I"),
    5: ("int32", "<i"),
    6: ("float32", "<f"),
    7: ("bool", "<?"),
    10: ("uint64", "<Q"),
    11: ("int64", "<q"),
    12: ("float64", "<d"),
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF header this reader accepts; ``str()`` says why."""


class NotGGUFError(GGUFError):
    """The file does not begin with the GGUF magic: another format, not a damaged GGUF."""


@dataclass(frozen=True, slots=True)
class ArraySummary:
    """A metadata array too long to keep (e.g. the vocabulary): its element type and count."""

    element_type: str
    count: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        """Bytes of this tensor's data, or None for a ggml type this reader does not know."""
        t = GGML_TYPES.get(self.ggml_type)
        if t is None:
            return None
        _, blck, size = t
        return -(-self.n_elements // blck) * size


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file's header says. Unknown values are None, never 0."""

    path: str
    version: int
    file_size: int
    header_bytes: int  # bytes read: up to the end of the tensor infos
    metadata: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...] = field(repr=False)

    @property
    def architecture(self) -> str | None:
        v = self.metadata.get("general.architecture")
        return v if isinstance(v, str) else None

    @property
    def name(self) -> str | None:
        v = self.metadata.get("general.name")
        return v if isinstance(v, str) and v else None

    @property
    def file_type(self) -> str | None:
        """Quantization as llama.cpp names it (``general.file_type``), else None."""
        v = self.metadata.get("general.file_type")
        return file_type_name(v) if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bytes_by_type(self) -> dict[str, int | None]:
        """Tensor data bytes per ggml type name; a type this reader cannot size is listed
        under ``type<id>`` with None (unknown, never 0)."""
        out: dict[str, int | None] = {}
        for t in self.tensors:
            if t.ggml_type in GGML_TYPES:
                key = GGML_TYPES[t.ggml_type][0]
                out[key] = (out.get(key) or 0) + (t.nbytes or 0)
            else:
                out[f"type{t.ggml_type}"] = None
        return out

    @property
    def weights_bytes(self) -> int | None:
        """Sum of tensor data bytes; None if any tensor has a ggml type we cannot size."""
        sizes = [t.nbytes for t in self.tensors]
        if any(s is None for s in sizes):
            return None
        return sum(s for s in sizes if s is not None)

    def arch_value(self, suffix: str) -> Any:
        """``<architecture>.<suffix>`` from the metadata, or None."""
        arch = self.architecture
        return None if arch is None else self.metadata.get(f"{arch}.{suffix}")


def file_type_name(ftype: int) -> str:
    return _FILE_TYPES.get(ftype, f"ftype{ftype}")


class _Reader:
    """Reads forward from a file in chunks, never past ``limit`` bytes in total."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self.f = f
        self.limit = limit
        self.buf = bytearray()
        self.base = 0  # file offset of buf[0]
        self.pos = 0  # file offset of the next byte to parse
        self.eof = False

    def _need(self, n: int) -> int:
        """Make ``n`` bytes from ``pos`` available; return their index into ``buf``."""
        end = self.pos + n
        if end > self.limit:
            raise GGUFError(f"header larger than the {self.limit} byte cap (at offset {self.pos})")
        while self.base + len(self.buf) < end:
            if self.eof:
                raise GGUFError(f"truncated: needs {n} bytes at offset {self.pos}")
            want = max(_CHUNK, end - self.base - len(self.buf))
            want = min(want, self.limit - self.base - len(self.buf))
            chunk = self.f.read(want)
            if not chunk:
                self.eof = True
                continue
            # Drop what is already parsed so the buffer stays about one chunk.
            drop = self.pos - self.base
            if drop > _CHUNK:
                del self.buf[:drop]
                self.base += drop
            self.buf += chunk
        return self.pos - self.base

    def unpack(self, fmt: str, size: int) -> Any:
        i = self._need(size)
        self.pos += size
        return struct.unpack_from(fmt, self.buf, i)[0]

    def u32(self) -> int:
        return self.unpack("<I", 4)

    def u64(self) -> int:
        return self.unpack("<Q", 8)

    def string(self, cap: int) -> str:
        n = self.u64()
        if n > cap:
            raise GGUFError(f"string of {n} bytes at offset {self.pos - 8} exceeds cap {cap}")
        i = self._need(n)
        self.pos += n
        return bytes(self.buf[i : i + n]).decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        self._need(n)
        self.pos += n

    def skip_strings(self, count: int) -> None:
        """Walk ``count`` length-prefixed strings without decoding them (vocabularies)."""
        unpack = struct.unpack_from
        while count:
            buf, i, end = self.buf, self.pos - self.base, len(self.buf)
            # Fast path: strings wholly inside the buffer, one unpack each.
            while count and i + 8 <= end:
                n = unpack("<Q", buf, i)[0]
                if n > MAX_STRING or i + 8 + n > end:
                    break
                i += 8 + n
                count -= 1
            self.pos = self.base + i
            if count:  # crosses the buffer end (or is too long): the checked slow path
                n = self.u64()
                if n > MAX_STRING:
                    raise GGUFError(f"string of {n} bytes at offset {self.pos - 8} exceeds cap")
                self.skip(n)
                count -= 1


def _value(r: _Reader, vtype: int, depth: int) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype][1]
        return r.unpack(fmt, struct.calcsize(fmt))
    if vtype == _STRING:
        return r.string(MAX_STRING)
    if vtype == _ARRAY:
        if depth >= MAX_DEPTH:
            raise GGUFError(f"arrays nested deeper than {MAX_DEPTH} at offset {r.pos}")
        etype = r.u32()
        count = r.u64()
        if count > MAX_ARRAY:
            raise GGUFError(f"array of {count} elements at offset {r.pos - 8} exceeds cap")
        if etype in _SCALARS:
            fmt = _SCALARS[etype][1]
            size = struct.calcsize(fmt)
            if count > KEEP_ARRAY:
                r.skip(count * size)  # checked against the byte cap before any read
                return ArraySummary(_SCALARS[etype][0], count)
            i = r._need(count * size)
            r.pos += count * size
            return list(struct.unpack_from(f"<{count}{fmt[1]}", r.buf, i))
        if etype not in (_STRING, _ARRAY):
            raise GGUFError(f"unknown array element type {etype} at offset {r.pos - 12}")
        if count <= KEEP_ARRAY:
            return [_value(r, etype, depth + 1) for _ in range(count)]
        if etype == _STRING:
            r.skip_strings(count)
        else:
            for _ in range(count):
                _value(r, etype, depth + 1)
        return ArraySummary("string" if etype == _STRING else "array", count)
    raise GGUFError(f"unknown metadata value type {vtype} at offset {r.pos - 4}")


def parse_header(
    f: BinaryIO, path: str = "", file_size: int | None = None, limit: int = MAX_HEADER_BYTES
) -> GGUFHeader:
    """Parse a GGUF header from an open binary file positioned at offset 0."""
    r = _Reader(f, limit)
    try:
        magic = bytes(r.buf[r._need(4) :][:4])
    except GGUFError as e:
        raise NotGGUFError(f"not GGUF: {e}") from None
    r.pos += 4
    if magic != GGUF_MAGIC:
        raise NotGGUFError(f"not GGUF: magic {magic!r}")
    version = r.u32()
    if version not in SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in (1, 2, 3):
            raise GGUFError(f"big-endian GGUF (version {swapped}) is not supported")
        if version == 1:
            raise GGUFError("GGUF version 1 (32-bit counts) is not supported")
        raise GGUFError(f"unknown GGUF version {version}")
    n_tensors = r.u64()
    n_kv = r.u64()
    if n_tensors > MAX_TENSORS:
        raise GGUFError(f"declares {n_tensors} tensors, over the cap of {MAX_TENSORS}")
    if n_kv > MAX_KV:
        raise GGUFError(f"declares {n_kv} metadata entries, over the cap of {MAX_KV}")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string(MAX_KEY)
        meta[key] = _value(r, r.u32(), 0)
    tensors = []
    for _ in range(n_tensors):
        name = r.string(MAX_KEY)
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dims, over the cap of {MAX_DIMS}")
        shape = tuple(r.u64() for _ in range(n_dims))
        tensors.append(TensorInfo(name, shape, r.u32(), r.u64()))
    return GGUFHeader(
        path=path,
        version=version,
        file_size=file_size if file_size is not None else r.pos,
        header_bytes=r.pos,
        metadata=meta,
        tensors=tuple(tensors),
    )


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Read and parse the header of the GGUF file at ``path``.

    Raises :class:`GGUFError` (bad or refused content) or ``OSError`` (cannot open/read).
    """
    p = os.fspath(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return parse_header(f, p, size)


_headers: ParsedFiles[GGUFHeader | GGUFError] = ParsedFiles(256)  # failures kept too


def _parse_or_error(f: BinaryIO, size: int) -> GGUFHeader | GGUFError:
    try:
        return parse_header(f, f.name, size)
    except GGUFError as e:
        return e


def read_header_cached(path: str | os.PathLike[str]) -> GGUFHeader:
    """:func:`read_header`, cached by (real path, size, mtime); failures are cached too."""
    hit = _headers.get(os.path.realpath(os.fspath(path)), _parse_or_error)
    if isinstance(hit, GGUFError):
        raise type(hit)(str(hit))
    return hit


def clear_cache() -> None:
    _headers.clear()
