"""The safetensors header reader and model folders, on files the ``safetensors`` library wrote
(numpy backend) and on hostile bytes (the reader takes untrusted input)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from gputaskman.intel import hfmodel
from gputaskman.intel import safetensors_header as sth
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

HERE = Path(__file__).parent


def _load_helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hf = _load_helper("hf_files")

NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.float16,
    np.int32,
    np.uint32,
    np.float32,
    np.int64,
    np.uint64,
    np.float64,
]


def _raw_file(path: Path, header: dict[str, object], data_len: int, pad: bool = True) -> Path:
    body = json.dumps(header).encode()
    if pad:
        body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(data_len))
    return path


def test_real_file_every_numpy_dtype_matches_the_library(tmp_path: Path) -> None:
    arrays = {f"t{i}": np.zeros((i + 1, 3), d) for i, d in enumerate(NUMPY_DTYPES)}
    arrays["empty"] = np.zeros((0, 5), np.float32)
    p = tmp_path / "m.safetensors"
    save_file(arrays, p, metadata={"format": "np", "note": "x"})
    h = sth.read_header(p)
    assert h.metadata == {"format": "np", "note": "x"}
    assert h.weights_bytes == sum(a.nbytes for a in arrays.values())
    assert h.file_size == p.stat().st_size
    assert h.header_bytes + h.weights_bytes == h.file_size
    with safe_open(str(p), "numpy") as f:
        names = f.keys()  # safe_open is no mapping: keys() is its API
        lib = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in names}
    assert {t.name: (t.dtype, list(t.shape)) for t in h.tensors} == lib
    assert h.bytes_by_dtype["F16"] == arrays["t5"].nbytes


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.text("abcdefgh._", min_size=1, max_size=8),
        st.tuples(
            st.sampled_from(NUMPY_DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)
        ),
        max_size=6,
    )
)
def test_differential_any_file_the_library_writes(
    tmp_path_factory: pytest.TempPathFactory, spec: dict[str, tuple[object, list[int]]]
) -> None:
    arrays = {k: np.zeros(tuple(shape), d) for k, (d, shape) in spec.items()}
    p = tmp_path_factory.mktemp("st") / "x.safetensors"
    save_file(arrays, p)
    h = sth.read_header(p)
    assert h.weights_bytes == sum(a.nbytes for a in arrays.values())
    assert sorted(t.name for t in h.tensors) == sorted(arrays)
    assert h.n_elements == sum(a.size for a in arrays.values())


def test_dtypes_numpy_cannot_write_are_named_and_sized(tmp_path: Path) -> None:
    """BF16, FP8 and sub-byte FP4 as a quantized checkpoint holds them; the library opens the
    file (the oracle), and the reader names each dtype and sizes it by its bits."""
    header = {
        "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "q": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [12, 16]},
        "z": {"dtype": "F4", "shape": [4], "data_offsets": [16, 18]},
    }
    p = _raw_file(tmp_path / "q.safetensors", header, 18)
    with safe_open(str(p), "numpy") as f:
        assert sorted(f.keys()) == ["q", "w", "z"]
    h = sth.read_header(p)
    assert h.bytes_by_dtype == {"BF16": 12, "F8_E4M3": 4, "F4": 2}
    assert h.weights_bytes == 18


def test_an_unknown_dtype_is_unknown_bytes_never_a_guess(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
        "b": {"dtype": "Q4_FUTURE", "shape": [8], "data_offsets": [4, 8]},
    }
    h = sth.read_header(_raw_file(tmp_path / "u.safetensors", header, 8))
    b = next(t for t in h.tensors if t.name == "b")
    assert b.nbytes is None
    assert h.weights_bytes is None  # not 4, not 8: unknown
    assert h.bytes_by_dtype == {"F16": 4, "Q4_FUTURE": None}


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "truncated"),
        (b"\x01\x02", "truncated"),
        (struct.pack("<Q", sth.MAX_HEADER_BYTES + 1), "cap"),
        (struct.pack("<Q", 1 << 63), "cap"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 4) + b"GGUF", "not safetensors"),
        (struct.pack("<Q", 5) + b"[1,2]", "not safetensors"),
        (struct.pack("<Q", 3) + b"{\xff}", "UTF-8 JSON"),
        (struct.pack("<Q", 9) + b'{"a": 1}\n', "not an object"),
        (struct.pack("<Q", 2) + b"{x", "JSON"),
    ],
)
def test_hostile_bytes_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(sth.SafetensorsError, match=reason):
        sth.parse_header(data)


@pytest.mark.parametrize(
    "tensors,data_len,reason",
    [
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 6]}}, 6, "needs 4 bytes"),
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}, 6, "end before"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            6,
            "contiguous",
        ),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6, "contiguous"),
        ({"a": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}, 8, "truncated"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, 1, "shape"),
        ({"a": {"dtype": "U8", "shape": [1] * 17, "data_offsets": [0, 1]}}, 1, "shape"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, 1, "data_offsets"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, True]}}, 1, "data_offsets"),
        ({"a": [1]}, 1, "not an object"),
        ({"a": {"shape": [1], "data_offsets": [0, 1]}}, 1, "no dtype"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
        ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2, "needs 1.5"),
    ],
)
def test_inconsistent_headers_are_refused(
    tmp_path: Path, tensors: dict[str, object], data_len: int, reason: str
) -> None:
    p = _raw_file(tmp_path / "bad.safetensors", tensors, data_len)
    with pytest.raises(sth.SafetensorsError, match=reason):
        sth.read_header(p)


def test_a_header_longer_than_the_file_is_truncated_not_read(tmp_path: Path) -> None:
    p = tmp_path / "short.safetensors"
    p.write_bytes(struct.pack("<Q", 10_000_000) + b"{}")
    with pytest.raises(sth.SafetensorsError, match="truncated"):
        sth.read_header(p)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_bytes_never_raise_anything_else(data: bytes) -> None:
    with contextlib.suppress(sth.SafetensorsError):
        sth.parse_header(data, file_size=len(data))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.text(max_size=6),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "a", "b"]),
            kids,
            max_size=4,
        )
    ),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), _json, max_size=3))
def test_fuzz_hostile_headers(doc: dict[str, object]) -> None:
    body = json.dumps(doc).encode()
    data = struct.pack("<Q", len(body)) + body + bytes(64)
    try:
        h = sth.parse_header(data, file_size=len(data))
    except sth.SafetensorsError:
        return
    # what is accepted is consistent: contiguous from 0, sized by dtype where known
    pos = 0
    for t in h.tensors:
        assert t.begin == pos
        pos = t.end
    assert 8 + len(body) + pos <= len(data)


def test_cached_by_path_size_and_mtime_and_failures_too(tmp_path: Path) -> None:
    sth.clear_cache()
    p = tmp_path / "c.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, p)
    first = sth.read_header_cached(p)
    assert sth.read_header_cached(p) is first
    save_file({"a": np.zeros(8, np.float32)}, p)
    os.utime(p, ns=(1, 2))
    assert sth.read_header_cached(p).weights_bytes == 32
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"GGUF" * 8)
    for _ in range(2):
        with pytest.raises(sth.SafetensorsError):
            sth.read_header_cached(bad)


# --------------------------------------------------------------------------- model folders


def test_single_file_folder_with_config(tmp_path: Path) -> None:
    arrays = hf.write_model_dir(tmp_path / "m")
    m = hfmodel.read_model(str(tmp_path / "m"))
    assert m.errors == ()
    assert m.weights_bytes == hf.nbytes(arrays)
    assert m.file_type == "F16+F32"
    assert m.parameter_count == sum(a.size for a in arrays.values())
    assert m.config is not None and m.config.num_kv_heads == 2 and m.config.head_dim == 16


def test_sharded_folder_sums_every_shard_from_the_index(tmp_path: Path) -> None:
    arrays = hf.write_model_dir(tmp_path / "m", shards=3)
    m = hfmodel.read_model(str(tmp_path / "m"))
    assert len(m.files) == 3 and m.complete
    assert m.weights_bytes == hf.nbytes(arrays) == m.index_total


def test_a_missing_shard_makes_the_total_unknown_and_says_so(tmp_path: Path) -> None:
    arrays = hf.write_model_dir(tmp_path / "m", shards=2)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    m = hfmodel.read_model(str(tmp_path / "m"))
    assert m.weights_bytes is None
    assert m.index_total == hf.nbytes(arrays)
    assert any("model-00002-of-00002" in e for e in m.errors)


def test_hostile_index_is_refused(tmp_path: Path) -> None:
    hf.write_model_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../../etc/passwd"}})
    )
    m = hfmodel.read_model(str(tmp_path / "m"))
    assert m.files == () and "not a file name" in m.errors[0]


def test_gptq_weights_are_named_as_quantized_not_as_int32(tmp_path: Path) -> None:
    cfg = dict(hf.QWEN_LIKE, quantization_config={"quant_method": "gptq", "bits": 4})
    folder = tmp_path / "q"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(
        {
            "l.qweight": np.zeros((8, 64), np.int32),
            "l.scales": np.zeros((1, 64), np.float16),
        },
        folder / "model.safetensors",
    )
    m = hfmodel.read_model(str(folder))
    assert m.file_type == "gptq 4-bit: I32+F16"
    assert m.parameter_count is None  # packed words are not parameters
    assert m.weights_bytes == 8 * 64 * 4 + 64 * 2


@pytest.mark.parametrize(
    "cfg,dtype,tp,expect",
    [
        (hf.QWEN_LIKE, "bfloat16", 1, 2 * 2 * 2 * 16 * 2),
        (hf.QWEN_LIKE, "fp8", 1, 2 * 2 * 2 * 16 * 1),
        (hf.QWEN_LIKE, "bfloat16", 2, 2 * 2 * 1 * 16 * 2),
        (hf.QWEN_LIKE, "bfloat16", 4, 2 * 2 * 1 * 16 * 2),  # 2 KV heads replicated over 4
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, "fp16", 1, 512),
        (
            {"text_config": dict(hf.QWEN_LIKE, num_hidden_layers=3), "model_type": "vl"},
            "float32",
            1,
            2 * 3 * 2 * 16 * 4,
        ),
        (dict(hf.QWEN_LIKE, kv_lora_rank=512), "bfloat16", 1, None),
        (dict(hf.QWEN_LIKE, layer_types=["full_attention", "sliding_attention"]), "bf16", 1, None),
        (hf.QWEN_LIKE, "auto", 1, None),
        ({"num_attention_heads": 4}, "bfloat16", 1, None),
    ],
)
def test_kv_bytes_per_token(
    cfg: dict[str, object], dtype: str, tp: int, expect: int | None
) -> None:
    got, how = hfmodel.kv_bytes_per_token(hfmodel.parse_config(cfg), dtype, tp)
    assert got == expect, how


@settings(max_examples=300, deadline=None)
@given(_json)
def test_fuzz_config_parser(doc: object) -> None:
    cfg = hfmodel.parse_config(doc)
    if cfg is not None:
        per, _ = hfmodel.kv_bytes_per_token(cfg, "bfloat16", 2)
        assert per is None or per > 0
