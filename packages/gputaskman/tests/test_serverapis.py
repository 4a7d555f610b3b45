"""The serving runtimes' answers (`serverapis`): documented shapes, hostile answers, Prometheus
labels, and what a runtime's figures become in the view (`poolview`, `llm.build_view`),
Ollama's ``size_vram`` included. Shapes and their versions: see test_serving_runtimes.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from gputaskman.base.readings import Kind
from gputaskman.intel import llm, serverapis
from gputaskman.intel.evidence import Evidence, Source, assess
from gputaskman.intel.serverapis import BadAnswer, ServedModel
from gputaskman.intel.serverprobe import RUNTIMES, probe
from gputaskman.render.report_models import model_lines
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gtm_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rt = _load("runtime_answers")
tl = _load("test_llm")
REPO = rt.REPO


@pytest.fixture
def imitation():
    made = []

    def make(routes: dict[str, object]):
        made.append(tl.Imitation(routes))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_vllm_metrics_give_the_pool_and_its_use() -> None:
    rows, gauges = serverapis.parse_vllm_metrics(rt.vllm_metrics(250, 0.5))
    (row,) = rows
    assert row.name is None and row.path is None  # about the whole server
    assert (row.num_gpu_blocks, row.block_size, row.kv_pool_tokens) == (250, 16, 4000)
    assert row.kv_cache_dtype == "auto" and row.mem_fraction == 0.9
    assert row.kv_used_fraction == 0.5
    assert gauges[f'vllm:num_requests_running{{engine="0",model_name="{REPO}"}}'] == 1.0


def test_vllm_before_0_10_named_the_use_gpu_cache_usage_perc() -> None:
    text = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.1\n'
    (row,), _ = serverapis.parse_vllm_metrics(text)
    assert row.kv_used_fraction == 0.1 and row.kv_pool_tokens is None


def test_vllm_data_parallel_engines_give_no_single_use() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n'
    (row,), _ = serverapis.parse_vllm_metrics(text)
    assert row.kv_used_fraction is None  # which GPU is which is not said: not guessed


@pytest.mark.parametrize(
    "line",
    [
        'vllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1.0',
        'vllm:cache_config_info{num_gpu_blocks="-5",block_size="16"} 1.0',
        'vllm:cache_config_info{num_gpu_blocks="99999999999999999999",block_size="16"} 1.0',
        'vllm:cache_config_info{num_gpu_blocks="10",block_size="16} 1.0',
        "vllm:cache_config_info{num_gpu_blocks=10} 1.0",
    ],
)
def test_vllm_odd_info_labels_give_no_pool(line: str) -> None:
    rows, _ = serverapis.parse_vllm_metrics(line + "\n")
    assert all(r.kv_pool_tokens is None for r in rows)


def test_prometheus_labels_with_escapes() -> None:
    text = 'vllm:cache_config_info{cache_dtype="a\\"b\\\\c",num_gpu_blocks="2",block_size="8"} 1\n'
    (row,), _ = serverapis.parse_vllm_metrics(text)
    assert row.kv_cache_dtype == 'a"b\\c' and row.kv_pool_tokens == 16


def test_sglang_and_tgi_documented_shapes() -> None:
    (s,), _ = serverapis.parse_sglang_server_info(rt.sglang_server_info("/models/q"))
    assert (s.name, s.path, s.kv_pool_tokens) == ("/models/q", "/models/q", 123456)
    assert s.weights_bytes == round(1.25 * 2**30) and s.rounded_gib
    assert s.mem_fraction == 0.88 and s.version == "0.5.0"
    (t,), _ = serverapis.parse_tgi_info(rt.tgi_info(REPO))
    assert (t.name, t.path, t.n_ctx, t.kv_pool_tokens, t.dtype) == (
        REPO,
        None,
        2048,
        32000,
        "torch.bfloat16",
    )


def test_tgi_3_without_dtype_or_batch_tokens_names_the_model_only() -> None:
    doc = {
        "model_id": REPO,
        "max_input_tokens": 32767,
        "max_total_tokens": 32768,
        "router": "text-generation-router",
        "version": "3.2.1",
    }
    (t,), _ = serverapis.parse_tgi_info(doc)
    assert t.kv_pool_tokens is None and t.dtype is None and t.n_ctx == 32768


def test_sglang_with_data_parallel_ranks_takes_no_one_rank_bytes() -> None:
    doc = rt.sglang_server_info(REPO)
    doc["internal_states"] = [doc["internal_states"][0]] * 2
    (s,), _ = serverapis.parse_sglang_server_info(doc)
    assert s.weights_bytes is None and s.kv_pool_bytes is None and s.kv_pool_tokens == 123456


@pytest.mark.parametrize(
    "parse,doc,reason",
    [
        (serverapis.parse_sglang_server_info, {"model_path": 3}, "model_path"),
        (serverapis.parse_sglang_server_info, {"model_path": "x"}, "max_total_num_tokens"),
        (serverapis.parse_sglang_server_info, [1], "model_path"),
        (serverapis.parse_tgi_info, {"model_id": "x"}, "max_total_tokens"),
        (serverapis.parse_tgi_info, {"model_id": "x", "max_total_tokens": 9}, "router"),
        (serverapis.parse_tgi_info, {"model_id": ""}, "model_id"),
    ],
)
def test_undocumented_answers_are_refused(parse, doc, reason: str) -> None:
    with pytest.raises(BadAnswer, match=reason):
        parse(doc)


_KEYS = [
    "model_path",
    "served_model_name",
    "max_total_num_tokens",
    "internal_states",
    "memory_usage",
    "weight",
    "kvcache",
    "token_capacity",
    "kv_cache_dtype",
    "mem_fraction_static",
    "dtype",
    "model_id",
    "max_total_tokens",
    "max_batch_total_tokens",
    "model_dtype",
    "router",
    "version",
    "context_length",
    "data",
    "owned_by",
    "root",
    "id",
]
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), kids, max_size=6)
    ),
    max_leaves=30,
)


def _check_row(r: ServedModel) -> None:
    for n in ("weights_bytes", "kv_pool_bytes", "kv_pool_tokens", "n_ctx", "size_bytes"):
        v = getattr(r, n)
        assert v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    for n in ("kv_used_fraction", "mem_fraction"):
        v = getattr(r, n)
        assert v is None or 0.0 <= v <= 1.0


@settings(max_examples=500, deadline=None)
@given(_json)
def test_fuzz_hostile_json_answers(doc: object) -> None:
    for parse in (serverapis.parse_sglang_server_info, serverapis.parse_tgi_info):
        try:
            rows, _gauges = parse(doc)
        except BadAnswer:
            continue
        for r in rows:
            _check_row(r)


_line = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda name, labels, val: f"{name}{{{labels}}} {val}",
        st.sampled_from(
            ["vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
        ),
        st.lists(
            st.builds(
                lambda k, v: f'{k}="{v}"',
                st.sampled_from(["num_gpu_blocks", "block_size", "cache_dtype", "engine", "x"]),
                st.text(alphabet='0123456789-.Na"\\e', max_size=6),
            ),
            max_size=4,
        ).map(",".join),
        st.one_of(st.floats(allow_nan=True), st.text(max_size=4)),
    ),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_line, max_size=8))
def test_fuzz_hostile_vllm_metrics(lines: list[str]) -> None:
    try:
        rows, gauges = serverapis.parse_vllm_metrics("\n".join(lines))
    except BadAnswer:
        return
    for r in rows:
        _check_row(r)
    assert all(isinstance(v, float) for v in gauges.values())


def test_every_table_endpoint_is_a_get_of_a_documented_path() -> None:
    assert [e.path for e in RUNTIMES["sglang"]] == ["/get_server_info"]
    assert [e.path for e in RUNTIMES["tgi"]] == ["/info"]
    assert [e.path for e in RUNTIMES["vllm"]] == ["/v1/models", "/metrics"]


# --------------------------------------------------------------------------- Ollama


def test_ollama_size_vram_is_the_runtimes_own_figure_beside_the_estimate(imitation) -> None:
    ps = json.loads(json.dumps(tl.OLLAMA_PS))
    srv = imitation({"/api/ps": ps})
    res = probe([srv.socket], "ollama", timeout=2)
    (served,) = res.models
    claim = assess([Evidence(Source.API, model="llama3.2:3b"), Evidence(Source.MAPPED, path="/b")])
    view = llm.build_view(claim[0], served=served, runtime="ollama")
    figs = dict(view.figures)
    assert figs["model_vram_bytes"].value == 3_000_000_000
    assert figs["model_vram_bytes"].kind is Kind.RUNTIME
    assert figs["model_vram_bytes"].source == "ollama API size_vram"
    assert figs["model_size_bytes"].value == 3_400_000_000
    assert view.reported_total is None  # a figure is no part: never summed into one


def test_figures_are_shown_in_the_model_lines() -> None:
    from gputaskman.base.readings import ProcGpu, Reading, Reason

    claim = assess([Evidence(Source.API, model="m"), Evidence(Source.CMDLINE, model="m")])[0]
    served = ServedModel("m", vram_bytes=2 * 2**30, size_bytes=3 * 2**30)
    view = llm.build_view(claim, served=served, runtime="ollama")
    p = ProcGpu(
        1, None, "ollama", None, (), Reading.missing(Reason.NOT_LISTED, "x"), breakdown=view
    )
    text = "\n".join(model_lines(p))
    assert "runtime: model in VRAM ʳ2.0 GiB  [runtime, ollama API size_vram]" in text


def test_serve_metrics_export_the_figures_under_the_runtime_kind() -> None:
    from gputaskman.base.readings import Adapter, ProcGpu, Reading, Reason, Snapshot
    from gputaskman.render.exporter import Cached, SnapshotCollector
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    claim = assess([Evidence(Source.API, model="m"), Evidence(Source.CMDLINE, model="m")])[0]
    served = ServedModel("m", vram_bytes=2 * 2**30, kv_pool_tokens=1600, kv_used_fraction=0.5)
    view = llm.build_view(claim, served=served, runtime="vllm")
    bus = "00000000:01:00.0"
    p = ProcGpu(
        7, None, "vllm", bus, ("compute",), Reading.missing(Reason.HIDDEN, "x"), breakdown=view
    )
    snap = Snapshot(1.0, "nvml", (Adapter(0, "nvidia", "GPU", None, bus, "nvml"),), processes=(p,))
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: Cached(snap, None, 1.0, 0.01)))
    got = {
        (s.name, s.labels["figure"], s.value)
        for fam in text_string_to_metric_families(generate_latest(reg).decode())
        for s in fam.samples
        if "llm_figure" in s.name
    }
    assert got == {
        ("gputaskman_process_llm_figure_runtime_bytes", "model_vram", 2 * 2**30),
        ("gputaskman_process_llm_figure_runtime_tokens", "kv_pool", 1600),
        ("gputaskman_process_llm_figure_runtime_percent", "kv_used", 50.0),
    }
