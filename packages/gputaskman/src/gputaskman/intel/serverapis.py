"""What the serving runtimes' documented answers say (sans-io parsers): the `ServedModel` row
every server API becomes, Prometheus text, and the answers of vLLM's ``/metrics``, SGLang's
``/get_server_info`` and text-generation-inference's ``/info``.

Theory of operation
-------------------
Each parser takes a decoded answer (JSON, or Prometheus text) and returns ``(rows, gauges)``:
`ServedModel` rows and float gauges; an answer that is not the documented shape raises
`BadAnswer` with the reason (`serverprobe` ignores it and keeps the reason). Every byte count
or token count in a row is what the runtime itself reports; a parser never fills one in.
A row with neither a name nor a path is about the whole server (vLLM's cache configuration):
`serverprobe` merges it into the models the server names.

Shapes, per runtime (the versions whose source shaped them):

* vLLM ``/metrics`` (v0.10, ``vllm/v1/metrics/loggers.py``): the info metric
  ``vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",
  num_gpu_blocks="27000",...} 1.0`` (every ``CacheConfig`` field as a label) and the gauge
  ``vllm:kv_cache_usage_perc`` (0..1; ``vllm:gpu_cache_usage_perc`` before v0.10, and
  deprecated beside it in v0.10). The KV pool holds ``num_gpu_blocks * block_size`` tokens
  per GPU.
* SGLang ``/get_server_info`` (v0.5, ``srt/entrypoints/http_server.py``): the server
  arguments (``model_path``, ``served_model_name``, ``dtype``, ``kv_cache_dtype``,
  ``mem_fraction_static``, ``context_length``, ...), the scheduler's info
  (``max_total_num_tokens``: the KV pool in tokens) and ``internal_states``, one per
  data-parallel rank, whose ``memory_usage`` gives ``weight`` and ``kvcache`` in GiB rounded
  to 2 decimals and ``token_capacity`` (``srt/managers/scheduler.py`` ``get_internal_state``).
* text-generation-inference ``/info`` (router ``Info``): ``model_id``, ``max_total_tokens``
  (per request); TGI 1.x to 2.0 also ``model_dtype`` (``torch.float16``) and
  ``max_batch_total_tokens`` (the KV token budget of a batch), which TGI 3 dropped (3.2.1
  answers ``model_id``, ``max_input_tokens``, ``max_total_tokens``, ``router``, ``version``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GIB",
    "BadAnswer",
    "ServedModel",
    "parse_prometheus",
    "parse_sglang_server_info",
    "parse_tgi_info",
    "parse_vllm_metrics",
]

GIB = 1 << 30
MAX_LINES = 10_000


class BadAnswer(ValueError):
    """A response that is not the documented shape."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model a server API reports. Byte and token counts are runtime-reported; unknown is
    None. `kv_pool_*` is the runtime's KV-cache pool on one GPU; `kv_used_fraction` how full
    it is (0..1); `mem_fraction` the share of GPU memory the runtime was told to take."""

    name: str | None
    path: str | None = None
    loaded: bool | None = None
    size_bytes: int | None = None  # Ollama "size": the runner's total
    vram_bytes: int | None = None  # Ollama "size_vram"
    weights_bytes: int | None = None  # llama-server meta.size; SGLang memory_usage.weight
    n_params: int | None = None
    n_ctx: int | None = None
    kv_pool_bytes: int | None = None  # SGLang memory_usage.kvcache
    kv_pool_tokens: int | None = None  # vLLM blocks*block_size; SGLang; TGI 1.x
    kv_used_fraction: float | None = None  # vLLM kv_cache_usage_perc
    kv_cache_dtype: str | None = None
    dtype: str | None = None  # the weights' dtype the runtime runs
    mem_fraction: float | None = None  # vLLM gpu_memory_utilization, SGLang mem_fraction_static
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    rounded_gib: bool = False  # byte counts came as GiB rounded to 2 decimals (SGLang)
    version: str | None = None


def uint(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def text(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _fraction(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) and 0.0 <= f <= 1.0 else None


def _gib(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return round(f * GIB) if math.isfinite(f) and 0.0 <= f < 1e9 else None


def _num(s: str) -> float | None:
    try:
        f = float(s)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def parse_prometheus(text_: str, prefixes: Sequence[str]) -> dict[str, float]:
    """Gauge samples whose name starts with one of ``prefixes`` (labels kept in the key)."""
    out: dict[str, float] = {}
    for line in text_.splitlines()[:MAX_LINES]:
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.rpartition(" ")
        if not name or not name.startswith(tuple(prefixes)):
            continue
        val = _num(rest)
        if val is not None:
            out[name.strip()] = val
    if not out:
        raise BadAnswer("no matching metrics")
    return out


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\Z")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def _labels(body: str) -> dict[str, str] | None:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None or m.end() == pos:
            return None
        val = m.group(2).replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        out[m.group(1)] = val
        pos = m.end()
    return out


def samples(text_: str, names: Sequence[str]) -> list[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample named one of ``names`` (bounded lines)."""
    out = []
    for line in text_.splitlines()[:MAX_LINES]:
        if not line.startswith(tuple(names)):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None or m.group(1) not in names:
            continue
        labels = _labels(m.group(2) or "")
        val = _num(m.group(3))
        if labels is not None and val is not None:
            out.append((m.group(1), labels, val))
    return out


def _label_uint(labels: dict[str, str], key: str) -> int | None:
    v = labels.get(key, "")
    return int(v) if v.isdigit() and len(v) < 19 else None


def parse_vllm_metrics(text_: str) -> tuple[list[ServedModel], dict[str, float]]:
    """vLLM's ``/metrics``: every ``vllm:`` gauge, plus a server-wide row with the KV pool
    (``cache_config_info``) and its use (``kv_cache_usage_perc``, one engine only)."""
    gauges = parse_prometheus(text_, ["vllm:"])
    found = samples(
        text_, ["vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
    )
    info = next((lab for n, lab, _ in found if n == "vllm:cache_config_info"), None)
    usage = [v for n, _, v in found if n == "vllm:kv_cache_usage_perc"] or [
        v for n, _, v in found if n == "vllm:gpu_cache_usage_perc"
    ]
    if info is None and not usage:
        return [], gauges
    blocks = _label_uint(info, "num_gpu_blocks") if info else None
    bsize = _label_uint(info, "block_size") if info else None
    util = _num(info.get("gpu_memory_utilization", "")) if info else None
    row = ServedModel(
        None,
        kv_pool_tokens=blocks * bsize if blocks is not None and bsize else None,
        kv_used_fraction=_fraction(usage[0]) if len(usage) == 1 else None,
        kv_cache_dtype=text(info.get("cache_dtype")) if info else None,
        mem_fraction=_fraction(util),
        block_size=bsize,
        num_gpu_blocks=blocks,
    )
    return [row], gauges


def parse_sglang_server_info(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    """SGLang's ``/get_server_info`` (shape in the module docstring)."""
    if not isinstance(doc, dict) or not text(doc.get("model_path")):
        raise BadAnswer("no model_path")
    states = doc.get("internal_states")
    if uint(doc.get("max_total_num_tokens")) is None and not isinstance(states, list):
        raise BadAnswer("no max_total_num_tokens or internal_states")
    mem: dict[str, Any] = {}
    if isinstance(states, list) and len(states) == 1 and isinstance(states[0], dict):
        m = states[0].get("memory_usage")
        mem = m if isinstance(m, dict) else {}
    path = doc["model_path"]
    tokens = uint(doc.get("max_total_num_tokens"))
    served = doc.get("served_model_name")
    row = ServedModel(
        text(served) if isinstance(served, str) else path,
        path if os.path.isabs(path) else None,
        True,
        weights_bytes=_gib(mem.get("weight")),
        n_ctx=uint(doc.get("context_length")),
        kv_pool_bytes=_gib(mem.get("kvcache")),
        kv_pool_tokens=tokens if tokens is not None else uint(mem.get("token_capacity")),
        kv_cache_dtype=text(doc.get("kv_cache_dtype")),
        dtype=text(doc.get("dtype")),
        mem_fraction=_fraction(doc.get("mem_fraction_static")),
        rounded_gib=bool(mem),
        version=text(doc.get("version")),
    )
    return [row], {}


def parse_tgi_info(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    """text-generation-inference's ``/info`` (shape in the module docstring)."""
    if not isinstance(doc, dict) or not text(doc.get("model_id")):
        raise BadAnswer("no model_id")
    if uint(doc.get("max_total_tokens")) is None or not (
        text(doc.get("router")) or text(doc.get("model_device_type")) or text(doc.get("version"))
    ):
        raise BadAnswer("no max_total_tokens with router, device type or version")
    mid = doc["model_id"]
    row = ServedModel(
        mid,
        mid if os.path.isabs(mid) else None,
        True,
        n_ctx=uint(doc.get("max_total_tokens")),
        kv_pool_tokens=uint(doc.get("max_batch_total_tokens")),
        dtype=text(doc.get("model_dtype")),
        version=text(doc.get("version")),
    )
    return [row], {}
