"""Real GGUF files for tests, written with the `gguf` package's GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf as ggufpkg
import numpy as np

Q = ggufpkg.GGMLQuantizationType


def write_model(
    path: Path,
    arch: str,
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int | list[int] | None,
    ctx: int,
    key_length: int | None = None,
    sliding_window: int | None = None,
    name: str = "Test Model",
    file_type: int = 7,
    vocab: int = 32,
    endianess: ggufpkg.GGUFEndian = ggufpkg.GGUFEndian.LITTLE,
) -> dict[str, int]:
    """Write a small real model; return the parameter count and data bytes it wrote."""
    w = ggufpkg.GGUFWriter(str(path), arch, endianess=endianess)
    w.add_name(name)
    w.add_block_count(n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_head_count(n_head)
    if n_head_kv is not None:
        w.add_head_count_kv(n_head_kv)
    if key_length is not None:
        w.add_key_length(key_length)
        w.add_value_length(key_length)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    w.add_file_type(file_type)
    w.add_token_list([f"tok{i}".encode() for i in range(vocab)])
    rng = np.random.default_rng(0)
    params = 0
    nbytes = 0

    def add(tname: str, shape: tuple[int, int], qtype: ggufpkg.GGMLQuantizationType) -> None:
        nonlocal params, nbytes
        data = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            arr = data
            w.add_tensor(tname, arr)
        elif qtype == Q.F16:
            arr = data.astype(np.float16)
            w.add_tensor(tname, arr)
        else:
            arr = ggufpkg.quants.quantize(data, qtype)
            w.add_tensor(tname, arr, raw_dtype=qtype)
        params += shape[0] * shape[1]
        nbytes += arr.nbytes

    add("token_embd.weight", (vocab, n_embd), Q.F16)
    for il in range(n_layer):
        add(f"blk.{il}.attn_q.weight", (n_embd, n_embd), Q.Q8_0)
        add(f"blk.{il}.ffn_up.weight", (n_embd, n_embd), Q.Q4_0)
        add(f"blk.{il}.attn_norm.weight", (1, n_embd), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"params": params, "bytes": nbytes}
