"""Cost of the serving-runtime probes (issue 46): safetensors headers, the Hugging Face hub
cache lookups, the vLLM / SGLang / TGI API probes and server detection.

Run: ``uv run python benchmarks/gtm_serving_probes.py``. Prints the median of several runs
per probe. Everything runs on temp files and loopback (the answers of
``packages/gputaskman/tests/runtime_answers.py``); nothing leaves the machine. Numbers on a
shared machine are noisy: compare within one run, not across machines.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from gputaskman.intel import hfcache, hfmodel, hubmodels, serverprobe
from gputaskman.intel import safetensors_header as sth
from gputaskman.intel.evidence import Evidence, Source
from gputaskman.intel.runtimes import detect_server
from safetensors.numpy import save_file

TESTS = Path(__file__).resolve().parent.parent / "packages" / "gputaskman" / "tests"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ans = _load("runtime_answers")


def median_ms(fn: Callable[[], object], runs: int = 9) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def model_folder(folder: Path, layers: int, shards: int) -> None:
    """A folder with a 7B-class model's tensor names (9 per layer), tiny arrays: the header
    size is what a real one's is; the data is not."""
    folder.mkdir(parents=True)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        for t in ("q", "k", "v", "o"):
            names.append(f"model.layers.{i}.self_attn.{t}_proj.weight")
        for t in ("gate", "up", "down"):
            names.append(f"model.layers.{i}.mlp.{t}_proj.weight")
        names += [f"model.layers.{i}.input_layernorm.weight"]
        names += [f"model.layers.{i}.post_attention_layernorm.weight"]
    wm = {}
    for s in range(shards):
        part = {n: np.zeros((4, 4), np.float16) for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, folder / fname)
        wm.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": wm})
    )
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))


def cache_folder(cache: Path, repo: str, src: Path) -> Path:
    storage = cache / hfcache.repo_folder(repo)
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = storage / "snapshots" / commit
    snap.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snap


def serve(routes: dict[str, object]) -> tuple[ThreadingHTTPServer, int]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            body = routes.get(self.path)
            raw = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    rows: list[tuple[str, float]] = []
    for layers, shards in ((28, 4), (80, 30)):
        folder = tmp / f"m{layers}"
        model_folder(folder, layers, shards)
        files = sorted(folder.glob("*.safetensors"))
        size = sum(sth.read_header(f).header_bytes for f in files)
        rows.append(
            (
                f"safetensors header, one shard of {layers} layers / {shards} shards (uncached)",
                median_ms(lambda f=files[0]: sth.read_header(f)),
            )
        )
        sth.clear_cache()
        rows.append(
            (
                f"read_model: {shards} shards, {size // 1024} KiB of headers, uncached",
                median_ms(lambda d=folder: (sth.clear_cache(), hfmodel.read_model(str(d)))),
            )
        )
        hfmodel.read_model(str(folder))
        rows.append(
            (
                f"read_model: {shards} shards, cached",
                median_ms(lambda d=folder: hfmodel.read_model(str(d))),
            )
        )
    cache = tmp / "hub"
    snap = cache_folder(cache, "org/model", tmp / "m80")
    blob = os.path.realpath(snap / "model-00001-of-00030.safetensors")
    cp = hfcache.parse_cache_path(blob)
    assert cp is not None and cp.blob is not None
    rows.append(
        (
            "blob_files (32 files), uncached",
            median_ms(
                lambda: (hfcache._blob_cache.clear(), hfcache.blob_files(cp.repo_dir, cp.blob))
            ),
        )
    )
    rows.append(("blob_files, cached", median_ms(lambda: hfcache.blob_files(cp.repo_dir, cp.blob))))
    rows.append(
        (
            "snapshot_dir (refs/main)",
            median_ms(lambda: hfcache.snapshot_dir([str(cache)], "org/model")),
        )
    )
    evs = [
        Evidence(Source.MAPPED, path=os.path.realpath(p))
        for p in sorted(snap.glob("*.safetensors"))
    ]
    evs.append(Evidence(Source.CMDLINE, model="org/model"))
    rows.append(
        ("fold: 30 mapped blobs + a repo id", median_ms(lambda: hubmodels.fold(evs, [str(cache)])))
    )
    paths = [f"/usr/lib/x86_64-linux-gnu/lib{i}.so.1" for i in range(500)]
    rows.append(
        (
            "detect_server over 500 mapped paths (PyTorch processes only)",
            median_ms(lambda: detect_server("python3", ("python3", "x.py"), paths), 51),
        )
    )
    for name, routes in (
        ("vllm", {"/v1/models": ans.vllm_models(ans.REPO), "/metrics": ans.vllm_metrics()}),
        ("sglang", {"/get_server_info": ans.sglang_server_info(ans.REPO)}),
        ("tgi", {"/info": ans.tgi_info(ans.REPO)}),
    ):
        srv, port = serve(routes)
        sock = serverprobe.ListenSocket("127.0.0.1", port, "tcp")
        rows.append(
            (
                f"probe, {name} table ({len(routes)} GET)",
                median_ms(lambda s=sock, n=name: serverprobe.probe([s], n, timeout=2)),
            )
        )
        if name == "tgi":
            rows.append(
                (
                    "probe, no hint (every table until tgi answers)",
                    median_ms(lambda s=sock: serverprobe.probe([s], None, timeout=2)),
                )
            )
        srv.shutdown()
    for what, ms in rows:
        print(f"{ms:9.3f} ms  {what}")


if __name__ == "__main__":
    main()
