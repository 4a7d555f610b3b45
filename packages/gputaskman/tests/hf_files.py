"""Real model files for tests: safetensors files written by the ``safetensors`` library (numpy
backend), model folders with a ``config.json`` as transformers writes one, and Hugging Face hub
cache entries laid out by huggingface_hub's own download code (blob, snapshot symlink, ref).

The cache helper calls the functions ``hf_hub_download`` uses to store a downloaded file
(``repo_folder_name``, ``_get_pointer_path``, ``_create_symlink``,
``_cache_commit_hash_for_specific_revision``), so the layout is the library's, not a copy of
it; a huggingface_hub without them makes the caller skip.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

QWEN_LIKE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def tensors(n_layers: int = 2, hidden: int = 64, dtype: Any = np.float16) -> dict[str, Any]:
    """A small decoder's worth of named arrays (zeros), in `dtype`."""
    out = {"model.embed_tokens.weight": np.zeros((128, hidden), dtype)}
    for i in range(n_layers):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = np.zeros((hidden, hidden), dtype)
        out[f"model.layers.{i}.mlp.down_proj.weight"] = np.zeros((hidden, 2 * hidden), dtype)
        out[f"model.layers.{i}.input_layernorm.weight"] = np.ones((hidden,), np.float32)
    return out


def nbytes(arrays: dict[str, Any]) -> int:
    return sum(int(a.nbytes) for a in arrays.values())


def write_model_dir(
    folder: Path, *, shards: int = 1, config: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """A model folder: ``config.json`` and one ``model.safetensors``, or ``shards`` files
    with ``model.safetensors.index.json`` (as transformers' save_pretrained writes them).
    Returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = tensors(**kw)
    (folder / "config.json").write_text(json.dumps(config or QWEN_LIKE))
    if shards == 1:
        save_file(arrays, folder / "model.safetensors", metadata={"format": "pt"})
        return arrays
    names = sorted(arrays)
    weight_map = {}
    for s in range(shards):
        part = {n: arrays[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": nbytes(arrays)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return arrays


def cache_model(
    cache: Path, repo_id: str, source: Path, commit: str | None = None, revision: str = "main"
) -> Path:
    """Put every file of the folder ``source`` into the hub cache ``cache`` as
    ``hf_hub_download`` stores a download: the bytes in ``blobs/<sha256>``, a relative
    symlink in ``snapshots/<commit>/``, ``refs/<revision>``. Returns the snapshot folder."""
    fd = pytest.importorskip("huggingface_hub.file_download")
    needed = (
        "repo_folder_name",
        "_get_pointer_path",
        "_create_symlink",
        "_cache_commit_hash_for_specific_revision",
    )
    if not all(hasattr(fd, n) for n in needed):
        pytest.skip("this huggingface_hub lacks the cache-writing functions the helper uses")
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    storage = os.path.join(cache, fd.repo_folder_name(repo_id=repo_id, repo_type="model"))
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = os.path.join(storage, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        if not os.path.exists(blob):
            Path(blob).write_bytes(data)
        pointer = fd._get_pointer_path(storage, commit, f.name)
        os.makedirs(os.path.dirname(pointer), exist_ok=True)
        fd._create_symlink(blob, pointer, new_blob=False)
    fd._cache_commit_hash_for_specific_revision(storage, revision, commit)
    return Path(storage) / "snapshots" / commit
