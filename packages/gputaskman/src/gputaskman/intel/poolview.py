"""What a serving runtime's own figures add to a model's view: the KV-cache pool it reports
(bytes, or tokens that give bytes with the model's ``config.json``), the weights it reports,
the safetensors weights' estimate, and the runtime's other figures kept beside the parts.

Theory of operation
-------------------
`llm.build_view` asks `weights_readings`, `kv_pool_reading` and `figures` for readings and
puts them where they belong; nothing here is ever added to a measured total.

* Weights: a runtime that reports them (SGLang's ``memory_usage.weight``, llama-server's
  ``meta.size``) is *runtime-reported*; the safetensors headers' total is a fact about the
  files and, in VRAM, an *estimate* (a runtime may convert or quantize on load).
* KV pool: SGLang reports its bytes (``memory_usage.kvcache``); vLLM (``num_gpu_blocks *
  block_size``), SGLang (``max_total_num_tokens``) and TGI 1.x (``max_batch_total_tokens``)
  report tokens, which give bytes with `hfmodel.kv_bytes_per_token` (the model's layers,
  KV heads on this GPU, head size and the cache dtype). The result is *runtime-reported*
  (the runtime sized the pool; the config only converts its unit) and the source says how.
  The cache dtype is the runtime's (``cache_dtype``, ``kv_cache_dtype``); ``auto`` or none
  means the weights' dtype: the runtime's ``--dtype``/reported dtype, else ``config.json``'s
  (vLLM runs a ``float32`` checkpoint in ``float16`` under ``auto``). The tensor-parallel
  size comes from the serving process's command line (``--tensor-parallel-size``,
  ``--tp-size``, ``--num-shard``), 1 when absent.
* Figures: Ollama's ``size_vram`` (the runtime's own figure for the model in VRAM) and
  ``size``, the KV pool in tokens, its use (vLLM ``kv_cache_usage_perc``, and the bytes that
  makes of a pool in bytes) and the share of GPU memory the runtime was told to take.
"""

from __future__ import annotations

from collections.abc import Sequence

from gputaskman.base.procargs import flag_value
from gputaskman.base.readings import Reading
from gputaskman.intel import hfmodel
from gputaskman.intel.serverapis import ServedModel

__all__ = ["TP_FLAGS", "figures", "kv_cache_dtype", "kv_pool_reading", "weights_readings"]

TP_FLAGS = ("--tensor-parallel-size", "-tp", "--tp-size", "--tp", "--num-shard")
_ROUNDED = "GiB to 2 decimals"


def tensor_parallel(argv: Sequence[str]) -> int:
    v = flag_value(argv, TP_FLAGS)
    return int(v) if v and v.isdigit() and 0 < int(v) <= 4096 else 1


def kv_cache_dtype(
    served: ServedModel, argv: Sequence[str], cfg: hfmodel.ModelConfig | None, runtime: str | None
) -> str | None:
    """The KV cache's dtype as the runtime runs it (module docstring), or None."""
    d = served.kv_cache_dtype
    if d and d != "auto":
        return d
    for model in (served.dtype, flag_value(argv, ("--dtype",))):
        if model and model != "auto":
            return model
    cd = cfg.dtype if cfg is not None else None
    if runtime == "vllm" and cd in ("float32", "torch.float32"):
        return "float16"
    return cd


def weights_readings(
    served: ServedModel | None, runtime: str | None, files: hfmodel.ModelFiles | None
) -> tuple[list[Reading], list[tuple[Reading, bool]]]:
    """(runtime-reported, estimated with whether all inputs were known) weights readings."""
    rt: list[Reading] = []
    est: list[tuple[Reading, bool]] = []
    if served is not None and served.weights_bytes is not None:
        src = (
            f"{runtime} API memory_usage.weight ({_ROUNDED})"
            if served.rounded_gib
            else f"{runtime} API model size"
        )
        rt.append(Reading.runtime(served.weights_bytes, src))
    if files is not None:
        wb = files.weights_bytes
        n = len(files.files)
        if wb is not None:
            src = f"safetensors headers ({n} file{'s' if n != 1 else ''})"
            est.append((Reading.estimated(wb, src), True))
        elif files.index_total is not None:
            est.append(
                (
                    Reading.estimated(files.index_total, "model.safetensors.index.json total_size"),
                    False,
                )
            )
    return rt, est


def kv_pool_reading(
    served: ServedModel | None,
    runtime: str | None,
    files: hfmodel.ModelFiles | None,
    argv: Sequence[str],
) -> tuple[Reading | None, list[str]]:
    """The runtime's KV pool on this GPU in bytes, and notes on what could not be had."""
    if served is None:
        return None, []
    if served.kv_pool_bytes is not None:
        return Reading.runtime(
            served.kv_pool_bytes, f"{runtime} API memory_usage.kvcache ({_ROUNDED})"
        ), []
    tokens = served.kv_pool_tokens
    if tokens is None:
        return None, []
    cfg = files.config if files is not None else None
    dtype = kv_cache_dtype(served, argv, cfg, runtime)
    tp = tensor_parallel(argv)
    per, how = hfmodel.kv_bytes_per_token(cfg, dtype, tp)
    if per is None:
        return None, [f"{runtime} KV pool of {tokens} tokens: no bytes ({how})"]
    what = (
        f"{served.num_gpu_blocks} blocks x {served.block_size}"
        if served.num_gpu_blocks is not None and served.block_size
        else f"{tokens}"
    )
    return Reading.runtime(
        tokens * per, f"{runtime} KV pool {what} tokens x {per} B/token ({how})"
    ), []


def figures(
    served: ServedModel | None, runtime: str | None, kv_pool: Reading | None
) -> tuple[tuple[str, Reading], ...] | None:
    """The runtime's other figures, each a runtime-reported reading (never summed); None
    when no runtime answered for the model, () when it answered with none of them."""
    if served is None:
        return None
    out: list[tuple[str, Reading]] = []
    api = f"{runtime} API"
    if served.vram_bytes is not None:
        out.append(("model_vram_bytes", Reading.runtime(served.vram_bytes, f"{api} size_vram")))
    if served.size_bytes is not None:
        out.append(("model_size_bytes", Reading.runtime(served.size_bytes, f"{api} size")))
    if served.kv_pool_tokens is not None:
        out.append(("kv_pool_tokens", Reading.runtime(served.kv_pool_tokens, f"{api} KV pool")))
    frac = served.kv_used_fraction
    if frac is not None:
        src = f"{api} kv_cache_usage_perc"
        out.append(("kv_used_percent", Reading.runtime(round(frac * 100, 2), src)))
        if kv_pool is not None and kv_pool.value is not None:
            used = round(int(kv_pool.value) * frac)
            out.append(("kv_used_bytes", Reading.runtime(used, f"KV pool x {src}")))
    if served.mem_fraction is not None:
        src = f"{api} " + (
            "mem_fraction_static" if runtime == "sglang" else "gpu_memory_utilization"
        )
        out.append(
            (
                "gpu_memory_fraction_percent",
                Reading.runtime(round(served.mem_fraction * 100, 4), src),
            )
        )
    return tuple(out)
