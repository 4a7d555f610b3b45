"""llm.py and serverprobe.py.

The HTTP servers here are IMITATIONS on loopback that answer with each runtime's documented
response shapes (llama-server, Ollama, LM Studio, vLLM); none is the real runtime. The
end-to-end test starts ``imitation_llama_server.py`` as a real process that maps a real GGUF
file and listens on a port, then finds it the way the collector will.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest
from gputaskman.base.readings import Kind
from gputaskman.intel import gguf, kvcache, llm, procinfo
from gputaskman.intel.evidence import Evidence, Source, api_key_from_argv, assess, from_procinfo
from gputaskman.intel.serverprobe import ListenSocket, ServerProber, listening_sockets, probe
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = Path(__file__).parent


def _load_helper(name: str) -> ModuleType:
    """Load a helper module beside this file (tests are not a package here)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


write_model = _load_helper("gguf_files").write_model

# ----------------------------------------------------------------- imitation HTTP servers

Route = Callable[[BaseHTTPRequestHandler], tuple[int, bytes] | None]


class Imitation:
    """A loopback HTTP server answering fixed bodies per path; records method and headers."""

    def __init__(
        self,
        routes: dict[str, object],
        delay: threading.Event | None = None,
        require_bearer: str | None = None,
    ) -> None:
        self.requests: list[tuple[str, str, str | None]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _answer(self) -> None:
                outer.requests.append((self.command, self.path, self.headers.get("Authorization")))
                if delay is not None:
                    delay.wait(10)
                if (
                    require_bearer
                    and self.headers.get("Authorization") != f"Bearer {require_bearer}"
                ):
                    code, body = 401, b'{"error": "unauthorized"}'
                elif self.path in routes:
                    r = routes[self.path]
                    code, body = (200, r) if isinstance(r, bytes) else (200, json.dumps(r).encode())
                else:
                    code, body = 404, b"{}"
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout tests)

            do_GET = _answer
            do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def socket(self) -> ListenSocket:
        return ListenSocket("127.0.0.1", self.port, "tcp")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def imitation() -> Iterator[Callable[..., Imitation]]:
    made: list[Imitation] = []

    def make(routes: dict[str, object], **kw: object) -> Imitation:
        srv = Imitation(routes, **kw)  # type: ignore[arg-type]
        made.append(srv)
        return srv

    yield make
    for s in made:
        s.close()


# Shapes from each runtime's API documentation.
LLAMA_PROPS = {
    "model_path": "/models/qwen.gguf",
    "total_slots": 1,
    "default_generation_settings": {"n_ctx": 4096, "params": {}},
}
LLAMA_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "/models/qwen.gguf",
            "object": "model",
            "owned_by": "llamacpp",
            "created": 1,
            "meta": {"n_params": 494032768, "size": 531000000, "n_ctx_train": 32768},
        }
    ],
}
LLAMA_METRICS = (
    b"# HELP llamacpp:kv_cache_usage_ratio KV-cache usage.\n"
    b"# TYPE llamacpp:kv_cache_usage_ratio gauge\n"
    b"llamacpp:kv_cache_usage_ratio 0.25\nllamacpp:requests_processing 1\n"
)
OLLAMA_PS = {
    "models": [
        {
            "name": "llama3.2:3b",
            "model": "llama3.2:3b",
            "size": 3400000000,
            "digest": "a80c4f17acd5",
            "details": {"format": "gguf", "quantization_level": "Q4_K_M"},
            "expires_at": "2026-11-29T19:00:00Z",
            "size_vram": 3000000000,
            "context_length": 4096,
        }
    ]
}
OLLAMA_TAGS = {
    "models": [
        {
            "name": "llama3.2:3b",
            "model": "llama3.2:3b",
            "size": 2019393189,
            "digest": "a80c4f17acd5",
        },
        {"name": "qwen3:8b", "model": "qwen3:8b", "size": 5200000000},
    ]
}
LMSTUDIO = {
    "object": "list",
    "data": [
        {
            "id": "qwen2.5-7b-instruct",
            "object": "model",
            "type": "llm",
            "publisher": "lmstudio",
            "arch": "qwen2",
            "compatibility_type": "gguf",
            "quantization": "Q4_K_M",
            "state": "loaded",
            "max_context_length": 32768,
            "loaded_context_length": 8192,
        },
        {
            "id": "gemma-3-4b",
            "object": "model",
            "type": "vlm",
            "state": "not-loaded",
            "max_context_length": 131072,
        },
    ],
}
VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "Qwen/Qwen2.5-1.5B-Instruct",
            "object": "model",
            "owned_by": "vllm",
            "root": "/srv/qwen",
            "parent": None,
            "max_model_len": 32768,
        }
    ],
}
VLLM_METRICS = (
    b"# TYPE vllm:gpu_cache_usage_perc gauge\n"
    b'vllm:gpu_cache_usage_perc{model_name="Qwen/Qwen2.5-1.5B-Instruct"} 0.1\n'
    b'vllm:num_requests_running{model_name="Qwen/Qwen2.5-1.5B-Instruct"} 2.0\n'
)


def test_llama_server_imitation_with_api_key(imitation: Callable[..., Imitation]) -> None:
    srv = imitation(
        {
            "/props": LLAMA_PROPS,
            "/v1/models": LLAMA_MODELS,
            "/metrics": LLAMA_METRICS,
            "/slots": [{"id": 0, "n_ctx": 4096}],
        },
        require_bearer="k3y",
    )
    r = probe([srv.socket], "llama.cpp", api_key="k3y", timeout=2)
    assert r.runtime == "llama.cpp" and r.endpoint == f"127.0.0.1:{srv.port}"
    (m,) = r.models
    assert (m.path, m.n_ctx, m.weights_bytes, m.n_params) == (
        "/models/qwen.gguf",
        4096,
        531000000,
        494032768,
    )
    assert r.gauges["llamacpp:kv_cache_usage_ratio"] == 0.25 and r.gauges["slots"] == 1
    assert {meth for meth, _, _ in srv.requests} == {"GET"}
    assert all(auth == "Bearer k3y" for _, _, auth in srv.requests)
    no_key = probe([srv.socket], "llama.cpp", timeout=2)
    assert not no_key.ok and any("HTTP 401" in e for e in no_key.errors)


def test_ollama_imitation(imitation: Callable[..., Imitation]) -> None:
    srv = imitation({"/api/ps": OLLAMA_PS, "/api/tags": OLLAMA_TAGS})
    r = probe([srv.socket], "ollama", timeout=2)
    loaded = [m for m in r.models if m.loaded]
    assert [(m.name, m.size_bytes, m.vram_bytes, m.n_ctx) for m in loaded] == [
        ("llama3.2:3b", 3400000000, 3000000000, 4096)
    ]
    installed = [m for m in r.models if m.loaded is False]
    assert [m.name for m in installed] == ["qwen3:8b"]
    ev = r.evidence()
    assert [(e.source, e.model) for e in ev] == [(Source.API, "llama3.2:3b")]


def test_lmstudio_imitation(imitation: Callable[..., Imitation]) -> None:
    r = probe([imitation({"/api/v0/models": LMSTUDIO}).socket], "lmstudio", timeout=2)
    assert [(m.name, m.loaded, m.n_ctx) for m in r.models] == [
        ("qwen2.5-7b-instruct", True, 8192),
        ("gemma-3-4b", False, None),
    ]
    assert [e.model for e in r.evidence()] == ["qwen2.5-7b-instruct"]


def test_vllm_imitation_and_autodetect(imitation: Callable[..., Imitation]) -> None:
    srv = imitation({"/v1/models": VLLM_MODELS, "/metrics": VLLM_METRICS})
    r = probe([srv.socket], None, timeout=2)  # no hint: tries each table
    assert r.runtime == "vllm"
    assert [(m.name, m.path, m.n_ctx) for m in r.models] == [
        ("Qwen/Qwen2.5-1.5B-Instruct", "/srv/qwen", 32768)
    ]
    assert r.gauges['vllm:num_requests_running{model_name="Qwen/Qwen2.5-1.5B-Instruct"}'] == 2.0


def test_llama_server_is_not_mistaken_for_vllm(imitation: Callable[..., Imitation]) -> None:
    srv = imitation({"/v1/models": LLAMA_MODELS})  # /props missing, /v1/models present
    r = probe([srv.socket], "vllm", timeout=2)
    assert not r.ok and any("owned_by vllm" in e for e in r.errors)


@pytest.mark.parametrize(
    "routes,reason",
    [
        ({"/props": b"{not json"}, "ignored"),
        ({"/props": [1, 2]}, "no model_path"),
        ({"/props": {"model_path": None}}, "no model_path"),
        ({"/props": {"model_path": 7}}, "no model_path"),
        ({"/props": b"\xff\xfe"}, "ignored"),
        ({}, "HTTP 404"),
    ],
)
def test_malformed_answers_are_ignored_with_a_reason(
    imitation: Callable[..., Imitation], routes: dict[str, object], reason: str
) -> None:
    r = probe([imitation(routes).socket], "llama.cpp", timeout=2)
    assert not r.ok and r.models == ()
    assert any(reason in e for e in r.errors), r.errors


def test_malformed_optional_endpoint_keeps_the_good_ones(
    imitation: Callable[..., Imitation],
) -> None:
    srv = imitation(
        {
            "/props": LLAMA_PROPS,
            "/slots": {"not": "a list"},
            "/v1/models": {"data": [None, {"id": 5}]},
            "/metrics": b"garbage",
        }
    )
    r = probe([srv.socket], "llama.cpp", timeout=2)
    assert r.ok and [m.path for m in r.models] == ["/models/qwen.gguf"]
    assert len(r.errors) == 3 and all("ignored" in e for e in r.errors)


def test_oversized_body_is_ignored(imitation: Callable[..., Imitation]) -> None:
    big = json.dumps({"model_path": "/m.gguf", "pad": "x" * (2 * 1024 * 1024)}).encode()
    r = probe([imitation({"/props": big}).socket], "llama.cpp", timeout=2)
    assert not r.ok and any("body over" in e for e in r.errors)


def test_slow_server_timeout_is_respected(imitation: Callable[..., Imitation]) -> None:
    gate = threading.Event()
    srv = imitation({"/props": LLAMA_PROPS}, delay=gate)
    try:
        t0 = time.monotonic()
        r = probe([srv.socket], "llama.cpp", timeout=0.2)
        elapsed = time.monotonic() - t0
    finally:
        gate.set()
    assert not r.ok and any("timed out" in e.lower() for e in r.errors), r.errors
    assert elapsed < 5  # the server would hold the request for 10 s


def test_closed_port_is_a_reason_not_a_crash() -> None:
    with socket.socket() as s:  # bound, not listening (held: nothing else can take it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        r = probe([ListenSocket("127.0.0.1", port, "tcp")], "ollama", timeout=0.5)
    assert not r.ok and any("ConnectionRefused" in e for e in r.errors)


def test_prober_never_blocks_the_caller(imitation: Callable[..., Imitation]) -> None:
    gate = threading.Event()
    srv = imitation({"/props": LLAMA_PROPS}, delay=gate)
    prober = ServerProber(timeout=5, ttl=60)
    try:
        fut = prober.submit("k", [srv.socket], "llama.cpp")
        assert fut is not None
        assert prober.result("k") is None and not fut.done()  # server still holding it
        assert prober.submit("k", [srv.socket], "llama.cpp") is fut  # no duplicate probe
        gate.set()
        fut.result(timeout=10)
        deadline = time.monotonic() + 5
        while prober.result("k") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prober.result("k").ok
        assert prober.submit("k", [srv.socket], "llama.cpp") is None  # fresh: cached
        n = len(srv.requests)
        assert prober.probe_now("k", [srv.socket], "llama.cpp").ok and len(srv.requests) == n
        prober.forget(set())
        assert prober.result("k") is None
    finally:
        gate.set()
        prober.close()


# ----------------------------------------------------------------- listening sockets


def test_listening_sockets_of_this_process_only_listeners() -> None:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    port = lst.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = lst.accept()
    lst6 = None
    try:
        if socket.has_ipv6:
            try:
                lst6 = socket.socket(socket.AF_INET6)
                lst6.bind(("::", 0))
                lst6.listen()
            except OSError:
                lst6 = None
        found = listening_sockets(os.getpid())
        assert ListenSocket("127.0.0.1", port, "tcp") in found
        assert all(s.port != cli.getsockname()[1] for s in found)  # connected, not listening
        if lst6 is not None:
            assert ListenSocket("::1", lst6.getsockname()[1], "tcp6") in found
    finally:
        for s in (cli, conn, lst, lst6):
            if s is not None:
                s.close()
    assert all(s.port != port for s in listening_sockets(os.getpid()))


def test_listening_sockets_of_a_gone_process_raise_oserror() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(OSError):
        listening_sockets(p.pid)


# ----------------------------------------------------------------- buffer logs

TWO_PASS = """\
llama_model_loader: loaded meta data with 20 key-value pairs
load_tensors:   CPU_Mapped model buffer size =     0.00 MiB
llama_kv_cache:        CPU KV buffer size =     0.00 MiB
sched_reserve:        CPU compute buffer size =     0.70 MiB
load_tensors:   CPU_Mapped model buffer size =     0.41 MiB
llama_kv_cache:        CPU KV buffer size =     0.06 MiB
sched_reserve:        CPU compute buffer size =     0.70 MiB
main: server is listening on http://127.0.0.1:8080
"""
MIB = 1024 * 1024


def test_two_pass_log_takes_the_real_pass() -> None:
    b = llm.parse_buffer_log(TWO_PASS, "x.log")
    assert b is not None and b.complete
    assert b.total("model") == round(0.41 * MIB)
    assert b.total("KV") == round(0.06 * MIB)
    assert b.total("compute") == round(0.70 * MIB)


def test_gpu_devices_and_swa_kv_lines_add_up() -> None:
    text = """\
load_tensors:        CUDA0 model buffer size =  4096.00 MiB
load_tensors:   CPU_Mapped model buffer size =   281.81 MiB
llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB
llama_context:      CUDA0 compute buffer size =   300.01 MiB
llama_context:  CUDA_Host compute buffer size =    20.01 MiB
"""
    b = llm.parse_buffer_log(text)
    assert b.complete
    assert b.total("model", "CUDA0") == 4096 * MIB
    assert b.total("KV", "CUDA0") == 576 * MIB
    assert b.total("compute", "CUDA0") == round(300.01 * MIB)
    assert b.total("model") == 4096 * MIB + round(281.81 * MIB)
    assert b.total("KV", "CUDA1") is None  # unknown, not 0


def test_incomplete_last_pass_falls_back_to_the_last_complete_one() -> None:
    text = TWO_PASS + "load_tensors:   CPU_Mapped model buffer size =     9.00 MiB\n"
    b = llm.parse_buffer_log(text)
    assert b.complete and b.total("model") == round(0.41 * MIB)
    only_partial = llm.parse_buffer_log("load_tensors: CUDA0 model buffer size = 2.00 MiB\n")
    assert not only_partial.complete and only_partial.total("model") == 2 * MIB
    # Only the 0.00 MiB sizing pass so far (still loading): no numbers rather than zeros.
    sizing_only = TWO_PASS.split("load_tensors:   CPU_Mapped model buffer size =     0.41")[0]
    assert llm.parse_buffer_log(sizing_only) is None
    assert llm.parse_buffer_log("no buffers here\n") is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "load_tensors: CPU model buffer size = 1.00 MiB",
                "llama_kv_cache: CPU KV buffer size = 2 MiB",
                "sched_reserve: CPU compute buffer size = 0.5 MiB",
                "x buffer size = MiB",
                "",
                "CUDA0 KV buffer size = -1 MiB",
                "\x00\xff",
                "model buffer size = 1e9 MiB",
            ]
        )
        | st.text(max_size=60),
        max_size=30,
    )
)
def test_fuzz_buffer_log_never_crashes(lines: list[str]) -> None:
    b = llm.parse_buffer_log("\n".join(lines))
    if b is not None:
        assert all(v >= 0 for d in b.by_device.values() for v in d.values())


def test_read_buffer_log_is_bounded_and_cached(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    junk = "request done\n" * ((llm.LOG_HEAD + llm.LOG_TAIL) // 13 + 10)
    log.write_text(TWO_PASS + junk)  # buffer lines at the head, long tail after
    b = llm.read_buffer_log(str(log))
    assert b is not None and b.total("KV") == round(0.06 * MIB)
    assert llm.read_buffer_log(str(log)) is b  # unchanged file: cached object
    # Lines beyond the head window and before the tail window are not read at all.
    far = tmp_path / "far.log"
    far.write_text("x" * (llm.LOG_HEAD + 10) + "\n" + TWO_PASS + junk)
    assert llm.read_buffer_log(str(far)) is None
    with open(log, "a") as f:
        f.write(TWO_PASS.replace("0.41", "0.50"))
    assert llm.read_buffer_log(str(log)).total("model") == round(0.50 * MIB)


def test_argv_helpers() -> None:
    argv = ["llama-server", "-m", "x.gguf", "-c", "8192", "-ctk", "q8_0", "--cache-type-v=Q4_0"]
    assert llm.context_from_argv(argv) == 8192
    assert llm.cache_types_from_argv(argv) == ("q8_0", "q4_0")
    assert llm.context_from_argv(["llama-server", "-c", "0"]) is None
    assert llm.context_from_argv(["llama-server", "-c", "lots"]) is None


# ----------------------------------------------------------------- build_view


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    p = tmp_path / "qwen.gguf"
    write_model(p, "qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=1024)
    return p


def _claim(path: Path, *sources: Source) -> object:
    return assess([Evidence(s, path=str(path)) for s in sources])[0]


def test_view_estimates_only_are_labelled_and_not_summed_into_measured(model_file: Path) -> None:
    h = gguf.read_header(model_file)
    claim = _claim(model_file, Source.MAPPED, Source.CMDLINE)
    argv = ["llama-server", "-m", str(model_file), "-c", "512"]
    v = llm.build_view(claim, header=h, runtime="llama.cpp", argv=argv, measured_bytes=10**9)
    w, kv, comp, other = (v.part(n) for n in ("weights", "kv_cache", "compute", "other"))
    assert w.reading.kind is Kind.ESTIMATED and w.reading.value == h.weights_bytes
    assert kv.reading.kind is Kind.ESTIMATED
    assert kv.reading.value == kvcache.kv_cache_estimate(h, 512).bytes
    assert kv.marker == "*"  # n_ctx and cache types known from the argv: one explanation
    assert comp.reading.value is None and comp.reading.reason is not None
    assert other.reading.value is None  # never measured minus estimates
    assert v.reported_total is None and v.estimated_total == h.weights_bytes + kv.reading.value
    assert (v.status, v.owner_marker, v.n_ctx, v.n_ctx_source) == ("confirmed", "", 512, "cmdline")
    json.dumps(v.to_json())


def test_view_unknown_context_has_no_star(model_file: Path) -> None:
    h = gguf.read_header(model_file)
    v = llm.build_view(_claim(model_file, Source.MAPPED), header=h)
    kv = v.part("kv_cache")
    assert kv.marker == "" and "header context_length" in kv.reading.source
    assert v.owner_marker == "?" and v.status == "single source"


def test_view_runtime_beats_estimate_and_other_is_inferred(model_file: Path) -> None:
    h = gguf.read_header(model_file)
    buffers = llm.parse_buffer_log(TWO_PASS, "/tmp/srv.log")
    served = llm.ServedModel("qwen.gguf", str(model_file), True, n_ctx=256)
    claim = _claim(model_file, Source.API, Source.MAPPED)
    measured = 4 * MIB
    v = llm.build_view(
        claim,
        header=h,
        buffers=buffers,
        served=served,
        runtime="llama.cpp",
        measured_bytes=measured,
        friendly_name="Qwen test",
    )
    w = v.part("weights")
    assert w.reading.kind is Kind.RUNTIME and w.reading.value == round(0.41 * MIB)
    assert [a.kind for a in w.alternatives] == [Kind.ESTIMATED]
    assert v.part("kv_cache").reading.kind is Kind.RUNTIME
    parts_sum = round(0.41 * MIB) + round(0.06 * MIB) + round(0.70 * MIB)
    assert v.reported_total == parts_sum
    other = v.part("other").reading
    assert other.kind is Kind.INFERRED and other.value == measured - parts_sum
    assert v.model == "Qwen test" and v.n_ctx == 256 and v.n_ctx_source == "api"
    # the estimates stay visible but apart
    assert v.estimated_total is None


def test_other_is_null_when_a_known_part_is_only_estimated(model_file: Path) -> None:
    """Catches "other" computed from parts that are merely known: measured bytes minus an
    estimate is no inference at all. Every part is known here (compute from the runtime's log,
    weights and KV cache estimated from the header), so only the rule keeps "other" null."""
    h = gguf.read_header(model_file)
    buffers = llm.parse_buffer_log(
        "sched_reserve:        CPU compute buffer size =     0.70 MiB\n", "/tmp/srv.log"
    )
    argv = ["llama-server", "-m", str(model_file), "-c", "512"]
    v = llm.build_view(
        _claim(model_file, Source.MAPPED, Source.CMDLINE),
        header=h,
        buffers=buffers,
        runtime="llama.cpp",
        argv=argv,
        measured_bytes=64 * MIB,
    )
    parts = {n: v.part(n).reading for n in ("weights", "kv_cache", "compute")}
    assert all(r.known for r in parts.values()), parts
    assert parts["compute"].kind is Kind.RUNTIME
    assert parts["weights"].kind is Kind.ESTIMATED and parts["kv_cache"].kind is Kind.ESTIMATED
    other = v.part("other").reading
    assert other.value is None and other.reason is not None and other.kind is Kind.INFERRED


def test_view_equal_candidates_get_a_star(model_file: Path) -> None:
    h = gguf.read_header(model_file)
    served = llm.ServedModel("qwen.gguf", str(model_file), True, weights_bytes=h.weights_bytes)
    v = llm.build_view(
        _claim(model_file, Source.API, Source.MAPPED), header=h, served=served, runtime="llama.cpp"
    )
    w = v.part("weights")
    assert w.reading.kind is Kind.RUNTIME and w.marker == "*"


def test_view_star_needs_exactly_equal_reports(model_file: Path) -> None:
    """Catches a `*` given to reports that nearly agree (say, within 1 MiB): two runtime
    reports of the weights one byte apart are two different answers, so no `*`."""
    log = llm.parse_buffer_log("load_tensors: CPU model buffer size = 1.00 MiB\n")
    for extra, marker in ((0, "*"), (1, ""), (-1, "")):
        served = llm.ServedModel("q", None, True, weights_bytes=(1 << 20) + extra)
        v = llm.build_view(
            _claim(model_file, Source.API, Source.MAPPED),
            served=served,
            runtime="llama.cpp",
            buffers=log,
        )
        w = v.part("weights")
        assert w.reading.kind is Kind.RUNTIME and len(w.alternatives) == 1  # two runtime reports
        assert w.marker == marker, (extra, w)


def test_path_arg_only_gets_no_view(model_file: Path) -> None:
    assert llm.build_view(_claim(model_file, Source.PATH_ARG)) is None


# ----------------------------------------------------------------- end to end


@pytest.mark.slow
def test_end_to_end_imitation_llama_server(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    write_model(model, "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=256)
    log = tmp_path / "server.log"
    reqlog = tmp_path / "requests.log"
    argv = [
        sys.executable,
        str(HERE / "imitation_llama_server.py"),
        "-m",
        "tiny.gguf",
        "--port",
        "0",
        "-c",
        "128",
        "--api-key",
        "s3cret",
        "-v",
        "--requests-log",
        str(reqlog),
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening "), line
        port = int(line.split()[1])

        info = procinfo.scan_process(proc.pid)
        raw_argv = procinfo.split_cmdline(Path(f"/proc/{proc.pid}/cmdline").read_bytes())
        assert "s3cret" not in " ".join(info.cmdline or ())
        sockets = listening_sockets(proc.pid)
        assert sockets == [ListenSocket("127.0.0.1", port, "tcp")]
        result = probe(sockets, "llama.cpp", api_key=api_key_from_argv(raw_argv), timeout=2)
        assert result.ok, result.errors
        evidence = from_procinfo(info.models) + result.evidence(info.cwd)
        claims = assess(evidence)
        claim = claims[0]
        assert claim.path == str(model.resolve())
        assert claim.confirmed and {s.value for s in claim.sources} == {"api", "mapped", "cmdline"}
        header = gguf.read_header_cached(claim.path)
        assert llm.log_files(proc.pid, raw_argv, info.cwd) == [str(log)]
        buffers = llm.read_buffer_log(str(log))
        view = llm.build_view(
            claim,
            header=header,
            buffers=buffers,
            served=result.models[0],
            runtime=result.runtime,
            argv=raw_argv,
        )
        doc = json.loads(json.dumps(view.to_json()))
        assert doc["evidence"] == "api" and doc["status"] == "confirmed"
        assert doc["owner_marker"] is None and doc["n_ctx"] == 128
        parts = doc["parts"]
        assert parts["weights"]["provenance"] == "runtime"
        assert parts["weights"]["bytes"] == round(0.41 * MIB)
        alts = parts["weights"]["alternatives"]
        assert [a["provenance"] for a in alts] == ["runtime", "estimated"]  # API size, GGUF
        assert alts[1]["bytes"] == header.weights_bytes
        assert parts["weights"]["marker"] is None  # log and API disagree: not one explanation
        assert parts["kv_cache"]["provenance"] == "runtime"
        assert parts["compute"]["bytes"] == round(0.70 * MIB)
        assert parts["other"]["bytes"] is None
        assert {ln.split()[0] for ln in reqlog.read_text().splitlines()} == {"GET"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "model_path",
                    "data",
                    "models",
                    "id",
                    "name",
                    "meta",
                    "size",
                    "size_vram",
                    "state",
                    "n_ctx",
                    "default_generation_settings",
                    "owned_by",
                    "root",
                    "max_model_len",
                    "x",
                ]
            ),
            kids,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_fuzz_every_response_parser(doc: object) -> None:
    from gputaskman.intel.serverprobe import RUNTIMES, ServedModel, _Bad

    for endpoints in RUNTIMES.values():
        for ep in endpoints:
            arg = json.dumps(doc) if ep.text else doc
            try:
                rows, gauges = ep.parse(arg)
            except (_Bad, ValueError):
                continue
            assert all(isinstance(r, ServedModel) for r in rows)
            assert all(isinstance(v, float) for v in gauges.values())
