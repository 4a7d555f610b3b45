"""gguf.py against real GGUF files written with the `gguf` package's GGUFWriter."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import struct
import tracemalloc
from pathlib import Path
from types import ModuleType

import gguf as ggufpkg
import pytest
from gputaskman.intel import gguf as g
from gputaskman.intel import kvcache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

Q = ggufpkg.GGMLQuantizationType


def _load_helper(name: str) -> ModuleType:
    """Load a helper module beside this file (tests are not a package here)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


write_model = _load_helper("gguf_files").write_model


def test_ggml_type_table_matches_the_gguf_package() -> None:
    for tid, (name, blck, size) in g.GGML_TYPES.items():
        qt = Q(tid)
        assert qt.name == name
        assert ggufpkg.GGML_QUANT_SIZES[qt] == (blck, size)


def test_file_type_names_match_the_gguf_package() -> None:
    for ft in ggufpkg.LlamaFileType:
        if ft.value in g._FILE_TYPES:
            short = g._FILE_TYPES[ft.value]
            assert ft.name in (f"MOSTLY_{short}", f"ALL_{short}")


def test_llama_header_params_weights_and_kv(tmp_path: Path) -> None:
    p = tmp_path / "llama.gguf"
    wrote = write_model(p, "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=4, ctx=256)
    h = g.read_header(p)
    assert (h.version, h.architecture, h.name, h.file_type) == (3, "llama", "Test Model", "Q8_0")
    assert h.parameter_count == wrote["params"]
    assert h.weights_bytes == wrote["bytes"]
    assert set(h.bytes_by_type) == {"F16", "Q8_0", "Q4_0", "F32"}
    assert h.bytes_by_type["Q8_0"] == 2 * (64 * 64 // 32) * 34
    assert h.bytes_by_type["Q4_0"] == 2 * (64 * 64 // 32) * 18
    assert h.header_bytes < h.file_size
    # head = 64/4 = 16, n_embd_k_gqa = 4*16 = 64 elements per cell per layer for K and for V.
    kv = {t: kvcache.kv_cache_estimate(h, cache_type_k=t) for t in kvcache.KV_CACHE_TYPES}
    assert kv["f16"].bytes == 2 * 256 * 2 * 64 * 2
    assert kv["q8_0"].bytes == 2 * 256 * 2 * (64 // 32) * 34
    assert kv["q4_0"].bytes == 2 * 256 * 2 * (64 // 32) * 18
    assert kv["f16"].n_ctx_source == "header context_length"
    assert (kv["f16"].full_layers, kv["f16"].swa_layers, kv["f16"].swa_cells) == (2, 0, None)
    mixed = kvcache.kv_cache_estimate(h, 100, "q8_0", "f16")
    assert mixed.bytes == 2 * 100 * ((64 // 32) * 34 + 64 * 2)
    assert mixed.n_ctx_source == "runtime"


def test_qwen2_gqa_kv_uses_head_count_kv(tmp_path: Path) -> None:
    p = tmp_path / "qwen.gguf"
    write_model(p, "qwen2", n_layer=3, n_embd=128, n_head=8, n_head_kv=2, ctx=512)
    h = g.read_header(p)
    # head 16, 2 KV heads -> 32 elements per cell per layer.
    assert kvcache.kv_cache_estimate(h, cache_type_k="f16").bytes == 3 * 512 * 2 * 32 * 2
    assert kvcache.kv_cache_estimate(h, cache_type_k="q8_0").bytes == 3 * 512 * 2 * 34
    assert kvcache.kv_cache_estimate(h, cache_type_k="q4_0").bytes == 3 * 512 * 2 * 18


def test_gemma2_sliding_window_layers(tmp_path: Path) -> None:
    p = tmp_path / "gemma2.gguf"
    write_model(
        p,
        "gemma2",
        n_layer=4,
        n_embd=64,
        n_head=4,
        n_head_kv=2,
        ctx=8192,
        key_length=32,
        sliding_window=1024,
    )
    h = g.read_header(p)
    kv = kvcache.kv_cache_estimate(h)
    row = 2 * 32 * 2  # 2 KV heads of 32, f16
    swa_cells = 1536  # GGML_PAD(min(8192, 1024 + 512), 256)
    assert (kv.full_layers, kv.swa_layers, kv.swa_cells) == (2, 2, swa_cells)
    assert kv.bytes == 2 * 8192 * 2 * row + 2 * swa_cells * 2 * row
    small = kvcache.kv_cache_estimate(h, 1000)
    assert small.swa_cells == 1024  # padded to 256, as llama.cpp does
    assert small.bytes == 2 * 1000 * 2 * row + 2 * 1024 * 2 * row
    full = kvcache.kv_cache_estimate(h, 8192, swa_full=True)
    assert full.bytes == 4 * 8192 * 2 * row
    q4 = kvcache.kv_cache_estimate(h, cache_type_k="q4_0")
    assert q4.bytes == 2 * 8192 * 2 * (2 * 18) + 2 * swa_cells * 2 * (2 * 18)


def test_gemma2_default_window_and_gemma3_pattern(tmp_path: Path) -> None:
    p = tmp_path / "g2.gguf"
    write_model(p, "gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=4, ctx=16384)
    kv = kvcache.kv_cache_estimate(g.read_header(p))
    assert kv.swa_cells == 4096 + 512  # gemma2's default window, already a multiple of 256
    p3 = tmp_path / "g3.gguf"
    write_model(
        p3, "gemma3", n_layer=6, n_embd=64, n_head=4, n_head_kv=1, ctx=4096, sliding_window=512
    )
    kv3 = kvcache.kv_cache_estimate(g.read_header(p3))
    assert (kv3.swa_layers, kv3.full_layers, kv3.swa_cells) == (5, 1, 1024)
    assert kv3.bytes == (5 * 1024 + 1 * 4096) * 2 * 16 * 2


def test_per_layer_head_count_kv_array_skips_kv_less_layers(tmp_path: Path) -> None:
    p = tmp_path / "hybrid.gguf"
    write_model(p, "llama", n_layer=3, n_embd=64, n_head=4, n_head_kv=[4, 0, 2], ctx=128)
    h = g.read_header(p)
    assert h.arch_value("attention.head_count_kv") == [4, 0, 2]
    kv = kvcache.kv_cache_estimate(h)
    assert kv.bytes == 128 * 2 * (64 + 32) * 2
    assert kv.full_layers == 2


def test_missing_shape_gives_none_not_zero(tmp_path: Path) -> None:
    p = tmp_path / "noshape.gguf"
    w = ggufpkg.GGUFWriter(str(p), "llama")
    w.add_context_length(10)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = g.read_header(p)
    assert kvcache.kv_cache_estimate(h) is None
    assert h.parameter_count == 0 and h.weights_bytes == 0 and h.file_type is None
    with pytest.raises(ValueError, match="KV cache type"):
        kvcache.kv_cache_estimate(h, cache_type_k="q5_1")


def test_every_metadata_value_type_and_nested_arrays_agree_with_gguf_reader(tmp_path: Path) -> None:
    p = tmp_path / "types.gguf"
    w = ggufpkg.GGUFWriter(str(p), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 2.25)
    w.add_array("t.arr", [1, 2, 3])
    w.add_array("t.strs", ["a", "bc"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.big", list(range(g.KEEP_ARRAY + 1)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = g.read_header(p).metadata
    assert m["t.u8"] == 200 and m["t.i8"] == -100 and m["t.u16"] == 60000
    assert m["t.i16"] == -30000 and m["t.u32"] == 4_000_000_000 and m["t.i32"] == -2_000_000_000
    assert m["t.f32"] == 1.5 and m["t.bool"] is True and m["t.str"] == "héllo"
    assert m["t.u64"] == 2**63 and m["t.i64"] == -(2**62) and m["t.f64"] == 2.25
    assert m["t.arr"] == [1, 2, 3] and m["t.strs"] == ["a", "bc"]
    assert m["t.nested"] == [[1, 2], [3]]
    assert isinstance(m["t.big"], g.ArraySummary) and m["t.big"].count == g.KEEP_ARRAY + 1
    ref = ggufpkg.GGUFReader(str(p))
    assert {k for k in ref.fields if not k.startswith("GGUF.")} == set(m)


def test_a_tensor_of_an_unknown_type_makes_the_weights_unknown(tmp_path: Path) -> None:
    """Catches a weights sum that counts a tensor it cannot size as 0 bytes: the size would be
    reported (too small) instead of unknown."""
    p = tmp_path / "m.gguf"
    write_model(p, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=16, vocab=4)
    data = bytearray(p.read_bytes())
    first = g.read_header(p).tensors[0]
    name = first.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)  # a ggml type id nobody defines
    assert 250 not in g.GGML_TYPES
    p.write_bytes(bytes(data))
    h = g.read_header(p)
    assert h.tensors[0].ggml_type == 250 and h.tensors[0].nbytes is None
    assert all(t.nbytes is not None for t in h.tensors[1:])  # the others are still sized
    assert h.weights_bytes is None
    assert h.bytes_by_type["type250"] is None
    assert h.parameter_count > 0  # element counts do not depend on the type


def test_tensor_infos_agree_with_gguf_reader(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    write_model(p, "qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=64)
    h = g.read_header(p)
    ref = ggufpkg.GGUFReader(str(p))
    assert [t.name for t in h.tensors] == [t.name for t in ref.tensors]
    assert [t.nbytes for t in h.tensors] == [int(t.n_bytes) for t in ref.tensors]
    assert [t.n_elements for t in h.tensors] == [int(t.n_elements) for t in ref.tensors]


@pytest.fixture
def small_file(tmp_path: Path) -> tuple[bytes, int]:
    p = tmp_path / "small.gguf"
    write_model(p, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=16, vocab=4)
    data = p.read_bytes()
    return data, g.read_header(p).header_bytes


def test_truncated_at_every_offset_is_a_clear_error(small_file: tuple[bytes, int]) -> None:
    data, header_bytes = small_file
    for cut in range(header_bytes):
        with pytest.raises(g.GGUFError, match=r"truncated|not GGUF"):
            g.parse_header(io.BytesIO(data[:cut]))
    # Cut inside the tensor data: the header is complete, so it still parses.
    h = g.parse_header(io.BytesIO(data[: header_bytes + 1]))
    assert h.header_bytes == header_bytes


def test_truncated_inside_a_skipped_vocabulary(tmp_path: Path) -> None:
    p = tmp_path / "vocab.gguf"
    write_model(
        p, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=16, vocab=g.KEEP_ARRAY + 50
    )
    data = p.read_bytes()
    h = g.read_header(p)
    assert h.metadata["tokenizer.ggml.tokens"] == g.ArraySummary("string", g.KEEP_ARRAY + 50)
    for cut in [*range(0, h.header_bytes, 61), *range(h.header_bytes - 40, h.header_bytes)]:
        with pytest.raises(g.GGUFError, match=r"truncated|not GGUF"):
            g.parse_header(io.BytesIO(data[:cut]))
    # A vocabulary string declaring a huge length is refused, not skipped over.
    i = data.index(b"tok0") - 8
    bad = data[:i] + struct.pack("<Q", 2**40) + data[i + 8 :]
    with pytest.raises(g.GGUFError, match="exceeds cap"):
        g.parse_header(io.BytesIO(bad))


def test_garbage_big_endian_and_unknown_versions_are_refused(
    tmp_path: Path, small_file: tuple[bytes, int]
) -> None:
    with pytest.raises(g.GGUFError, match="not GGUF: magic"):
        g.parse_header(io.BytesIO(b"\x7fELF" + b"\0" * 100))
    be = tmp_path / "be.gguf"
    write_model(
        be,
        "llama",
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_head_kv=2,
        ctx=16,
        endianess=ggufpkg.GGUFEndian.BIG,
    )
    with pytest.raises(g.GGUFError, match="big-endian"):
        g.read_header(be)
    data = small_file[0]
    for version, msg in (
        (1, "version 1"),
        (7, "unknown GGUF version 7"),
        (0xFFFFFFFF, "unknown GGUF version"),
    ):
        bad = data[:4] + struct.pack("<I", version) + data[8:]
        with pytest.raises(g.GGUFError, match=msg):
            g.parse_header(io.BytesIO(bad))


def _header(n_tensors: int = 0, n_kv: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


@pytest.mark.parametrize(
    "blob,msg",
    [
        (_header() + struct.pack("<Q", 2**60), "exceeds cap"),  # key length
        (_header() + struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 2**62), "exceeds cap"),
        (_header() + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 2**40), "exceeds cap"),
        (
            _header() + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 10**7),
            "larger than the",
        ),  # under the count cap, over the byte cap: refused before reading
        (_header(n_tensors=2**50, n_kv=0), "tensors, over the cap"),
        (_header(n_kv=2**40), "metadata entries, over the cap"),
        (_header() + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), "unknown metadata"),
        (
            _header(n_tensors=1, n_kv=0) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 1000),
            "dims",
        ),
    ],
)
def test_huge_declared_lengths_do_not_allocate(blob: bytes, msg: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(g.GGUFError, match=msg):
            g.parse_header(io.BytesIO(blob + b"\0" * 64), limit=4 * 1024 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024


def test_deeply_nested_arrays_are_refused() -> None:
    body = struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
    for _ in range(g.MAX_DEPTH + 1):
        body += struct.pack("<IQ", 9, 1)
    with pytest.raises(g.GGUFError, match="nested"):
        g.parse_header(io.BytesIO(_header() + body + b"\0" * 64))


def test_cache_by_path_size_mtime_and_symlink(tmp_path: Path) -> None:
    g.clear_cache()
    p = tmp_path / "c.gguf"
    write_model(p, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=16, name="One")
    link = tmp_path / "link.gguf"
    link.symlink_to(p)
    a = g.read_header_cached(p)
    assert g.read_header_cached(link) is a  # same real file, same entry
    write_model(p, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=16, name="Two!")
    os.utime(p, ns=(a.file_size, 10**18))
    b = g.read_header_cached(p)
    assert b is not a and b.name == "Two!"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    for _ in range(2):
        with pytest.raises(g.GGUFError, match="not GGUF"):
            g.read_header_cached(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_fuzz_after_a_valid_preamble_never_crashes(tail: bytes) -> None:
    try:
        h = g.parse_header(io.BytesIO(_header(n_tensors=1, n_kv=2) + tail), limit=1 << 20)
    except g.GGUFError:
        return
    assert len(h.tensors) == 1 and len(h.metadata) == 2


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_real_file(data: st.DataObject) -> None:
    blob = bytearray(_SMALL_REAL)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(g.GGUFError):
        g.parse_header(io.BytesIO(bytes(blob)), limit=1 << 20)


def _small_real() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s.gguf"
        write_model(p, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=16, vocab=4)
        return p.read_bytes()[: g.read_header(p).header_bytes]


_SMALL_REAL = _small_real()
