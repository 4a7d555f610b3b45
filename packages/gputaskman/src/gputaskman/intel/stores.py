"""Friendly model names from local model stores: Ollama, LM Studio, Hugging Face hub cache.

Theory of operation
-------------------
A process maps or names a file; this module turns that file's path into the name a person
knows it by (``llama3.2:3b``, ``bartowski/Llama-3.2-3B-Instruct-GGUF``, ``Qwen/Qwen2.5-0.5B``).
**Names only, never evidence**: a store knowing a file says nothing about whether a process
holds it; :mod:`gputaskman.intel.evidence` decides that.

Every path is first made canonical with :func:`canonical_path` (relative paths joined to the
process's working directory, then ``os.path.realpath``: symlinks and ``..`` resolved), so the
same file matches however it was spelled. The stores:

* **Ollama** (``$OLLAMA_MODELS``, ``~/.ollama/models``, ``/usr/share/ollama/.ollama/models``):
  ``manifests/<registry>/<namespace>/<model>/<tag>`` is JSON whose ``layers`` list holds
  ``{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:<hex>"}``; the
  weights are ``blobs/sha256-<hex>``. Names follow ``ollama list``: ``model:tag`` for the
  default ``registry.ollama.ai/library``, ``namespace/model:tag`` for other namespaces, the
  registry host in front for other registries. Manifests are size-capped and read null-safe:
  anything of the wrong shape is skipped and counted with a reason.
* **LM Studio** (``~/.lmstudio/models``, ``~/.cache/lm-studio/models``):
  ``<publisher>/<repo>/<file>`` gives ``publisher/repo`` (the file name is ``detail``).
* **Hugging Face hub cache** (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
  ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``):
  ``models--<org>--<name>/snapshots/<rev>/<file>`` is a symlink into ``blobs/<sha>``; once
  resolved, the path holds ``models--<org>--<name>/blobs/``, which names ``org/name``; a
  snapshot folder (a model folder a runtime was pointed at) names its repo and revision. The
  path shape suffices (`hfcache`), so no index is built (the file name in ``detail`` needs
  the snapshot path, so a resolved blob reports ``detail=None``).

Only Ollama needs an index (digest to names); :class:`StoreIndex` builds it with a bounded walk
(``MAX_MANIFESTS``) and rebuilds it at most every ``ttl`` seconds.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gputaskman.intel import hfcache

__all__ = [
    "StoreIndex",
    "StoreName",
    "StoreRoots",
    "canonical_path",
    "default_roots",
    "huggingface_name",
]

OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT_REGISTRY = "registry.ollama.ai"
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_MANIFESTS = 20_000
_HEX = re.compile(r"[0-9a-fA-F]{16,128}\Z")


@dataclass(frozen=True, slots=True)
class StoreName:
    """A friendly name for one file. ``aliases`` are further names of the same file."""

    path: str  # canonical path
    name: str
    store: str  # "ollama" | "lmstudio" | "huggingface"
    detail: str | None = None
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StoreRoots:
    ollama: tuple[str, ...] = ()
    lmstudio: tuple[str, ...] = ()
    huggingface: tuple[str, ...] = ()


def canonical_path(path: str, cwd: str | None = None) -> str:
    """``path`` joined to ``cwd`` when relative, with symlinks and ``..`` resolved."""
    if not os.path.isabs(path) and cwd:
        path = os.path.join(cwd, path)
    return os.path.realpath(path)


def default_roots(env: Mapping[str, str] | None = None, home: str | None = None) -> StoreRoots:
    """The store folders for this user, from the environment the way each tool reads it."""
    env = os.environ if env is None else env
    home = home or env.get("HOME") or os.path.expanduser("~")
    ollama = [env["OLLAMA_MODELS"]] if env.get("OLLAMA_MODELS") else []
    ollama += [os.path.join(home, ".ollama", "models"), "/usr/share/ollama/.ollama/models"]
    lms = [
        os.path.join(home, ".lmstudio", "models"),
        os.path.join(home, ".cache", "lm-studio", "models"),
    ]
    hf = []
    if env.get("HF_HUB_CACHE"):
        hf.append(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        hf.append(os.path.join(env["HF_HOME"], "hub"))
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    hf.append(os.path.join(xdg, "huggingface", "hub"))
    return StoreRoots(
        tuple(dict.fromkeys(ollama)), tuple(dict.fromkeys(lms)), tuple(dict.fromkeys(hf))
    )


def huggingface_name(canonical: str) -> StoreName | None:
    """Name a file or snapshot folder by its Hugging Face hub cache path shape, wherever the
    cache lives (`hfcache.parse_cache_path`): a snapshot file's detail is its path in the
    snapshot, a snapshot folder's its revision, a blob's None."""
    cp = hfcache.parse_cache_path(canonical)
    if cp is None or cp.repo_type != "model" or cp.kind == "repo":
        return None
    if cp.kind == "file":
        detail = cp.file
    elif cp.kind == "snapshot" and cp.revision:
        detail = f"revision {cp.revision[:12]}"
    else:
        detail = None
    return StoreName(canonical, cp.repo_id, "huggingface", detail)


def _ollama_name(registry: str, namespace: str, model: str, tag: str) -> str:
    if registry == OLLAMA_DEFAULT_REGISTRY:
        base = model if namespace == "library" else f"{namespace}/{model}"
    else:
        base = f"{registry}/{namespace}/{model}"
    return f"{base}:{tag}"


def _read_manifest_digests(path: str) -> tuple[list[str], str | None]:
    """Model-layer digests (hex) of one manifest, or ([], reason)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        return [], f"unreadable: {e.strerror or e}"
    if len(raw) > MAX_MANIFEST_BYTES:
        return [], "larger than the manifest cap"
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return [], "not JSON"
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        return [], "no layers list"
    out = []
    for layer in layers:
        if not isinstance(layer, dict) or layer.get("mediaType") != OLLAMA_MODEL_MEDIA:
            continue
        digest = layer.get("digest")
        if isinstance(digest, str) and digest.startswith("sha256:"):
            hexpart = digest[len("sha256:") :]
            if _HEX.match(hexpart):
                out.append(hexpart.lower())
    return out, None if out else "no model layer"


@dataclass
class _OllamaIndex:
    blobs: dict[str, list[str]] = field(default_factory=dict)  # canonical blob path -> names
    skipped: dict[str, str] = field(default_factory=dict)  # manifest path -> reason
    manifests: int = 0
    truncated: bool = False


def _build_ollama(roots: tuple[str, ...]) -> _OllamaIndex:
    idx = _OllamaIndex()
    seen_roots: set[str] = set()
    for root in roots:
        croot = canonical_path(root)
        if croot in seen_roots:
            continue
        seen_roots.add(croot)
        mdir = os.path.join(croot, "manifests")
        # Exactly four levels: registry / namespace / model / tag.
        for reg in _listdir(mdir):
            for ns in _listdir(os.path.join(mdir, reg)):
                for model in _listdir(os.path.join(mdir, reg, ns)):
                    mpath = os.path.join(mdir, reg, ns, model)
                    for tag in _listdir(mpath):
                        if idx.manifests >= MAX_MANIFESTS:
                            idx.truncated = True
                            return idx
                        fpath = os.path.join(mpath, tag)
                        if not os.path.isfile(fpath):
                            continue
                        idx.manifests += 1
                        digests, reason = _read_manifest_digests(fpath)
                        if reason:
                            idx.skipped[fpath] = reason
                        name = _ollama_name(reg, ns, model, tag)
                        for d in digests:
                            blob = canonical_path(os.path.join(croot, "blobs", f"sha256-{d}"))
                            names = idx.blobs.setdefault(blob, [])
                            if name not in names:
                                names.append(name)
    for names in idx.blobs.values():
        names.sort()
    return idx


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


class StoreIndex:
    """Looks up friendly names; thread-safe; the Ollama index is rebuilt at most every ``ttl`` s.

    ``name_for(path, cwd)`` is the one call the collector needs. It never raises for odd
    input: an unknown or unreadable path gives None.
    """

    def __init__(self, roots: StoreRoots | None = None, ttl: float = 60.0) -> None:
        self.roots = roots if roots is not None else default_roots()
        self.ttl = ttl
        self._lock = threading.Lock()
        self._ollama: _OllamaIndex | None = None
        self._built_at = 0.0
        self._lms = tuple(dict.fromkeys(canonical_path(r) for r in self.roots.lmstudio))

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            if force or self._ollama is None or time.monotonic() - self._built_at > self.ttl:
                self._ollama = _build_ollama(self.roots.ollama)
                self._built_at = time.monotonic()

    @property
    def skipped_manifests(self) -> dict[str, str]:
        """Ollama manifests that were skipped, with the reason (for diagnostics)."""
        self.refresh()
        assert self._ollama is not None
        return dict(self._ollama.skipped)

    def name_for(self, path: str, cwd: str | None = None) -> StoreName | None:
        try:
            cpath = canonical_path(path, cwd)
        except (OSError, ValueError):
            return None
        self.refresh()
        assert self._ollama is not None
        names = self._ollama.blobs.get(cpath)
        if names:
            return StoreName(cpath, names[0], "ollama", None, tuple(names[1:]))
        for root in self._lms:
            rel = os.path.relpath(cpath, root)
            parts = rel.split(os.sep)
            if rel == os.pardir or rel.startswith(os.pardir + os.sep) or len(parts) < 3:
                continue
            return StoreName(cpath, f"{parts[0]}/{parts[1]}", "lmstudio", "/".join(parts[2:]))
        # The snapshot spelling carries the file name; the resolved blob does not.
        spelled = huggingface_name(os.path.normpath(os.path.join(cwd or "", path)))
        if spelled is not None and spelled.detail is not None:
            return StoreName(cpath, spelled.name, "huggingface", spelled.detail)
        return huggingface_name(cpath)
