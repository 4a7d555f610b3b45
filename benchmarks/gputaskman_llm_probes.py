"""Cost of each model-naming / LLM-detail probe (gguf, stores, llm, serverprobe, apps).

Run: ``uv run python benchmarks/gputaskman_llm_probes.py``. Prints the median of several runs
per probe. Everything runs on loopback and temp files; nothing leaves the machine. Numbers
on a shared machine are noisy: compare within one run, not across machines.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf as ggufpkg
import numpy as np
from gputaskman.intel import apps, gguf, llm, serverprobe, stores


def median_ms(fn: Callable[[], object], runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def big_gguf(path: Path, n_tensors: int, vocab: int) -> None:
    w = ggufpkg.GGUFWriter(str(path), "llama")
    w.add_block_count(n_tensors // 10)
    w.add_context_length(4096)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_token_list([f"token-{i}".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_array("tokenizer.ggml.merges", [f"a{i} b{i}" for i in range(vocab)])
    t = np.zeros((1, 32), dtype=np.float32)
    for i in range(n_tensors):
        w.add_tensor(f"blk.{i // 10}.t{i % 10}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # --- GGUF header: our bounded reader vs gguf.GGUFReader
        for n_tensors, vocab in ((300, 32_000), (3_000, 152_000)):
            p = tmp / f"m{n_tensors}.gguf"
            big_gguf(p, n_tensors, vocab)
            size_mib = p.stat().st_size / 2**20
            label = f"{n_tensors} tensors, {vocab} vocab, {size_mib:.1f} MiB"
            rows.append(
                (
                    f"gguf.read_header ({label})",
                    median_ms(lambda p=p: gguf.read_header(p), 5),
                    "uncached",
                )
            )
            rows.append(
                (
                    f"gguf.GGUFReader ({label})",
                    median_ms(lambda p=p: ggufpkg.GGUFReader(str(p)), 3),
                    "reference",
                )
            )
            gguf.read_header_cached(p)
            rows.append(
                (
                    f"gguf.read_header_cached ({label})",
                    median_ms(lambda p=p: gguf.read_header_cached(p), 50),
                    "cache hit",
                )
            )
        # --- store index: 200 Ollama manifests, HF and LM Studio lookups
        root = tmp / "ollama"
        for i in range(200):
            content = f"blob{i}".encode()
            hexd = hashlib.sha256(content).hexdigest()
            (root / "blobs").mkdir(parents=True, exist_ok=True)
            (root / "blobs" / f"sha256-{hexd}").write_bytes(content)
            m = root / "manifests" / "registry.ollama.ai" / "library" / f"model{i}" / "latest"
            m.parent.mkdir(parents=True)
            m.write_text(
                json.dumps(
                    {
                        "layers": [
                            {
                                "mediaType": "application/vnd.ollama.image.model",
                                "digest": f"sha256:{hexd}",
                            }
                        ]
                    }
                )
            )
        idx = stores.StoreIndex(stores.StoreRoots(ollama=(str(root),)))
        rows.append(
            (
                "stores: Ollama index build (200 manifests)",
                median_ms(lambda: idx.refresh(force=True), 5),
                "every ttl (60 s)",
            )
        )
        blob = next((root / "blobs").iterdir())
        rows.append(
            (
                "stores: name_for (index built)",
                median_ms(lambda: idx.name_for(str(blob)), 200),
                "per path",
            )
        )
        # --- buffer log: 10 MiB log, buffer lines at the head
        log = tmp / "server.log"
        lines = (
            "load_tensors:   CPU_Mapped model buffer size =     0.41 MiB\n"
            "llama_kv_cache:        CPU KV buffer size =     0.06 MiB\n"
            "sched_reserve:        CPU compute buffer size =     0.70 MiB\n"
        )
        log.write_text(lines + "srv  log_server_r: request: GET /health 127.0.0.1 200\n" * 200_000)

        def uncached_log() -> None:
            llm._log_cache.clear()
            llm.read_buffer_log(str(log))

        rows.append(
            ("llm.read_buffer_log (10 MiB log, head+tail)", median_ms(uncached_log, 5), "uncached")
        )
        rows.append(
            (
                "llm.read_buffer_log (unchanged file)",
                median_ms(lambda: llm.read_buffer_log(str(log)), 50),
                "stat + cache hit",
            )
        )
        # --- listening-port discovery on this process with 100 open sockets
        socks = []
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            socks.append(s)
            socks.append(socket.socket())
        rows.append(
            (
                "serverprobe.listening_sockets (100 sockets)",
                median_ms(lambda: serverprobe.listening_sockets(os.getpid()), 20),
                "per pid",
            )
        )
        for s in socks:
            s.close()
        # --- one HTTP probe against an imitation llama-server on loopback
        props = json.dumps(
            {"model_path": "/m.gguf", "default_generation_settings": {"n_ctx": 4096}}
        ).encode()

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                body = props if self.path == "/props" else b"{}"
                self.send_response(200 if self.path == "/props" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        sock = serverprobe.ListenSocket("127.0.0.1", srv.server_address[1], "tcp")
        rows.append(
            (
                "serverprobe: one GET /props (imitation, loopback)",
                median_ms(lambda: serverprobe._get(sock.host, sock.port, "/props", 0.5, None), 20),
                "per request",
            )
        )
        rows.append(
            (
                "serverprobe.probe llama.cpp table (4 GETs)",
                median_ms(lambda: serverprobe.probe([sock], "llama.cpp"), 10),
                "off the UI thread",
            )
        )
        srv.shutdown()
        srv.server_close()
        # --- Handy adapter
        home = tmp / "home"
        base = home / ".local/share/com.pais.handy"
        (base / "logs").mkdir(parents=True)
        (base / "settings_store.json").write_text(
            json.dumps({"settings": {"selected_model": "small"}})
        )
        (base / "logs" / "handy.log").write_text(
            "[2026-11-29][10:00:00][x][INFO] Recording started\n"
            * 20_000
            + "[2026-11-29][10:00:01][x][DEBUG] Successfully loaded transcription model: small"
            " (took 5ms)\n"
        )
        env = {"HOME": str(home)}

        def handy_uncached() -> None:
            apps._log_cache.clear()
            apps.read_app_model(apps.APPS[0], env=env, platform="linux")

        rows.append(
            ("apps: Handy settings + 256 KiB log tail", median_ms(handy_uncached, 5), "uncached")
        )
        rows.append(
            (
                "apps: Handy (unchanged files)",
                median_ms(lambda: apps.read_app_model(apps.APPS[0], env=env, platform="linux"), 50),
                "settings read + log cache hit",
            )
        )
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    width = max(len(r[0]) for r in rows)
    for name, ms, note in rows:
        print(f"{name:<{width}}  {ms:9.3f} ms  {note}")


if __name__ == "__main__":
    main()
