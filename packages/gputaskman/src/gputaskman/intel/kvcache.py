"""llama.cpp's KV cache estimated from a GGUF header (`kv_cache_estimate`): how many bytes
its K and V tensors take for a context size and cache types, with sliding-window layers laid
out as llama.cpp lays them out.

Formulas (all from llama.cpp; ``ggml_row_size(t, n) = n * type_size(t) / block_size(t)``, with
`gguf.GGML_TYPES`)
--------------------------------------------------------------------------------------------
* KV cache (``src/llama-kv-cache.cpp``: one K and one V tensor per layer that has KV heads,
  ``ggml_new_tensor_3d(type, n_embd_{k,v}_gqa(il), kv_size, n_stream)``), with
  ``src/llama-hparams.cpp``: ``n_embd_k_gqa(il) = n_embd_head_k * n_head_kv(il)``::

      bytes = sum over layers il with n_head_kv(il) > 0 of
              cells(il) * (row_size(type_k, key_length * n_head_kv(il))
                         + row_size(type_v, value_length * n_head_kv(il)))

  ``key_length``/``value_length`` default to ``embedding_length / head_count``;
  ``head_count_kv`` defaults to ``head_count`` and may be a per-layer array. Cache types:
  f16 = 2 bytes per element, q8_0 = 34 bytes per 32 elements, q4_0 = 18 bytes per 32.
* Sliding-window layers (``src/llama-kv-cache-iswa.cpp``): SWA layers get their own cache of
  ``cells = GGML_PAD(min(n_ctx, n_swa * n_seq + n_ubatch), 256)`` (all of ``n_ctx`` with
  ``--swa-full``); other layers get ``n_ctx`` cells. Which layers slide comes from
  ``llama_hparams::set_swa_pattern(n)``: layer ``il`` slides iff ``il % n < n - 1``.
  Architectures honoured (``src/llama-model.cpp`` ``load_hparams``): ``gemma2`` (pattern 2,
  window from ``gemma2.attention.sliding_window``, default 4096), ``gemma3`` (pattern 6),
  ``gemma3n`` (pattern 5) and ``cohere2`` (pattern 4), each with the window from
  ``<arch>.attention.sliding_window``. Other architectures are computed as full attention;
  the estimate says so in ``notes``.
* ``n_ctx`` is the runtime's context size when the caller knows it (``/props``, ``-c``),
  else the header's ``context_length`` (the training context), and the result says which.
  llama.cpp may pad ``n_ctx`` up (to 256); we do not guess the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gputaskman.intel.gguf import GGML_TYPES, GGUFHeader

KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
_TYPE_BY_NAME = {name.lower(): tid for tid, (name, _, _) in GGML_TYPES.items()}

# Architectures whose sliding-window layers llama.cpp lays out with set_swa_pattern(n):
# arch -> (pattern n, default window or None when the key is required).
SWA_ARCHS: dict[str, tuple[int, int | None]] = {
    "gemma2": (2, 4096),
    "gemma3": (6, None),
    "gemma3n": (5, None),
    "cohere2": (4, None),
}


@dataclass(frozen=True, slots=True)
class KvEstimate:
    """An *estimate* of llama.cpp's KV cache for one header and context size."""

    cache_type_k: str
    cache_type_v: str
    n_ctx: int
    n_ctx_source: str  # "runtime" (given by the caller) or "header context_length"
    bytes: int
    full_layers: int
    swa_layers: int
    swa_cells: int | None
    notes: tuple[str, ...] = ()


def _row_size(type_name: str, n: int) -> int:
    tid = _TYPE_BY_NAME.get(type_name.lower())
    if tid is None or type_name.lower() not in KV_CACHE_TYPES:
        raise ValueError(f"KV cache type must be one of {KV_CACHE_TYPES}, not {type_name!r}")
    _, blck, size = GGML_TYPES[tid]
    return -(-n // blck) * size


def _uint(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def kv_cache_estimate(
    header: GGUFHeader,
    n_ctx: int | None = None,
    cache_type_k: str = "f16",
    cache_type_v: str | None = None,
    *,
    n_seq: int = 1,
    n_ubatch: int = 512,
    swa_full: bool = False,
) -> KvEstimate | None:
    """Estimate llama.cpp's KV-cache bytes (formula in the module docstring).

    Returns None when the header lacks what the formula needs (no architecture, block count,
    head count or embedding length, or no context size at all).
    """
    cache_type_v = cache_type_v or cache_type_k
    _row_size(cache_type_k, 1), _row_size(cache_type_v, 1)  # validate early
    n_layer = _uint(header.arch_value("block_count"))
    n_head_raw = header.arch_value("attention.head_count")
    n_head = _uint(n_head_raw[0] if isinstance(n_head_raw, list) and n_head_raw else n_head_raw)
    n_embd = _uint(header.arch_value("embedding_length"))
    notes: list[str] = []
    source = "runtime"
    if n_ctx is None:
        n_ctx = _uint(header.arch_value("context_length"))
        source = "header context_length"
    if not n_layer or not n_ctx or n_head is None:
        return None
    kv_raw = header.arch_value("attention.head_count_kv")
    if isinstance(kv_raw, list):
        if len(kv_raw) != n_layer or any(_uint(x) is None for x in kv_raw):
            return None
        heads_kv = [int(x) for x in kv_raw]
    else:
        one = _uint(kv_raw) if kv_raw is not None else n_head
        if one is None:
            return None
        heads_kv = [one] * n_layer
    head_k = _uint(header.arch_value("attention.key_length"))
    head_v = _uint(header.arch_value("attention.value_length"))
    if head_k is None or head_v is None:
        if not n_embd or not n_head:
            return None
        head_k = head_k if head_k is not None else n_embd // n_head
        head_v = head_v if head_v is not None else n_embd // n_head

    arch = header.architecture or ""
    swa = [False] * n_layer
    n_swa: int | None = None
    if arch in SWA_ARCHS:
        pattern, default_window = SWA_ARCHS[arch]
        n_swa = _uint(header.arch_value("attention.sliding_window")) or default_window
        if n_swa:
            swa = [il % pattern < pattern - 1 for il in range(n_layer)]
        else:
            notes.append(f"{arch} declares no sliding_window: all layers full attention")
    else:
        notes.append(f"no sliding-window layout known for {arch!r}: all layers full attention")
    swa_cells = None
    if n_swa and any(swa):
        swa_cells = n_ctx if swa_full else -(-min(n_ctx, n_swa * n_seq + n_ubatch) // 256) * 256
    total = 0
    for il in range(n_layer):
        if heads_kv[il] == 0:
            continue  # recurrent / KV-less layer
        cells = swa_cells if swa[il] and swa_cells is not None else n_ctx
        total += cells * (
            _row_size(cache_type_k, head_k * heads_kv[il])
            + _row_size(cache_type_v, head_v * heads_kv[il])
        )
    n_swa_layers = sum(1 for il in range(n_layer) if swa[il] and heads_kv[il])
    return KvEstimate(
        cache_type_k=cache_type_k.lower(),
        cache_type_v=cache_type_v.lower(),
        n_ctx=n_ctx,
        n_ctx_source=source,
        bytes=total,
        full_layers=sum(1 for h in heads_kv if h) - n_swa_layers,
        swa_layers=n_swa_layers,
        swa_cells=swa_cells,
        notes=tuple(notes),
    )
