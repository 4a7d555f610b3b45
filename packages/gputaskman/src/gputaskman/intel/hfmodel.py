"""A Hugging Face style model folder (safetensors weights plus ``config.json``): its weights'
bytes and dtypes from the safetensors headers, its attention shape from ``config.json``, and
the KV-cache bytes per token that shape gives a runtime's token count.

Theory of operation
-------------------
A model folder (a hub cache snapshot, or any folder a runtime is pointed at) holds either one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {"<tensor>": "<shard file>"}}``, as
transformers' ``save_pretrained`` writes it). :func:`read_model` reads every shard's header
(`safetensors_header`, bounded, cached; at most `MAX_SHARDS` shards) and ``config.json``
(at most `MAX_CONFIG_BYTES`), and says what it could not read. The weights' total is a fact
about the files; a shard that cannot be read makes it unknown (the index's ``total_size`` is
kept beside it as the index's own figure).

``config.json`` (transformers ``PretrainedConfig``) gives ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads`` (default: the attention heads), ``head_dim``
(default ``hidden_size / num_attention_heads``) and ``torch_dtype`` (``dtype`` in newer
transformers); a multimodal model nests them in ``text_config``. ``quantization_config``
names packed weights (``quant_method``, ``bits``), so a GPTQ file's ``I32`` words are named
as what they are and no parameter count is derived from packed shapes.

KV bytes per token (:func:`kv_bytes_per_token`), for runtimes that report their KV pool in
tokens or blocks (vLLM, SGLang, TGI) and lay every layer out alike::

    2 (K and V) * num_hidden_layers * ceil(num_key_value_heads / tp) * head_dim * dtype bytes

with ``tp`` the tensor-parallel size (each GPU holds its share of the KV heads; a head count
below ``tp`` is replicated). Models whose layers differ (MLA's ``kv_lora_rank``, ``layer_types``
with sliding or linear attention layers) get None with the reason: no formula here, never a
guess.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gputaskman.intel import safetensors_header as sth

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_SHARDS",
    "ModelConfig",
    "ModelFiles",
    "dtype_bytes",
    "kv_bytes_per_token",
    "parse_config",
    "read_model",
]

MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_SHARDS = 1024
INDEX_NAME = "model.safetensors.index.json"

# torch dtype or runtime cache dtype name -> bytes per element; None: not a fixed size here.
_DTYPE_BYTES = {
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "f16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "f32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_e4m3fn": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


def dtype_bytes(name: str | None) -> int | None:
    """Bytes per element of a dtype name (``torch.bfloat16``, ``bfloat16``, ``fp8_e4m3``);
    None for ``auto`` and names without a fixed size here."""
    if not name:
        return None
    return _DTYPE_BYTES.get(name.lower().removeprefix("torch."))


def _uint(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What ``config.json`` says about attention and dtype. Unknown is None."""

    model_type: str | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None  # torch_dtype / dtype as written
    quant_method: str | None = None
    quant_bits: int | None = None
    max_positions: int | None = None
    uniform_reason: str | None = None  # why layers are not laid out alike (None: they are)


def parse_config(doc: Any) -> ModelConfig | None:
    """A parsed ``config.json`` object as `ModelConfig`; None when it is not an object."""
    if not isinstance(doc, dict):
        return None
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else None
    src = text if text is not None and "num_hidden_layers" in text else doc

    def get(key: str) -> Any:
        v = src.get(key)
        return doc.get(key) if v is None else v

    layers, heads = _uint(get("num_hidden_layers")), _uint(get("num_attention_heads"))
    kv = _uint(get("num_key_value_heads"))
    kv = heads if kv is None and get("num_key_value_heads") is None else kv
    head_dim = _uint(get("head_dim"))
    hidden = _uint(get("hidden_size"))
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads if hidden % heads == 0 else None
    dtype = get("torch_dtype") or get("dtype")
    q = doc.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    bits = _uint(q.get("bits")) if isinstance(q, dict) else None
    reason = None
    if get("kv_lora_rank") is not None:
        reason = "multi-head latent attention (kv_lora_rank): no per-head formula here"
    types = get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        reason = "layer_types mixes attention kinds: layers are not laid out alike"
    mt = get("model_type")
    return ModelConfig(
        model_type=mt if isinstance(mt, str) else None,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        dtype=dtype if isinstance(dtype, str) else None,
        quant_method=method if isinstance(method, str) else None,
        quant_bits=bits,
        max_positions=_uint(get("max_position_embeddings")),
        uniform_reason=reason,
    )


def kv_bytes_per_token(
    cfg: ModelConfig | None, cache_dtype: str | None, tp: int = 1
) -> tuple[int | None, str]:
    """``(bytes, how)``: KV-cache bytes one token takes on one GPU (formula in the module
    docstring), or ``(None, why not)``."""
    if cfg is None:
        return None, "no config.json read"
    if cfg.uniform_reason:
        return None, cfg.uniform_reason
    size = dtype_bytes(cache_dtype)
    if size is None:
        return None, f"KV cache dtype {cache_dtype!r} has no fixed size here"
    if not cfg.num_layers or not cfg.num_kv_heads or not cfg.head_dim or tp < 1:
        return None, "config.json lacks layers, KV heads or head size"
    heads = -(-cfg.num_kv_heads // tp)
    per = 2 * cfg.num_layers * heads * cfg.head_dim * size
    return per, (
        f"2 x {cfg.num_layers} layers x {heads} KV heads"
        + (f" (of {cfg.num_kv_heads}, tp {tp})" if tp > 1 else "")
        + f" x {cfg.head_dim} x {size} B ({cache_dtype})"
    )


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A model folder's (or one file's) safetensors headers and config. Unknown is None."""

    path: str
    files: tuple[str, ...] = ()
    headers: tuple[sth.SafetensorsHeader, ...] = field(default=(), repr=False)
    config: ModelConfig | None = None
    index_total: int | None = None  # the index's metadata.total_size
    errors: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return bool(self.files) and len(self.headers) == len(self.files)

    @property
    def weights_bytes(self) -> int | None:
        """Sum over every shard; None when a shard is unread or holds an unknown dtype."""
        if not self.complete:
            return None
        sizes = [h.weights_bytes for h in self.headers]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    @property
    def bytes_by_dtype(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for h in self.headers:
            for d, n in h.bytes_by_dtype.items():
                known = n is not None and (d not in out or out[d] is not None)
                out[d] = (out.get(d) or 0) + n if known and n is not None else None
        return out

    @property
    def file_type(self) -> str | None:
        """The weights' dtypes by bytes (``BF16``, ``BF16+F32``), with the quantization
        ``config.json`` names (``gptq 4-bit: I32+F16``)."""
        by = self.bytes_by_dtype
        if not by:
            return None
        names = sorted(by, key=lambda d: (-(by[d] or 0), d))
        text = "+".join(names[:3]) + ("+…" if len(names) > 3 else "")
        q = self.config.quant_method if self.config else None
        if q:
            bits = self.config.quant_bits if self.config else None
            text = f"{q}{f' {bits}-bit' if bits else ''}: {text}"
        return text

    @property
    def parameter_count(self) -> int | None:
        """Elements over every shard; None for packed quantized weights (their shapes count
        words, not parameters), sub-byte dtypes, an unknown dtype or an unread shard."""
        if not self.complete or (self.config is not None and self.config.quant_method):
            return None
        if any(d not in sth.DTYPE_BITS or sth.DTYPE_BITS[d] < 8 for d in self.bytes_by_dtype):
            return None
        return sum(h.n_elements for h in self.headers)


def _read_json(path: str, cap: int) -> tuple[Any, str | None]:
    try:
        with open(path, "rb") as f:
            raw = f.read(cap + 1)
    except OSError as e:
        return None, f"{os.path.basename(path)}: {type(e).__name__}: {e.strerror or e}"
    if len(raw) > cap:
        return None, f"{os.path.basename(path)}: larger than {cap} bytes"
    try:
        return json.loads(raw), None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, f"{os.path.basename(path)}: not JSON"


def _shards(folder: str) -> tuple[list[str], int | None, list[str]]:
    """(shard paths, index total_size, errors) of a model folder."""
    errors: list[str] = []
    index = os.path.join(folder, INDEX_NAME)
    if os.path.exists(index):
        doc, err = _read_json(index, MAX_INDEX_BYTES)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if err or not isinstance(wm, dict):
            return [], None, [err or f"{INDEX_NAME}: no weight_map"]
        meta = doc.get("metadata")
        total = _uint(meta.get("total_size")) if isinstance(meta, dict) else None
        names = sorted({v for v in wm.values() if isinstance(v, str)})
        bad = [n for n in names if "/" in n or n in (".", "..") or not n]
        if bad:
            return [], total, [f"{INDEX_NAME}: shard name {bad[0]!r} is not a file name"]
        if len(names) > MAX_SHARDS:
            return [], total, [f"{INDEX_NAME}: {len(names)} shards, over {MAX_SHARDS}"]
        return [os.path.join(folder, n) for n in names], total, errors
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single], None, errors
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    except OSError as e:
        return [], None, [f"{folder}: {type(e).__name__}: {e.strerror or e}"]
    return [os.path.join(folder, n) for n in names[:MAX_SHARDS]], None, errors


def read_model(path: str, *, file: str | None = None) -> ModelFiles:
    """Read the model at ``path``: a folder (every shard, and its ``config.json``) or one
    safetensors file (its header, and the ``config.json`` beside it). ``file``, for a blob
    path with no name, says which file it is. Never raises: what could not be read is in
    ``errors``."""
    if os.path.isdir(path):
        folder, files, total, errors = path, *_shards(path)
    else:
        folder, files, total, errors = os.path.dirname(path), [path], None, []
    if not files and not errors:
        errors.append("no safetensors files")
    headers = []
    for f in files:
        try:
            headers.append(sth.read_header_cached(f))
        except (OSError, sth.SafetensorsError) as e:
            name = file if file and f == path else os.path.basename(f)
            errors.append(f"{name}: {type(e).__name__}: {e}")
    cfg = None
    cpath = os.path.join(folder, "config.json")
    if os.path.exists(cpath):
        doc, err = _read_json(cpath, MAX_CONFIG_BYTES)
        cfg = parse_config(doc)
        if err or cfg is None:
            errors.append(err or "config.json: not an object")
    return ModelFiles(path, tuple(files), tuple(headers), cfg, total, tuple(errors))


def config_facts(cfg: ModelConfig | None) -> Mapping[str, object]:
    """The config's fields for humans (inspector notes)."""
    if cfg is None:
        return {}
    return {k: getattr(cfg, k) for k in ModelConfig.__slots__ if getattr(cfg, k) is not None}
