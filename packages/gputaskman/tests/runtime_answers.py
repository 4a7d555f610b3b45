"""The serving runtimes' documented answers, as the versions cited per function give them,
for the loopback imitations of test_serving_runtimes.py and test_serverapis.py."""

from __future__ import annotations

REPO = "gtmtest/Tiny-Qwen2.5"  # a repo id no real cache holds


def vllm_models(root: str, served: str | None = None) -> dict[str, object]:
    """``GET /v1/models`` of vLLM 0.10 (``vllm/entrypoints/openai/protocol.py`` ModelCard):
    ``id`` is the served name, ``root`` the --model value as given."""
    return {
        "object": "list",
        "data": [
            {
                "id": served or root,
                "object": "model",
                "created": 1,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": 4096,
                "permission": [],
            }
        ],
    }


def vllm_metrics(blocks: int = 100, usage: float = 0.25) -> str:
    """``GET /metrics`` of vLLM 0.10 (``vllm/v1/metrics/loggers.py``: ``cache_config_info``
    carries every CacheConfig field as a label; ``kv_cache_usage_perc`` is 0..1)."""
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
        f'cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
        f'num_cpu_blocks="None",num_gpu_blocks="{blocks}",sliding_window="None",'
        f'swap_space_bytes="4294967296"}} 1.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{REPO}"}} {usage}\n'
        f'vllm:num_requests_running{{engine="0",model_name="{REPO}"}} 1.0\n'
    )


def sglang_server_info(model_path: str) -> dict[str, object]:
    """``GET /get_server_info`` of SGLang 0.5 (``srt/entrypoints/http_server.py``: the
    server args, the scheduler info, ``internal_states`` from ``scheduler.py``
    ``get_internal_state`` with ``memory_usage`` in GiB rounded to 2 decimals)."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": model_path,
        "dtype": "auto",
        "kv_cache_dtype": "auto",
        "mem_fraction_static": 0.88,
        "context_length": None,
        "tp_size": 1,
        "max_total_num_tokens": 123456,
        "max_req_input_len": 4090,
        "internal_states": [
            {
                "last_gen_throughput": 0.0,
                "memory_usage": {
                    "weight": 1.25,
                    "kvcache": 2.5,
                    "token_capacity": 123456,
                    "graph": 0.1,
                },
            }
        ],
        "version": "0.5.0",
    }


def tgi_info(model_id: str) -> dict[str, object]:
    """``GET /info`` of text-generation-inference 1.4 (``router/src/lib.rs`` ``Info``, which
    still had ``model_dtype`` and ``max_batch_total_tokens``; TGI 3 dropped both)."""
    return {
        "model_id": model_id,
        "model_sha": None,
        "model_dtype": "torch.bfloat16",
        "model_device_type": "cuda",
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": 128,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_input_length": 1024,
        "max_total_tokens": 2048,
        "waiting_served_ratio": 1.2,
        "max_batch_total_tokens": 32000,
        "max_waiting_tokens": 20,
        "max_batch_size": None,
        "validation_workers": 2,
        "version": "1.4.5",
        "sha": None,
        "docker_label": None,
    }
