"""Issue 5 end to end: a real process like ``llama-server -m model.gguf --port P`` (the
IMITATION in ``imitation_llama_server.py``: maps a real GGUF file, writes llama.cpp's buffer
lines to its log, serves the documented endpoints on loopback) is identified with confirmed
evidence and a weights / KV cache / compute view with the right provenance, in
``gputaskman --json`` and ``--once`` (real subprocesses) and in the TUI (pilot test driving
the real `Collector`). Also: a path-arg alone is never probed; an Ollama runner child is
named through its ``ollama serve`` parent's API and the store index. This machine has no
GPU, so the imitation's buffers are CPU buffers and its VRAM is ``not listed``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from gputaskman.intel import gguf
from gputaskman.intel.modelinfo import ModelResolver
from gputaskman.intel.procinfo import scan_process
from gputaskman.intel.stores import StoreIndex, StoreRoots
from gputaskman.render import report
from gputaskman.sampling.collector import Collector
from gputaskman.tui.app import create_app

HERE = Path(__file__).resolve().parent


def _load_helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gtm_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


write_model = _load_helper("gguf_files").write_model
GTM = str(Path(sys.executable).parent / "gputaskman")
MIB = 1024 * 1024
SECRET = "s3cret-key-never-shown"


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model: Path
    log: Path
    requests: Path


@pytest.fixture
def llama_server(tmp_path: Path) -> Iterator[Server]:
    model = tmp_path / "tiny.gguf"
    write_model(model, "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=256)
    log = tmp_path / "server.log"
    reqs = tmp_path / "requests.log"
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
        SECRET,
        "-v",
        "--requests-log",
        str(reqs),
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening "), line
        yield Server(proc, int(line.split()[1]), model, log, reqs)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def _check_view_provenance(bd: dict, srv: Server) -> None:
    """The breakdown JSON of the imitation: runtime-reported log buffers chosen, the API's
    size and the GGUF estimate kept as alternatives, ``other`` unknown (no GPU here)."""
    header = gguf.read_header(srv.model)
    assert bd["evidence"] == "api" and bd["status"] == "confirmed"
    assert bd["owner_marker"] is None  # confirmed: not a heuristic owner
    assert bd["runtime"] == "llama.cpp" and bd["architecture"] == "llama"
    assert bd["n_ctx"] == 128 and bd["n_ctx_source"] == "api"
    w = bd["parts"]["weights"]
    assert w["reading"]["kind"] == "runtime"
    assert w["reading"]["value"] == round(0.41 * MIB)  # the second (real) pass, not 0.00
    assert "llama.cpp log server.log" in w["reading"]["source"]
    assert [a["kind"] for a in w["alternatives"]] == ["runtime", "estimated"]
    assert w["alternatives"][0]["value"] == srv.model.stat().st_size  # /v1/models meta.size
    assert w["alternatives"][1]["value"] == header.weights_bytes  # GGUF tensor sizes
    assert w["marker"] is None  # log and API disagree: more than one explanation
    kv = bd["parts"]["kv_cache"]
    assert kv["reading"]["kind"] == "runtime" and kv["reading"]["value"] == round(0.06 * MIB)
    assert kv["alternatives"][0]["kind"] == "estimated"
    assert "n_ctx=128 from api" in kv["alternatives"][0]["source"]
    c = bd["parts"]["compute"]
    assert c["reading"]["kind"] == "runtime" and c["reading"]["value"] == round(0.70 * MIB)
    assert c["marker"] == "*"
    other = bd["parts"]["other"]["reading"]
    assert other["value"] is None and other["kind"] == "inferred"
    assert bd["reported_total"]["value"] == round(0.41 * MIB) + round(0.06 * MIB) + round(
        0.70 * MIB
    )
    assert bd["estimated_total"]["value"] is None  # no estimate was chosen for any part


@pytest.mark.slow
def test_json_subprocess_identifies_the_llama_server_with_confirmed_evidence(llama_server):
    srv = llama_server
    r = subprocess.run(
        [GTM, "--json"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout and SECRET not in r.stderr
    doc = json.loads(r.stdout)
    assert report.null_rule_violations(doc) == []
    row = next(p for p in doc["processes"] if p["pid"] == srv.proc.pid)
    m = row["model"]
    assert m["name"] == "tiny.gguf" and m["path"] == str(srv.model.resolve())
    assert m["evidence"] == "api" and m["confirmed"] is True and m["status"] == "confirmed"
    assert m["sources"] == ["api", "cmdline", "mapped"]
    assert m["api"]["runtime"] == "llama.cpp"
    assert m["api"]["endpoint"] == f"127.0.0.1:{srv.port}"
    assert m["pending"] is False and m["header_error"] is None
    _check_view_provenance(row["breakdown"], srv)
    # estimates and runtime reports never reach a measured total: no GPU, nothing summed
    assert row["vram_bytes"]["value"] is None
    assert row["vram_bytes"]["reason"] in ("not listed", "unavailable")  # no GPU context
    assert doc["attributed_bytes"] is None
    # look, don't touch: GET requests only, to the port the process itself listens on
    methods = {ln.split()[0] for ln in srv.requests.read_text().splitlines()}
    assert methods == {"GET"}


@pytest.mark.slow
def test_once_subprocess_prints_the_model_section(llama_server):
    srv = llama_server
    r = subprocess.run(
        [GTM, "--once"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout
    out = r.stdout
    assert "MODELS" in out
    section = out[out.index(f"PID {srv.proc.pid} ") :]
    assert "model tiny.gguf [api✓]" in section
    assert "evidence api (confirmed: api+cmdline+mapped)" in section
    assert f"llama.cpp API on 127.0.0.1:{srv.port}" in section
    weights = next(ln for ln in section.splitlines() if ln.strip().startswith("weights"))
    assert f"ʳ{report.fmt_bytes(round(0.41 * MIB))}" in weights
    assert "[runtime, llama.cpp log server.log" in weights
    assert "[estimated, gguf tensor sizes]" in section


async def test_tui_with_the_real_collector_shows_model_and_breakdown(llama_server):
    from gputaskman.tui.widgets.process_table import ProcessTable

    srv = llama_server
    collectors: list[Collector] = []

    def factory() -> Collector:
        c = Collector()  # the TUI's own settings: budgeted scans, background model looks
        collectors.append(c)
        return c

    app = create_app(interval=0.2, collector_factory=factory)
    key = f"{srv.proc.pid}@-"
    async with app.run_test(size=(160, 50)) as pilot:
        table = app.query_one(ProcessTable)
        deadline = time.monotonic() + 60
        row = None
        while time.monotonic() < deadline:
            await pilot.pause(0.1)
            row = table.rows_shown.get(key)
            if row is not None and row.breakdown is not None:
                break
        assert row is not None and row.breakdown is not None, "no breakdown within 60 s"
        assert row.model.confirmed and not row.model.pending
        table.move_cursor(row=table.row_index(key))
        await pilot.pause()
        app.render_inspector()
        await pilot.pause()
        cells = [str(c) for c in table.get_row(key)]  # Text cells, compared as shown
        assert cells[table.columns_shown.index("MODEL")] == "tiny.gguf [api✓]"
        body = str(app.query_one("#inspector-body").render())
        assert "model tiny.gguf [api✓]" in body
        w = report.fmt_bytes(round(0.41 * MIB))
        assert f"weights  ʳ{w}  [runtime, llama.cpp log server.log" in body
        assert "[estimated, gguf tensor sizes]" in body
        assert f"compute  ʳ{report.fmt_bytes(round(0.70 * MIB))}*" in body
        assert SECRET not in body
    # the background look ran off the UI thread and never waited inside a refresh
    assert collectors and all(c.last_timing["model_s"] < 1.0 for c in collectors)


LISTEN_ONLY = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    log = sys.argv[2]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            with open(log, "a") as f:
                f.write(self.path + "\\n")
            self.send_response(404)
            self.end_headers()
    srv = HTTPServer(("127.0.0.1", 0), H)
    print("listening", srv.server_address[1], flush=True)
    srv.serve_forever()
""")


def test_path_arg_alone_is_informational_and_never_probed(tmp_path: Path):
    script = tmp_path / "listen_only.py"
    script.write_text(LISTEN_ONLY)
    model = tmp_path / "notes.gguf"
    model.write_bytes(b"not a gguf file at all")  # a header read would record an error
    reqs = tmp_path / "requests.log"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model), str(reqs)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().startswith("listening")
        info = scan_process(proc.pid)
        resolver = ModelResolver(background=False, index=StoreIndex(StoreRoots()))
        res = resolver.resolve(info)
        assert res.ref is not None and res.ref.evidence == "path-arg"
        assert res.ref.status == "informational" and not res.ref.confirmed
        assert res.view is None  # no estimates
        assert res.ref.api_endpoint is None and res.ref.api_errors == ()  # no probe
        assert res.ref.header_error is None  # no header read
        assert not reqs.exists()  # the server never saw a request
        resolver.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


MAP_AND_WAIT = textwrap.dedent("""
    import mmap, sys
    with open(sys.argv[-1], "rb") as f:
        held = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    print("mapped", flush=True)
    sys.stdin.read()
""")


def _safetensors_bytes() -> bytes:
    """A real safetensors file: little-endian u64 header length, JSON header, tensor data."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(64)


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("model.safetensors", _safetensors_bytes(), None),
        ("model.gguf", _safetensors_bytes(), "NotGGUFError: not GGUF: magic"),
    ],
)
def test_a_model_in_another_format_is_named_without_a_gguf_error(
    tmp_path: Path, name: str, content: bytes, error: str | None
):
    """A PyTorch process holding a safetensors file (seen on an H200: mapped, and named by
    --model) showed "GGUF header: GGUFError: not GGUF" because every confirmed model file was
    read as GGUF. Only a file named .gguf that is not one is an error worth showing."""
    model = tmp_path / name
    model.write_bytes(content)
    script = tmp_path / "map_and_wait.py"
    script.write_text(MAP_AND_WAIT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "--model", str(model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("mapped")
        resolver = ModelResolver(background=False, index=StoreIndex(StoreRoots()))
        res = resolver.resolve(scan_process(proc.pid))
        resolver.close()
        assert res.ref is not None and res.ref.path == str(model.resolve())
        assert res.ref.confirmed and res.ref.sources == ("cmdline", "mapped")
        if error is None:
            assert res.ref.header_error is None
        else:
            assert res.ref.header_error is not None and res.ref.header_error.startswith(error)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


OLLAMA_SERVE = textwrap.dedent("""
    import json, subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    blob, name = sys.argv[1], sys.argv[2]
    runner = subprocess.Popen([sys.executable, "-c",
        "import mmap,socket,sys,time; f=open(sys.argv[1],'rb'); "
        "m=mmap.mmap(f.fileno(),0,access=mmap.ACCESS_READ); "
        "s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "  # its own, silent port
        "print('mapped',flush=True); time.sleep(600)", blob], stdout=subprocess.PIPE, text=True)
    runner.stdout.readline()
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            if self.path != "/api/ps":
                self.send_response(404); self.end_headers(); return
            body = json.dumps({"models": [{"name": name, "model": name, "size": 123456,
                                           "size_vram": 0, "context_length": 4096}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    srv = HTTPServer(("127.0.0.1", 0), H)
    print("runner", runner.pid, "port", srv.server_address[1], flush=True)
    try:
        srv.serve_forever()
    finally:
        runner.kill()
""")


def test_ollama_runner_child_is_named_through_the_parent_api(tmp_path: Path):
    """IMITATION of ``ollama serve`` (answers ``/api/ps``) and its runner child (maps the
    blob and listens on a port of its own that never answers), both named ``ollama`` (a
    symlink to Python), over a real Ollama store layout."""
    models = tmp_path / "models"
    digest = "ab" * 32
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    write_model(blob, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=64)
    manifest = models / "manifests/registry.ollama.ai/library/tiny/latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "layers": [
                    {
                        "mediaType": "application/vnd.ollama.image.model",
                        "digest": f"sha256:{digest}",
                        "size": blob.stat().st_size,
                    }
                ],
            }
        )
    )
    exe = tmp_path / "ollama"
    exe.symlink_to(sys.executable)
    script = tmp_path / "serve.py"
    script.write_text(OLLAMA_SERVE)
    serve = subprocess.Popen(
        [str(exe), str(script), str(blob), "tiny:latest"], stdout=subprocess.PIPE, text=True
    )
    try:
        words = serve.stdout.readline().split()
        assert words[0] == "runner", words
        runner_pid = int(words[1])
        info = scan_process(runner_pid)
        assert info.name == "ollama"
        resolver = ModelResolver(
            background=False, index=StoreIndex(StoreRoots(ollama=(str(models),)))
        )
        res = resolver.resolve(info)
        assert res.ref is not None
        assert res.ref.name == "tiny:latest" and res.ref.store == "ollama"
        assert res.ref.confirmed and res.ref.sources == ("api", "mapped")
        assert res.ref.api_runtime == "ollama"
        assert res.ref.api_endpoint == f"127.0.0.1:{words[3]}"  # the parent's API port
        assert res.view is not None and res.view.architecture == "llama"
        resolver.close()
    finally:
        serve.terminate()
        serve.wait(timeout=10)
        serve.stdout.close()
    if os.path.exists(f"/proc/{runner_pid}"):
        os.kill(runner_pid, 9)


def test_handy_process_gets_its_selected_model_from_the_app_adapter(tmp_path: Path, monkeypatch):
    """A real process named ``handy`` (a symlink to Python) and Handy's settings file laid
    out under $XDG_DATA_HOME: the selection is a setting, shown as such, never as residency."""
    data = tmp_path / "data"
    settings = data / "com.pais.handy" / "settings_store.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"settings": {"selected_model": "parakeet-tdt-0.6b-v3"}}))
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    exe = tmp_path / "handy"
    exe.symlink_to(sys.executable)
    proc = subprocess.Popen(
        [str(exe), "-c", "import time; print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("up")
        info = scan_process(proc.pid)
        resolver = ModelResolver(background=False, index=StoreIndex(StoreRoots()))
        res = resolver.resolve(info)
        resolver.close()
        assert res.ref is None and res.view is None  # a setting is not evidence
        assert res.app is not None and res.app.selected == "parakeet-tdt-0.6b-v3"
        from gputaskman.base.readings import ProcGpu, Reading, Reason

        row = ProcGpu(
            proc.pid,
            info.create_time,
            "handy",
            None,
            (),
            Reading.missing(Reason.NOT_LISTED, "nvml"),
            app_model=res.app,
        )
        assert report.model_cell(row) == "parakeet-tdt-0.6b-v3 [selected]"
        assert report.app_json(row.app_model)["evidence"] == "settings"
        assert any("a setting, not residency" in ln for ln in report.model_lines(row))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
