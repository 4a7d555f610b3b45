"""The Hugging Face hub cache as huggingface_hub lays it out: which repo, revision and file a
cached path is, and which snapshot directory a repo id names.

Theory of operation
-------------------
huggingface_hub (``file_download.py``: ``hf_hub_download``, ``_create_symlink``,
``_cache_commit_hash_for_specific_revision``; its "Manage the cache" guide) keeps one folder
per repo under the cache root::

    <cache>/models--<org>--<name>/
        blobs/<etag>                 the file's bytes (sha256 for LFS files, git sha1 else)
        snapshots/<commit>/<path>    relative symlinks into ../../blobs/<etag>
        refs/<revision>              text: the commit a branch or tag resolved to ("main")

A process that memory-maps a cached file (safetensors' ``safe_open`` does) shows the
*resolved* path in ``/proc/PID/maps``: ``.../models--Qwen--Qwen2.5-0.5B/blobs/<sha>``, with no
file name and no extension. :func:`parse_cache_path` reads the repo, and the revision and
file where the path has them, from the path's shape alone (sans-io). :func:`blob_files`
finds which snapshot files link to a blob by reading the cache's own symlinks (bounded:
`MAX_SNAPSHOTS` snapshots, `MAX_FILES` entries). :func:`snapshot_dir` turns a repo id (a name
on a command line or in an API answer, never a path) and a revision into the snapshot folder
through ``refs/``.

A repo id is ``name`` or ``namespace/name`` (`base.procargs.is_repo_id`, huggingface_hub's
``validate_repo_id`` rules). Everything here is a name or a place, never evidence that a
process holds the model: `evidence` decides that.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MAX_FILES",
    "MAX_SNAPSHOTS",
    "CachePath",
    "blob_files",
    "parse_cache_path",
    "repo_folder",
    "snapshot_dir",
]

MAX_SNAPSHOTS = 16
MAX_FILES = 4096
MAX_REF_BYTES = 256
_COMMIT = re.compile(r"[0-9a-f]{40}\Z")
_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


@dataclass(frozen=True, slots=True)
class CachePath:
    """Where a path sits in a hub cache. `kind` is ``blob`` (``blobs/<etag>``), ``file``
    (``snapshots/<commit>/<file>``), ``snapshot`` (the ``snapshots/<commit>`` folder) or
    ``repo`` (the repo folder or another place inside it)."""

    repo_dir: str
    repo_id: str
    repo_type: str  # "model" | "dataset" | "space"
    kind: str
    revision: str | None = None  # the snapshot's commit
    file: str | None = None  # path inside the snapshot
    blob: str | None = None  # the blob's etag

    @property
    def snapshot(self) -> str | None:
        """The snapshot folder of a ``file`` or ``snapshot`` path."""
        if self.revision is None:
            return None
        return os.path.join(self.repo_dir, "snapshots", self.revision)


def repo_folder(repo_id: str, repo_type: str = "model") -> str:
    """The cache folder name of a repo: ``models--org--name`` (huggingface_hub's
    ``repo_folder_name``)."""
    return "--".join([f"{repo_type}s", *repo_id.split("/")])


def parse_cache_path(path: str) -> CachePath | None:
    """Read a cached path's repo (and revision, file or blob) from its shape; None when no
    part of it is a ``models--``/``datasets--``/``spaces--`` folder. Pure string work."""
    parts = path.split("/")
    for i in range(len(parts) - 1, -1, -1):
        head, sep, rest = parts[i].partition("--")
        if not sep or head not in _TYPES or not rest:
            continue
        repo_id = rest.replace("--", "/", 1)
        if "--" in repo_id or repo_id.startswith("/") or repo_id.endswith("/"):
            continue
        repo_dir = "/".join(parts[: i + 1])
        tail = parts[i + 1 :]
        kind, rev, file, blob = "repo", None, None, None
        if len(tail) == 2 and tail[0] == "blobs" and tail[1]:
            kind, blob = "blob", tail[1]
        elif len(tail) >= 2 and tail[0] == "snapshots" and tail[1]:
            rev = tail[1]
            rel = "/".join(t for t in tail[2:] if t)
            kind, file = ("file", rel) if rel else ("snapshot", None)
        return CachePath(repo_dir, repo_id, _TYPES[head], kind, rev, file, blob)
    return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


_blob_cache: dict[tuple[str, tuple[tuple[str, int], ...]], dict[str, list[tuple[str, str]]]] = {}
_blob_lock = threading.Lock()
_BLOB_CACHE_MAX = 64


def _snapshot_stamp(repo_dir: str) -> tuple[tuple[str, int], ...]:
    out = []
    for rev in _listdir(os.path.join(repo_dir, "snapshots"))[:MAX_SNAPSHOTS]:
        try:
            out.append((rev, os.stat(os.path.join(repo_dir, "snapshots", rev)).st_mtime_ns))
        except OSError:
            continue
    return tuple(out)


def _walk_links(
    repo_dir: str, stamp: tuple[tuple[str, int], ...]
) -> dict[str, list[tuple[str, str]]]:
    """blob etag -> [(commit, file)] for every symlink in the snapshots (bounded)."""
    out: dict[str, list[tuple[str, str]]] = {}
    seen = 0
    blobs = os.path.join(repo_dir, "blobs")
    for rev, _ in stamp:
        top = os.path.join(repo_dir, "snapshots", rev)
        stack = [""]
        while stack and seen < MAX_FILES:
            rel = stack.pop()
            here = os.path.join(top, rel) if rel else top
            for name in _listdir(here):
                seen += 1
                if seen > MAX_FILES:
                    break
                sub = f"{rel}/{name}" if rel else name
                full = os.path.join(here, name)
                try:
                    target = os.readlink(full)
                except OSError:  # not a link: a folder to walk, or a copied file
                    if os.path.isdir(full) and not os.path.islink(full):
                        stack.append(sub)
                    continue
                real = os.path.normpath(os.path.join(here, target))
                if os.path.dirname(real) == os.path.normpath(blobs):
                    out.setdefault(os.path.basename(real), []).append((rev, sub))
    return out


def blob_files(repo_dir: str, blob: str) -> list[tuple[str, str]]:
    """``(commit, file)`` for every snapshot file that links to ``blobs/<blob>``, read from the
    cache's own symlinks; [] when none does (or the cache cannot be read). Cached while the
    snapshot folders keep their modification times."""
    stamp = _snapshot_stamp(repo_dir)
    key = (repo_dir, stamp)
    with _blob_lock:
        hit = _blob_cache.get(key)
    if hit is None:
        hit = _walk_links(repo_dir, stamp)
        with _blob_lock:
            if len(_blob_cache) >= _BLOB_CACHE_MAX:
                _blob_cache.clear()
            _blob_cache[key] = hit
    return sorted(hit.get(blob, []))


def _read_ref(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_REF_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if _COMMIT.match(text) else None


def snapshot_dir(
    roots: Iterable[str], repo_id: str, revision: str | None = None
) -> tuple[str, str] | None:
    """``(snapshot folder, commit)`` of ``repo_id`` at ``revision`` (a commit, or a branch or
    tag read through ``refs/``; ``main`` when None) in the first cache root that holds it;
    None when none does. A repo id is a name: it is never joined to a working directory."""
    rev = revision or "main"
    if "/" in rev.replace("refs/pr/", "", 1) or rev in (".", ".."):
        return None
    for root in roots:
        repo_dir = os.path.join(root, repo_folder(repo_id))
        commit = rev if _COMMIT.match(rev) else _read_ref(os.path.join(repo_dir, "refs", rev))
        if commit is None:
            continue
        snap = os.path.join(repo_dir, "snapshots", commit)
        if os.path.isdir(snap):
            return snap, commit
    return None
