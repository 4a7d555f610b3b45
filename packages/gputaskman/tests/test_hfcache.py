"""The Hugging Face hub cache layout (`hfcache`), repo ids as names (`procargs.is_repo_id`),
and the folding of a process's model files into their model folder (`hubmodels`), on caches
laid out by huggingface_hub's own download code and read back with its own readers
(``try_to_load_from_cache``, ``scan_cache_dir``) as the oracle."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import huggingface_hub
import pytest
from gputaskman.base.procargs import MODEL_EXTENSIONS, is_repo_id, model_args, program, redact_argv
from gputaskman.intel import hfcache, hubmodels, stores
from gputaskman.intel.evidence import Evidence, Source, assess
from gputaskman.intel.runtimes import detect_server
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent
REPO = "gtmtest/Tiny-Qwen2.5"


def _load_helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gtm_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hf = _load_helper("hf_files")


@pytest.fixture
def cache(tmp_path: Path) -> tuple[Path, Path]:
    hf.write_model_dir(tmp_path / "src", shards=2)
    hub = tmp_path / "hub"
    return hub, hf.cache_model(hub, REPO, tmp_path / "src")


def test_snapshot_dir_agrees_with_huggingface_hub(cache: tuple[Path, Path]) -> None:
    hub, snap = cache
    oracle = huggingface_hub.try_to_load_from_cache(REPO, "config.json", cache_dir=hub)
    assert isinstance(oracle, str)
    got = hfcache.snapshot_dir([str(hub)], REPO)
    assert got is not None and got[0] == os.path.dirname(oracle) == str(snap)
    assert hfcache.snapshot_dir([str(hub)], REPO, got[1]) == got  # a commit is itself
    assert hfcache.snapshot_dir([str(hub)], REPO, "v2") is None  # no such ref
    assert hfcache.snapshot_dir([str(hub)], "other/repo") is None
    assert hfcache.snapshot_dir([str(hub)], REPO, "../../etc") is None


def test_every_cached_file_parses_to_its_repo_and_revision(cache: tuple[Path, Path]) -> None:
    hub, _ = cache
    info = huggingface_hub.scan_cache_dir(hub)
    (repo,) = info.repos
    for rev in repo.revisions:
        for f in rev.files:
            cp = hfcache.parse_cache_path(str(f.file_path))
            assert cp is not None and cp.kind == "file"
            assert (cp.repo_id, cp.revision, cp.file) == (
                repo.repo_id,
                rev.commit_hash,
                f.file_name,
            )
            blob = hfcache.parse_cache_path(str(f.blob_path))
            assert blob is not None and blob.kind == "blob" and blob.repo_id == REPO
            assert hfcache.blob_files(blob.repo_dir, blob.blob) == [(rev.commit_hash, f.file_name)]


def test_a_blob_in_two_revisions_is_read_in_the_one_main_names(tmp_path: Path) -> None:
    hf.write_model_dir(tmp_path / "src")
    hub = tmp_path / "hub"
    old = hf.cache_model(hub, REPO, tmp_path / "src", commit="a" * 40, revision="v1")
    new = hf.cache_model(hub, REPO, tmp_path / "src", commit="b" * 40, revision="main")
    blob = os.path.realpath(new / "model.safetensors")
    assert blob == os.path.realpath(old / "model.safetensors")
    ev = Evidence(Source.MAPPED, path=blob)
    (folded,) = hubmodels.fold([ev], [])
    assert folded.path == str(new) and folded.model == REPO
    assert folded.detail == "model.safetensors"


@pytest.mark.parametrize(
    "path,expect",
    [
        ("/h/models--org--name/blobs/abc", ("org/name", "blob", None, None)),
        ("/h/models--gpt2/snapshots/" + "c" * 40, ("gpt2", "snapshot", "c" * 40, None)),
        ("/h/models--o--n/snapshots/r/sub/x.bin", ("o/n", "file", "r", "sub/x.bin")),
        ("/h/datasets--o--n/blobs/abc", ("o/n", "blob", None, None)),
        ("/h/models--o--n", ("o/n", "repo", None, None)),
        ("/models/qwen/model.safetensors", None),
        ("/h/models--/blobs/x", None),
        ("/h/models--a--b--c/blobs/x", None),
    ],
)
def test_parse_cache_path(path: str, expect: tuple | None) -> None:
    cp = hfcache.parse_cache_path(path)
    got = None if cp is None else (cp.repo_id, cp.kind, cp.revision, cp.file)
    assert got == expect


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="/-.abmodelsnapshotblob_x", max_size=60))
def test_fuzz_parse_cache_path_never_raises(path: str) -> None:
    cp = hfcache.parse_cache_path(path)
    if cp is not None:
        assert cp.repo_id and "--" not in cp.repo_id


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet="abcXY09-_./~ é", max_size=20) | st.sampled_from(["a/b.gguf", "gpt2"]))
def test_is_repo_id_follows_huggingface_hub(value: str) -> None:
    try:
        validate_repo_id(value)
        valid = True
    except HFValidationError:
        valid = False
    assert is_repo_id(value) == (valid and not value.lower().endswith(MODEL_EXTENSIONS))


@pytest.mark.parametrize(
    "argv,prog,models",
    [
        (["vllm", "serve", REPO, "--port", "8000"], "vllm", [(REPO, "serve")]),
        (["/usr/bin/python3", "/usr/local/bin/vllm", "serve", REPO], "vllm", [(REPO, "serve")]),
        (
            ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", REPO],
            "vllm",
            [(REPO, "--model")],
        ),
        (
            ["python", "-m", "sglang.launch_server", "--model-path", REPO],
            "sglang",
            [(REPO, "--model-path")],
        ),
        (
            ["text-generation-launcher", "--model-id", REPO],
            "text-generation-launcher",
            [(REPO, "--model-id")],
        ),
        (
            ["python", "/opt/bin/text-generation-server", "serve", REPO, "--dtype", "bfloat16"],
            "text-generation-server",
            [(REPO, "serve")],
        ),
        (["vllm", "serve", "--port", "8000"], "vllm", []),  # no positional model: not guessed
        (["python", "-c", "import x", "serve", REPO], None, []),
        (["python", "app.py", "serve", REPO], "app", []),  # not a serving program
    ],
)
def test_program_and_its_model(argv: list[str], prog: str | None, models: list) -> None:
    assert program(argv)[0] == prog
    got = [(m.raw, m.flag) for m in model_args(redact_argv(argv))]
    assert got == models


@pytest.mark.parametrize(
    "name,argv,paths,key",
    [
        ("vllm", ("vllm", "serve", REPO), (), "vllm"),
        ("python3", ("python3", "-m", "sglang.launch_server"), (), "sglang"),
        ("text-generation-", ("text-generation-launcher",), (), "tgi"),
        ("VLLM::EngineCor", ("VLLM::EngineCore",), (), "vllm"),
        ("sglang::schedul", ("sglang::scheduler",), (), "sglang"),
        ("python3", ("python3", "x.py"), ("/venv/lib/vllm/_C.abi3.so",), "vllm"),
        ("python3", ("python3", "x.py"), ("/venv/lib/sgl_kernel/common_ops.abi3.so",), "sglang"),
        ("python3", ("python3", "train.py", "--note", "vllm"), (), None),  # a word is no program
        ("python3", ("python3", "x.py"), ("/data/vllm/notes.txt",), None),
    ],
)
def test_detect_server(name: str, argv: tuple, paths: tuple, key: str | None) -> None:
    got = detect_server(name, argv, paths)
    assert (got.key if got else None) == key


def test_fold_gives_a_local_folder_for_its_shards_and_keeps_other_files(tmp_path: Path) -> None:
    hf.write_model_dir(tmp_path / "m", shards=2)
    shard = str(tmp_path / "m" / "model-00001-of-00002.safetensors")
    lone = tmp_path / "lone.safetensors"
    lone.write_bytes(b"x")
    gguf = str(tmp_path / "m.gguf")
    got = hubmodels.fold(
        [
            Evidence(Source.MAPPED, path=shard),
            Evidence(Source.CMDLINE, path=str(tmp_path / "m"), detail="--model"),
            Evidence(Source.MAPPED, path=str(lone)),
            Evidence(Source.MAPPED, path=gguf),
        ],
        [],
    )
    assert [e.path for e in got] == [str(tmp_path / "m"), str(tmp_path / "m"), str(lone), gguf]
    claims = assess(got)
    assert claims[0].path == str(tmp_path / "m") and claims[0].confirmed


def test_a_name_no_cache_holds_stays_a_name_and_meets_the_api(tmp_path: Path) -> None:
    evs = hubmodels.fold(
        [
            Evidence(Source.CMDLINE, model=REPO, detail="serve"),
            Evidence(Source.API, model=REPO, detail="vllm API"),
        ],
        [str(tmp_path / "empty")],
    )
    assert all(e.path is None for e in evs)
    (claim,) = assess(evs)
    assert claim.model == REPO and claim.confirmed


def test_hub_roots_order_and_names(tmp_path: Path) -> None:
    roots = hubmodels.hub_roots(
        ["/base"], "root", ["vllm", "serve", "x", "--download-dir", "/dl", "--cache-dir", "rel"]
    )
    assert roots[:2] == ("/dl", "/base")
    assert roots[-1].endswith("/.cache/huggingface/hub")
    assert "rel" not in roots


def test_store_names_a_snapshot_folder_by_its_repo_not_its_hash(cache: tuple[Path, Path]) -> None:
    _, snap = cache
    n = stores.huggingface_name(str(snap))
    assert n is not None and n.name == REPO and n.detail == f"revision {snap.name[:12]}"


def test_read_header_of_a_folder_never_opens_it_as_gguf(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    got = hubmodels.read_header(str(tmp_path / "empty"))
    assert got.gguf is None and got.files is None
    assert got.error is not None and "IsADirectoryError" not in got.error
