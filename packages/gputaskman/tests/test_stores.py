"""stores.py on real directory layouts of each model store, built in temp dirs."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from gputaskman.intel.stores import StoreIndex, StoreRoots, canonical_path, default_roots

MODEL = "application/vnd.ollama.image.model"


def _blob(root: Path, content: bytes) -> tuple[str, Path]:
    hexd = hashlib.sha256(content).hexdigest()
    p = root / "blobs" / f"sha256-{hexd}"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content)
    return hexd, p


def _manifest(root: Path, reg: str, ns: str, model: str, tag: str, body: object) -> Path:
    p = root / "manifests" / reg / ns / model / tag
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(body if isinstance(body, str) else json.dumps(body))
    return p


def _layers(*digests: str, media: str = MODEL) -> dict[str, object]:
    return {
        "schemaVersion": 2,
        "config": {"digest": "sha256:" + "0" * 64},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "1" * 64}
        ]
        + [{"mediaType": media, "digest": f"sha256:{d}", "size": 4} for d in digests],
    }


@pytest.fixture
def ollama(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    root = tmp_path / "ollama" / "models"
    d1, b1 = _blob(root, b"weights-one")
    d2, b2 = _blob(root, b"weights-two")
    d3, b3 = _blob(root, b"weights-three")
    _manifest(root, "registry.ollama.ai", "library", "llama3.2", "3b", _layers(d1))
    _manifest(root, "registry.ollama.ai", "library", "llama3.2", "latest", _layers(d1))
    _manifest(root, "registry.ollama.ai", "someone", "tuned", "q4", _layers(d2))
    _manifest(root, "hf.co", "bartowski", "Qwen-GGUF", "Q4_K_M", _layers(d3))
    return root, {"one": b1, "two": b2, "three": b3}


def test_ollama_names_follow_ollama_list(ollama: tuple[Path, dict[str, Path]]) -> None:
    root, blobs = ollama
    idx = StoreIndex(StoreRoots(ollama=(str(root),)))
    one = idx.name_for(str(blobs["one"]))
    assert one is not None and one.store == "ollama"
    assert (one.name, one.aliases) == ("llama3.2:3b", ("llama3.2:latest",))
    assert idx.name_for(str(blobs["two"])).name == "someone/tuned:q4"
    assert idx.name_for(str(blobs["three"])).name == "hf.co/bartowski/Qwen-GGUF:Q4_K_M"
    assert idx.skipped_manifests == {}


def test_paths_deduplicated_however_spelled(
    ollama: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    root, blobs = ollama
    idx = StoreIndex(StoreRoots(ollama=(str(root), str(root / ".." / "models"))))
    link = tmp_path / "alias.bin"
    link.symlink_to(blobs["one"])
    dotted = str(root / "blobs" / ".." / "blobs" / blobs["one"].name)
    rel = os.path.relpath(blobs["one"], tmp_path)
    names = {idx.name_for(str(link)), idx.name_for(dotted), idx.name_for(rel, cwd=str(tmp_path))}
    assert len(names) == 1
    only = names.pop()
    assert only is not None and only.path == os.path.realpath(blobs["one"])
    # The same root spelled twice is indexed once (aliases would double otherwise).
    assert only.aliases == ("llama3.2:latest",)


def test_symlinked_ollama_root(ollama: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    root, blobs = ollama
    linked_root = tmp_path / "linked"
    linked_root.symlink_to(root)
    idx = StoreIndex(StoreRoots(ollama=(str(linked_root),)))
    assert idx.name_for(str(linked_root / "blobs" / blobs["two"].name)).name == "someone/tuned:q4"


@pytest.mark.parametrize(
    "body,reason",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "no layers list"),
        ({"layers": None}, "no layers list"),
        ({"layers": [None, 3, "x", {"mediaType": MODEL, "digest": None}]}, "no model layer"),
        ({"layers": [{"mediaType": MODEL, "digest": "sha256:zz"}]}, "no model layer"),
        ({"layers": [{"mediaType": MODEL, "digest": 12}]}, "no model layer"),
        ({"layers": [{"digest": "sha256:" + "a" * 64}]}, "no model layer"),
        ("", "not JSON"),
    ],
)
def test_odd_manifests_are_skipped_with_a_reason(tmp_path: Path, body: object, reason: str) -> None:
    root = tmp_path / "models"
    d, blob = _blob(root, b"good")
    _manifest(root, "registry.ollama.ai", "library", "good", "latest", _layers(d))
    bad = _manifest(root, "registry.ollama.ai", "library", "odd", "latest", body)
    (root / "manifests" / "registry.ollama.ai" / "library" / "odd" / "dir-not-file").mkdir()
    idx = StoreIndex(StoreRoots(ollama=(str(root),)))
    assert idx.name_for(str(blob)).name == "good:latest"
    assert idx.skipped_manifests == {str(bad): reason}


def test_oversized_manifest_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "models"
    big = _manifest(
        root, "registry.ollama.ai", "library", "big", "latest", " " * (2 * 1024 * 1024) + "{}"
    )
    idx = StoreIndex(StoreRoots(ollama=(str(root),)))
    assert idx.skipped_manifests == {str(big): "larger than the manifest cap"}


def test_lmstudio_and_its_old_cache_root(tmp_path: Path) -> None:
    new = tmp_path / ".lmstudio" / "models"
    old = tmp_path / ".cache" / "lm-studio" / "models"
    f1 = new / "lmstudio-community" / "Qwen3-4B-GGUF" / "Qwen3-4B-Q4_K_M.gguf"
    f2 = old / "TheBloke" / "Mistral-7B-GGUF" / "sub" / "mistral.Q8_0.gguf"
    for f in (f1, f2):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"GGUF")
    idx = StoreIndex(default_roots(env={"HOME": str(tmp_path)}))
    a, b = idx.name_for(str(f1)), idx.name_for(str(f2))
    assert (a.store, a.name, a.detail) == (
        "lmstudio",
        "lmstudio-community/Qwen3-4B-GGUF",
        "Qwen3-4B-Q4_K_M.gguf",
    )
    assert (b.name, b.detail) == ("TheBloke/Mistral-7B-GGUF", "sub/mistral.Q8_0.gguf")
    # A file directly under a publisher folder is not a repo file.
    loose = new / "loose.gguf"
    loose.write_bytes(b"x")
    assert idx.name_for(str(loose)) is None


def test_huggingface_hub_cache_snapshot_and_blob(tmp_path: Path) -> None:
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--Qwen--Qwen2.5-0.5B-Instruct-GGUF"
    blob = repo / "blobs" / ("ab" * 32)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"GGUF")
    snap = repo / "snapshots" / "0123abc" / "qwen2.5-0.5b-instruct-q8_0.gguf"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    nogrp = hub / "models--gpt2" / "snapshots" / "r1" / "model.safetensors"
    nogrp.parent.mkdir(parents=True)
    nogrp.write_bytes(b"x")
    idx = StoreIndex(default_roots(env={"HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}))
    via_snap = idx.name_for(str(snap))
    via_blob = idx.name_for(str(blob))
    assert via_snap.path == via_blob.path == os.path.realpath(blob)
    assert (via_snap.name, via_snap.detail) == (
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        "qwen2.5-0.5b-instruct-q8_0.gguf",
    )
    assert (via_blob.name, via_blob.detail) == ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", None)
    assert idx.name_for(str(nogrp)).name == "gpt2"


def test_default_roots_read_the_environment(tmp_path: Path) -> None:
    r = default_roots(
        env={
            "HOME": "/h",
            "OLLAMA_MODELS": "/srv/ollama",
            "HF_HUB_CACHE": "/c",
            "XDG_CACHE_HOME": "/x",
        }
    )
    assert r.ollama[0] == "/srv/ollama" and "/h/.ollama/models" in r.ollama
    assert r.huggingface == ("/c", "/x/huggingface/hub")
    assert r.lmstudio == ("/h/.lmstudio/models", "/h/.cache/lm-studio/models")


def test_unknown_and_missing_paths_give_none(tmp_path: Path) -> None:
    idx = StoreIndex(StoreRoots(ollama=(str(tmp_path / "absent"),)))
    assert idx.name_for("/etc/hostname") is None
    assert idx.name_for(str(tmp_path / "nope.gguf")) is None
    assert idx.name_for("relative/x.gguf", cwd=str(tmp_path)) is None


def test_index_rebuilds_after_ttl_only(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    idx = StoreIndex(StoreRoots(ollama=(str(root),)), ttl=3600)
    d, blob = _blob(root, b"new")
    assert idx.name_for(str(blob)) is None
    _manifest(root, "registry.ollama.ai", "library", "fresh", "latest", _layers(d))
    assert idx.name_for(str(blob)) is None  # cached index until the ttl passes
    idx.refresh(force=True)
    assert idx.name_for(str(blob)).name == "fresh:latest"


def test_canonical_path(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    assert canonical_path("a/../a/x", str(tmp_path)) == os.path.realpath(tmp_path / "a" / "x")
