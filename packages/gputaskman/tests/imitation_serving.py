"""An IMITATION of a serving runtime's process (vLLM, SGLang, text-generation-inference), for
end-to-end tests; it is none of them.

The test copies this file under the runtime's program name (``.../bin/vllm``,
``.../bin/text-generation-launcher``) and runs it with the runtime's command line, so
``/proc/PID/cmdline`` reads as the real one's (``python .../vllm serve Qwen/X --port 0``).
What it does comes from the JSON file named by the environment variable ``GTM_IMITATION``
(gputaskman never reads another process's environment):

* ``hold``: files it opens with safetensors' own ``safe_open`` and keeps open, so they are in
  its memory map as a loaded model's shards are;
* ``routes``: ``{path: body}`` it answers to GET on a loopback port (JSON, or text for a
  string), printing ``listening <port>`` once it accepts; no ``routes``, no port;
* ``title``: the name it gives itself (``prctl(PR_SET_NAME)``, what setproctitle does for
  ``VLLM::EngineCore``);
* ``children``: specs of the same kind for children it starts (an engine core that holds the
  weights and does not listen; TGI's shard and router beside each other), each run as its
  ``argv`` (default: this file through ``python -c``, as multiprocessing's spawn starts a
  child) and printed as ``child <pid>``;
* ``requests_log``: a file it appends each request's method and path to.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _title(name: str) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


def main() -> None:
    spec: dict[str, Any] = json.loads(os.environ["GTM_IMITATION"])
    if spec.get("title"):
        _title(spec["title"])
    from safetensors import safe_open

    held = [safe_open(p, "numpy") for p in spec.get("hold", [])]
    children = []
    for c in spec.get("children", []):
        env = dict(os.environ, GTM_IMITATION=json.dumps(c))
        # by default as multiprocessing's spawn starts vLLM's engine core: ``python -c ...``
        run = f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"
        argv = c.get("argv") or [sys.executable, "-c", run, "--multiprocessing-fork"]
        children.append(subprocess.Popen(argv, env=env))
        print(f"child {children[-1].pid}", flush=True)
    routes = spec.get("routes")
    if not routes:
        print("ready", flush=True)
        while True:
            time.sleep(3600)
    log = spec.get("requests_log")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _answer(self) -> None:
            if log:
                with open(log, "a") as f:
                    f.write(f"{self.command} {self.path}\n")
            body = routes.get(self.path)
            code = 200 if body is not None else 404
            raw = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = _answer
        do_POST = _answer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"listening {srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    finally:
        del held
        for c in children:
            c.terminate()


if __name__ == "__main__":
    main()
