"""Issue 45 item 6 and issue 46: the runtimes GPU clusters run (vLLM, SGLang,
text-generation-inference, Transformers/PyTorch with safetensors, Ollama) identified from real
processes, with their model's weights / KV cache view and its provenance.

The processes are real: ``imitation_serving.py`` (IMITATIONS, none of the runtimes) run under
each runtime's program name and command line, holding real safetensors files (written by the
``safetensors`` library) open with safetensors' own ``safe_open`` from a Hugging Face hub cache
laid out by huggingface_hub's own code, and answering each runtime's documented endpoints on
loopback with the shapes their sources give (cited per fixture). None of it is validated
against the real runtimes; this machine has no GPU, so nothing here is measured VRAM.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
from gputaskman.base.readings import Kind
from gputaskman.intel import modelinfo, procinfo
from gputaskman.intel.stores import StoreIndex, StoreRoots

HERE = Path(__file__).resolve().parent
GTM = str(Path(sys.executable).parent / "gputaskman")


def _load_helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gtm_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hf = _load_helper("hf_files")
REPO = _load_helper("runtime_answers").REPO

ans = _load_helper("runtime_answers")
vllm_models, vllm_metrics = ans.vllm_models, ans.vllm_metrics
sglang_server_info, tgi_info = ans.sglang_server_info, ans.tgi_info


# --------------------------------------------------------------------------- processes


@dataclass
class Launched:
    proc: subprocess.Popen
    port: int | None
    children: list[int] = field(default_factory=list)
    requests: Path | None = None


def program(tmp: Path, name: str) -> str:
    """This imitation installed under a runtime's program name."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    dst = bindir / name
    shutil.copy(HERE / "imitation_serving.py", dst)
    return str(dst)


def _nested(spec: dict) -> list[dict]:
    return [spec, *(c for child in spec.get("children", []) for c in _nested(child))]


@pytest.fixture
def launch() -> Iterator[Callable[..., Launched]]:
    made: list[Launched] = []

    def run(argv: list[str], spec: dict[str, object], cwd: Path, env: dict | None = None):
        e = dict(os.environ, GTM_IMITATION=json.dumps(spec), **(env or {}))
        p = subprocess.Popen(argv, cwd=cwd, env=e, stdout=subprocess.PIPE, text=True)
        got = Launched(
            p, None, requests=Path(spec["requests_log"]) if "requests_log" in spec else None
        )
        made.append(got)
        every = _nested(spec)
        want_ports = sum(1 for c in every if c.get("routes"))
        want_ready = sum(1 for c in every if not c.get("routes"))
        deadline = time.monotonic() + 30
        while (want_ports or want_ready) and time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line, "the imitation exited"
            word, _, rest = line.partition(" ")
            if word == "listening":
                got.port = got.port or int(rest)
                want_ports -= 1
            elif word == "child":
                got.children.append(int(rest))
            elif word.strip() == "ready":
                want_ready -= 1
        return got

    yield run
    for m in made:
        for c in m.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, signal.SIGTERM)
        m.proc.terminate()
        m.proc.wait(timeout=10)
        m.proc.stdout.close()


def _index(cache: Path | None) -> StoreIndex:
    return StoreIndex(StoreRoots(huggingface=(str(cache),) if cache else ()))


def resolve(pid: int, cache: Path | None) -> tuple[modelinfo.Inputs, modelinfo.Resolved]:
    info = procinfo.scan_process(pid)
    inputs = modelinfo.gather(info, _index(cache), probe_timeout=2, probe_deadline=10)
    return inputs, modelinfo.build(
        info, inputs, argv=info.cmdline, measured_bytes=None, device=None
    )


@pytest.fixture
def cached(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A two-shard model folder put into a hub cache: (cache, snapshot folder, arrays)."""
    arrays = hf.write_model_dir(tmp_path / "src", shards=2)
    cache = tmp_path / "hub"
    snap = hf.cache_model(cache, REPO, tmp_path / "src")
    return cache, snap, arrays


def _shards(snap: Path) -> list[str]:
    return [str(p) for p in sorted(snap.glob("*.safetensors"))]


# --------------------------------------------------------------------------- issue 45 item 6


def test_a_repo_id_on_the_command_line_is_a_name_not_a_path(tmp_path: Path, launch) -> None:
    vllm = program(tmp_path, "vllm")
    run = launch([sys.executable, vllm, "serve", REPO, "--port", "0"], {}, cwd=tmp_path)
    info = procinfo.scan_process(run.proc.pid)
    assert [(m.evidence, m.path, m.name) for m in info.models] == [("cmdline", None, REPO)]
    assert info.server is not None and info.server.key == "vllm"


def test_a_folder_named_like_a_repo_id_in_the_cwd_is_the_path(tmp_path: Path, launch) -> None:
    """transformers and vLLM load a local folder first: so does the evidence."""
    hf.write_model_dir(tmp_path / REPO)
    vllm = program(tmp_path, "vllm")
    run = launch([sys.executable, vllm, "serve", REPO], {}, cwd=tmp_path)
    info = procinfo.scan_process(run.proc.pid)
    assert [(m.path, m.name) for m in info.models] == [(str(tmp_path / REPO), None)]


def test_api_and_command_line_confirm_each_other_by_name(tmp_path: Path, launch) -> None:
    """``vllm serve Qwen/...`` with no hub cache here: before, the command line became
    CWD/Qwen/... ("GGUF header: FileNotFoundError") and never met the API's name."""
    vllm = program(tmp_path, "vllm")
    spec = {"routes": {"/v1/models": vllm_models(REPO, "tiny"), "/metrics": vllm_metrics()}}
    run = launch(
        [sys.executable, vllm, "serve", REPO, "--served-model-name", "tiny"], spec, tmp_path
    )
    info = procinfo.scan_process(run.proc.pid)
    cheap = modelinfo.build(info, None, argv=info.cmdline, measured_bytes=None, device=None)
    assert cheap.ref is not None and cheap.ref.name == REPO and cheap.ref.pending
    _inputs, res = resolve(run.proc.pid, None)
    ref = res.ref
    assert ref is not None and ref.name == REPO
    assert ref.confirmed and set(ref.sources) == {"api", "cmdline"}
    assert ref.path is None and ref.header_error is None
    assert ref.api_runtime == "vllm" and ref.api_endpoint == f"127.0.0.1:{run.port}"


def test_a_snapshot_folder_is_named_by_its_repo_and_read_as_safetensors(
    tmp_path: Path, launch, cached
) -> None:
    """``--model <cache>/models--org--name/snapshots/<rev>``: before, the model was named by
    the revision hash and its header read failed with IsADirectoryError."""
    _cache, snap, arrays = cached
    vllm = program(tmp_path, "vllm")
    spec = {"hold": _shards(snap), "routes": {"/v1/models": vllm_models(str(snap))}}
    run = launch([sys.executable, vllm, "serve", str(snap)], spec, tmp_path)
    _inputs, res = resolve(run.proc.pid, None)  # no cache root given: the path shape suffices
    assert res.ref is not None
    assert res.ref.name == REPO and res.ref.store == "huggingface"
    assert res.ref.path == str(snap) and res.ref.header_error is None
    assert set(res.ref.sources) == {"api", "cmdline", "mapped"} and res.ref.confirmed
    view = res.view
    assert view is not None and view.format == "safetensors"
    w = view.part("weights")
    assert w.reading.kind is Kind.ESTIMATED and w.reading.value == hf.nbytes(arrays)
    assert w.reading.source == "safetensors headers (2 files)" and w.marker == "*"


# --------------------------------------------------------------------------- vLLM


def test_vllm_repo_id_mapped_blobs_and_api_are_one_model_with_its_kv_pool(
    tmp_path: Path, launch, cached
) -> None:
    cache, snap, arrays = cached
    vllm = program(tmp_path, "vllm")
    reqs = tmp_path / "requests.log"
    spec = {
        "hold": _shards(snap),
        "routes": {"/v1/models": vllm_models(REPO), "/metrics": vllm_metrics(100, 0.25)},
        "requests_log": str(reqs),
    }
    run = launch([sys.executable, vllm, "serve", REPO, "--port", "0"], spec, tmp_path)
    info = procinfo.scan_process(run.proc.pid)
    assert all("/blobs/" in m.path for m in info.models if m.evidence == "mapped")
    inputs, res = resolve(run.proc.pid, cache)
    claim = inputs.claims[0]
    assert claim.path == str(snap) and claim.model == REPO
    assert {s.value for s in claim.sources} == {"api", "cmdline", "mapped"}
    assert len(inputs.claims) == 1  # both shards, the name and the API: one model
    view = res.view
    assert view is not None and view.runtime == "vllm"
    assert view.architecture == "qwen2" and view.file_type == "F16+F32"
    w = view.part("weights")
    assert w.reading.kind is Kind.ESTIMATED and w.reading.value == hf.nbytes(arrays)
    kv = view.part("kv_cache")
    per_token = 2 * 2 * 2 * 16 * 2  # K+V x layers x KV heads x head size x bf16 (auto)
    assert kv.reading.kind is Kind.RUNTIME and kv.reading.value == 1600 * per_token
    assert "100 blocks x 16 tokens" in kv.reading.source
    assert view.kv_cache_dtype == "bfloat16"
    figs = dict(view.figures)
    assert figs["kv_pool_tokens"].value == 1600
    assert figs["kv_used_percent"].value == 25.0
    assert figs["kv_used_bytes"].value == 400 * per_token
    assert figs["gpu_memory_fraction_percent"].value == 90.0
    assert all(r.kind is Kind.RUNTIME for r in figs.values())
    assert view.part("other").reading.value is None  # no measured VRAM: no remainder
    assert {ln.split()[0] for ln in reqs.read_text().splitlines()} == {"GET"}


def test_vllm_engine_core_child_is_named_through_its_api_server(
    tmp_path: Path, launch, cached
) -> None:
    """vLLM V1: the engine core (``VLLM::EngineCore``, holding the weights and the GPU) is a
    child of the API server, which alone listens."""
    cache, snap, _ = cached
    vllm = program(tmp_path, "vllm")
    spec = {
        "routes": {"/v1/models": vllm_models(REPO), "/metrics": vllm_metrics()},
        "children": [{"title": "VLLM::EngineCore", "hold": _shards(snap)}],
    }
    run = launch([sys.executable, vllm, "serve", REPO], spec, tmp_path)
    core = run.children[0]
    info = procinfo.scan_process(core)
    assert info.server is not None and info.server.key == "vllm"
    assert "process title" in info.server.basis
    inputs, res = resolve(core, cache)
    assert inputs.probed_pid == run.proc.pid and inputs.runtime == "vllm"
    assert res.ref is not None and res.ref.confirmed and res.ref.name == REPO
    assert set(res.ref.sources) == {"api", "mapped"}
    assert res.view is not None and res.view.part("kv_cache").reading.kind is Kind.RUNTIME


def test_vllm_tensor_parallel_worker_is_named_through_core_and_server(
    tmp_path: Path, launch, cached
) -> None:
    """A V1 worker (``VLLM::Worker_TP0``) is the engine core's child: the walk goes up past
    the core (no port) to the API server."""
    cache, snap, _ = cached
    vllm = program(tmp_path, "vllm")
    worker = {"title": "VLLM::Worker_TP0", "hold": _shards(snap)}
    spec = {
        "routes": {"/v1/models": vllm_models(REPO), "/metrics": vllm_metrics()},
        "children": [{"title": "VLLM::EngineCore", "children": [worker]}],
    }
    run = launch([sys.executable, vllm, "serve", REPO, "-tp", "2"], spec, tmp_path)
    core, tp0 = run.children
    assert modelinfo.api_owners(tp0, "vllm") == [(core, "vllm"), (run.proc.pid, "vllm")]
    inputs, res = resolve(tp0, cache)
    assert inputs.probed_pid == run.proc.pid
    assert res.ref is not None and res.ref.confirmed
    kv = res.view.part("kv_cache")
    per_token = 2 * 2 * 1 * 16 * 2  # -tp 2: one of the two KV heads on this GPU
    assert kv.reading.value == 1600 * per_token and "tp 2" in kv.reading.source


# --------------------------------------------------------------------------- SGLang


def test_sglang_reports_weights_and_kv_pool_bytes(tmp_path: Path, launch, cached) -> None:
    cache, snap, arrays = cached
    pkgs = tmp_path / "pkgs" / "sglang"
    pkgs.mkdir(parents=True)
    (pkgs / "__init__.py").write_text("")
    shutil.copy(HERE / "imitation_serving.py", pkgs / "launch_server.py")
    spec = {"hold": _shards(snap), "routes": {"/get_server_info": sglang_server_info(REPO)}}
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", REPO, "--port", "0"]
    run = launch(argv, spec, tmp_path, env={"PYTHONPATH": str(tmp_path / "pkgs")})
    info = procinfo.scan_process(run.proc.pid)
    assert info.server is not None and info.server.key == "sglang"
    inputs, res = resolve(run.proc.pid, cache)
    assert inputs.probe is not None and inputs.probe.runtime == "sglang"
    assert inputs.probe.errors == ()  # one GET, to its own table: no other runtime's 404s
    assert res.ref is not None and res.ref.confirmed and res.ref.path == str(snap)
    view = res.view
    w = view.part("weights")
    assert w.reading.kind is Kind.RUNTIME and w.reading.value == round(1.25 * 2**30)
    assert "memory_usage.weight (GiB to 2 decimals)" in w.reading.source
    assert [(a.kind, a.value) for a in w.alternatives] == [(Kind.ESTIMATED, hf.nbytes(arrays))]
    kv = view.part("kv_cache")
    assert kv.reading.kind is Kind.RUNTIME and kv.reading.value == round(2.5 * 2**30)
    figs = dict(view.figures)
    assert figs["kv_pool_tokens"].value == 123456
    assert figs["gpu_memory_fraction_percent"].value == 88.0
    assert "mem_fraction_static" in figs["gpu_memory_fraction_percent"].source


# --------------------------------------------------------------------------- TGI


def test_tgi_shard_is_named_through_the_router_beside_it(tmp_path: Path, launch, cached) -> None:
    """TGI: the launcher starts the shard (``text-generation-server serve MODEL``, which holds
    the weights and listens on a unix socket only) and the router (HTTP, ``/info``)."""
    cache, snap, _ = cached
    launcher = program(tmp_path, "text-generation-launcher")
    server = program(tmp_path, "text-generation-server")
    router = program(tmp_path, "text-generation-router")
    spec = {
        "children": [
            {"argv": [sys.executable, server, "serve", REPO], "hold": _shards(snap)},
            {
                "argv": [sys.executable, router, "--port", "0"],
                "routes": {"/info": tgi_info(REPO)},
            },
        ]
    }
    run = launch([sys.executable, launcher, "--model-id", REPO], spec, tmp_path)
    shard = run.children[0]
    inputs, res = resolve(shard, cache)
    assert inputs.probed_pid == run.children[1] and inputs.runtime == "tgi"
    assert res.ref is not None and res.ref.confirmed
    assert set(res.ref.sources) == {"api", "cmdline", "mapped"}
    kv = res.view.part("kv_cache")
    per_token = 2 * 2 * 2 * 16 * 2  # model_dtype torch.bfloat16
    assert kv.reading.kind is Kind.RUNTIME and kv.reading.value == 32000 * per_token
    assert res.view.n_ctx == 2048


# --------------------------------------------------------------------------- Transformers


def test_transformers_process_mapping_cached_shards(tmp_path: Path, launch, cached) -> None:
    """A plain PyTorch/Transformers script: no API, the mapped blobs alone (one source)."""
    _cache, snap, arrays = cached
    script = tmp_path / "bin"
    script.mkdir()
    shutil.copy(HERE / "imitation_serving.py", script / "generate.py")
    run = launch([sys.executable, str(script / "generate.py")], {"hold": _shards(snap)}, tmp_path)
    _inputs, res = resolve(run.proc.pid, None)
    assert res.ref is not None and res.ref.name == REPO and res.ref.path == str(snap)
    assert res.ref.evidence == "mapped" and not res.ref.confirmed
    assert res.view.part("weights").reading.value == hf.nbytes(arrays)
    assert res.view.owner_marker == "?"


# --------------------------------------------------------------------------- the tool


@pytest.mark.slow
def test_json_and_once_show_the_vllm_view(tmp_path: Path, launch, cached) -> None:
    cache, snap, _arrays = cached
    vllm = program(tmp_path, "vllm")
    spec = {
        "hold": _shards(snap),
        "routes": {"/v1/models": vllm_models(REPO), "/metrics": vllm_metrics()},
    }
    run = launch([sys.executable, vllm, "serve", REPO, "--port", "0"], spec, tmp_path)
    env = dict(os.environ, HF_HUB_CACHE=str(cache))
    r = subprocess.run(
        [GTM, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    from gputaskman.document.reader import read_document
    from gputaskman.render import report

    doc = json.loads(r.stdout)
    assert report.null_rule_violations(doc) == []
    row = next(p for p in doc["processes"] if p["pid"] == run.proc.pid)
    assert row["model"]["name"] == REPO and row["model"]["confirmed"]
    bd = row["breakdown"]
    assert bd["format"] == "safetensors" and bd["kv_cache_dtype"] == "bfloat16"
    assert bd["parts"]["kv_cache"]["reading"]["kind"] == "runtime"
    assert bd["runtime_figures"]["kv_used_percent"]["value"] == 25.0
    assert bd["runtime_figures"]["kv_used_percent"]["kind"] == "runtime"
    back = read_document(r.stdout.encode())
    got = next(p for p in back.processes if p.proc.pid == run.proc.pid)
    assert dict(got.proc.breakdown.figures)["kv_pool_tokens"].value == 1600
    r = subprocess.run(
        [GTM, "--once"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    section = r.stdout[r.stdout.index(f"PID {run.proc.pid} ") :]
    assert f"model {REPO} [api✓]" in section
    assert "safetensors qwen2 F16+F32" in section
    assert "runtime: KV pool used % ʳ25" in section
