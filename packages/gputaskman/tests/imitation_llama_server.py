"""An IMITATION of llama.cpp's llama-server, for end-to-end tests (not llama.cpp).

``python imitation_llama_server.py -m MODEL.gguf --port P [-c N] [--api-key K] [-v]``

Like the real server (shared/FACTS.md) it memory-maps the model file (one line in
/proc/PID/maps), writes the per-device buffer lines twice to stderr with ``-v`` (a sizing
pass with 0.00 MiB model and KV buffers, then the real values), and answers ``GET /health``,
``/props`` (``model_path``, ``default_generation_settings.n_ctx``), ``/v1/models`` (the model
path as ``id``) and ``/slots``; with ``--api-key`` every endpoint but ``/health`` needs
``Authorization: Bearer <key>``. It prints ``listening <port>`` on stdout once it accepts
connections. It records each request's method in ``--requests-log`` when given.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("-c", "--ctx-size", type=int, default=0)
    ap.add_argument("--api-key")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--requests-log")
    args = ap.parse_args()

    f = open(args.model, "rb")  # noqa: SIM115 - held for the life of the process
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert mapped[:4] == b"GGUF"
    n_ctx = args.ctx_size or 256
    if args.verbose:
        for model, kv in (("0.00", "0.00"), ("0.41", "0.06")):
            sys.stderr.write(f"load_tensors:   CPU_Mapped model buffer size =     {model} MiB\n")
            sys.stderr.write(f"llama_kv_cache:        CPU KV buffer size =     {kv} MiB\n")
            sys.stderr.write("sched_reserve:        CPU compute buffer size =     0.70 MiB\n")
        sys.stderr.flush()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _send(self, code: int, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _record(self) -> None:
            if args.requests_log:
                with open(args.requests_log, "a") as log:
                    log.write(f"{self.command} {self.path}\n")

        def do_GET(self) -> None:
            self._record()
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
                return self._send(401, {"error": {"code": 401, "message": "Invalid API Key"}})
            if self.path == "/props":
                return self._send(
                    200,
                    {
                        "model_path": args.model,
                        "total_slots": 1,
                        "default_generation_settings": {"n_ctx": n_ctx},
                    },
                )
            if self.path == "/v1/models":
                return self._send(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": args.model,
                                "object": "model",
                                "owned_by": "llamacpp",
                                "meta": {"size": os.path.getsize(args.model)},
                            }
                        ],
                    },
                )
            if self.path == "/slots":
                return self._send(200, [{"id": 0, "n_ctx": n_ctx, "is_processing": False}])
            return self._send(404, {"error": {"code": 404, "message": "File Not Found"}})

        def do_POST(self) -> None:
            self._record()
            self._send(405, {})

    srv = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"listening {srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    finally:
        mapped.close()
        f.close()


if __name__ == "__main__":
    main()
