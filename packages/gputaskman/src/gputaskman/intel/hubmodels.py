"""Where a process's model lives when it is more than one file: Hugging Face hub cache blobs
and safetensors shards folded into their model folder, repo-id names found in a hub cache,
and the model's header read in whichever format it is (GGUF or safetensors).

Theory of operation
-------------------
A safetensors model is a folder (``config.json``, one or many ``*.safetensors`` shards); a
runtime is pointed at the folder (``--model /models/qwen``) or at a hub repo id
(``--model Qwen/Qwen2.5-0.5B-Instruct``, a *name* looked up in the hub cache), and maps the
shards while it loads them, whose paths ``/proc/PID/maps`` shows resolved into the cache's
``blobs/`` (no file name, no extension). So that the three observations name one model,
:func:`fold` rewrites each piece of evidence to the model folder it belongs to, using only the
files' own structure:

* a mapped hub cache blob: the snapshot file that links to it (`hfcache.blob_files`); a
  ``.safetensors`` file becomes its snapshot folder, any other file (a GGUF) stays itself;
  either way the evidence carries the repo id as its model name;
* a mapped or named ``.safetensors`` file outside a cache: its folder, when the folder holds
  a ``config.json`` (a model folder, as transformers writes one);
* a name that is a repo id (command line or API): the snapshot folder of the revision it
  resolves to (``--revision``, else ``refs/main``) in the first cache that has it
  (`hub_roots`: gputaskman's own caches, the default cache of the user the process runs as,
  and a ``--download-dir`` / ``--huggingface-hub-cache`` the command line names); a name no
  cache has stays a name.

Nothing here makes evidence stronger or weaker: the source of each piece stays what it was,
and `evidence.assess` decides. :func:`read_header` reads the folded claim's model: a folder or
a safetensors file through `hfmodel.read_model`, anything else as GGUF. A folder holding no
safetensors is said so; a directory is never opened as a GGUF file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from gputaskman.base.procargs import flag_value, is_repo_id
from gputaskman.intel import gguf, hfcache, hfmodel
from gputaskman.intel.evidence import Evidence

try:
    import pwd
except ImportError:  # Windows: no hub caches of other users to look in
    pwd = None  # type: ignore[assignment]

__all__ = ["CACHE_FLAGS", "ModelHeader", "fold", "hub_roots", "read_header"]

# Command-line flags naming the hub cache a runtime downloads into.
CACHE_FLAGS = ("--download-dir", "--download_dir", "--huggingface-hub-cache", "--cache-dir")


def _user_home(user: str | None) -> str | None:
    if not user or pwd is None:
        return None
    try:
        return pwd.getpwnam(user).pw_dir if not user.isdigit() else pwd.getpwuid(int(user)).pw_dir
    except (KeyError, ValueError):
        return None


def hub_roots(
    base: Iterable[str], user: str | None = None, argv: Sequence[str] = ()
) -> tuple[str, ...]:
    """The hub caches to look a process's repo ids up in, in order: a cache its command line
    names, then ``base`` (this user's, `stores.default_roots`), then the default cache of the
    user the process runs as (``~user/.cache/huggingface/hub``; an ``HF_HOME`` set only in the
    process's environment is not read: environments hold secrets)."""
    roots: list[str] = []
    for flag in CACHE_FLAGS:
        v = flag_value(argv, (flag,))
        if v and os.path.isabs(v):
            roots.append(v)
    roots += list(base)
    home = _user_home(user)
    if home:
        roots.append(os.path.join(home, ".cache", "huggingface", "hub"))
    return tuple(dict.fromkeys(roots))


def _with(detail: str | None, more: str) -> str:
    return f"{detail}; {more}" if detail else more


def _pick(links: list[tuple[str, str]], repo_dir: str) -> tuple[str, str]:
    """The snapshot file of a blob: the one in ``refs/main``'s snapshot when several link it."""
    main = hfcache.snapshot_dir([os.path.dirname(repo_dir)], _repo_of(repo_dir) or "", None)
    if main is not None:
        for commit, file in links:
            if commit == main[1]:
                return commit, file
    return links[0]


def _repo_of(repo_dir: str) -> str | None:
    cp = hfcache.parse_cache_path(repo_dir)
    return cp.repo_id if cp is not None else None


def _model_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def _fold_one(e: Evidence, roots: Sequence[str], revision: str | None) -> Evidence:
    if e.path is None:
        if e.model and is_repo_id(e.model):
            hit = hfcache.snapshot_dir(roots, e.model, revision)
            if hit is not None:
                return replace(e, path=hit[0], detail=_with(e.detail, f"hub cache {hit[1][:12]}"))
        return e
    cp = hfcache.parse_cache_path(e.path)
    if cp is not None and cp.repo_type == "model":
        model = e.model or cp.repo_id
        if cp.kind == "blob" and cp.blob is not None:
            links = hfcache.blob_files(cp.repo_dir, cp.blob)
            if not links:
                return replace(e, model=model)
            commit, file = _pick(links, cp.repo_dir)
            if file.endswith(".safetensors"):
                snap = os.path.join(cp.repo_dir, "snapshots", commit)
                return replace(e, path=snap, model=model, detail=_with(e.detail, file))
            return replace(e, model=model, detail=_with(e.detail, file))
        if cp.kind == "file" and cp.file and cp.file.endswith(".safetensors") and cp.snapshot:
            return replace(e, path=cp.snapshot, model=model, detail=_with(e.detail, cp.file))
        return replace(e, model=model)
    if e.path.endswith(".safetensors") and _model_folder(os.path.dirname(e.path)):
        folder = os.path.dirname(e.path)
        return replace(e, path=folder, detail=_with(e.detail, os.path.basename(e.path)))
    return e


def fold(
    evs: Iterable[Evidence], roots: Sequence[str], revision: str | None = None
) -> list[Evidence]:
    """Each piece of evidence rewritten to the model folder it belongs to (module docstring).
    Bounded reads of the cache's own structure; never raises."""
    out = []
    for e in evs:
        try:
            out.append(_fold_one(e, roots, revision))
        except (OSError, ValueError):
            out.append(e)
    return out


@dataclass(frozen=True, slots=True)
class ModelHeader:
    """The model's header as read: GGUF, or safetensors files with ``config.json``."""

    gguf: gguf.GGUFHeader | None = None
    files: hfmodel.ModelFiles | None = None
    error: str | None = None

    @property
    def format(self) -> str | None:
        if self.gguf is not None:
            return "gguf"
        return "safetensors" if self.files is not None else None


def read_header(path: str, file: str | None = None) -> ModelHeader:
    """Read the model at ``path`` (a folded claim's path; ``file`` the name of a hub blob).
    Never raises: what could not be read is ``error``."""
    name = file or path
    if os.path.isdir(path):
        files = hfmodel.read_model(path)
        if not files.files:
            return ModelHeader(error=f"folder holds no safetensors weights ({files.errors[0]})")
        return ModelHeader(files=files, error="; ".join(files.errors) or None)
    if name.endswith(".safetensors"):
        files = hfmodel.read_model(path, file=file)
        return ModelHeader(files=files, error="; ".join(files.errors) or None)
    try:
        return ModelHeader(gguf=gguf.read_header_cached(path))
    except gguf.NotGGUFError as e:
        # ONNX, PyTorch files have no header to read here; only a file named .gguf that does
        # not begin like one is worth an error
        return ModelHeader(error=f"{type(e).__name__}: {e}" if name.endswith(".gguf") else None)
    except (OSError, gguf.GGUFError) as e:
        return ModelHeader(error=f"{type(e).__name__}: {e}")


def revision_from_argv(argv: Sequence[str]) -> str | None:
    """The ``--revision`` a runtime was given (vLLM, SGLang, TGI, transformers scripts)."""
    return flag_value(argv, ("--revision",))
