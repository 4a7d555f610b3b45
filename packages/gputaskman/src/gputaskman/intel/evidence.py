"""The model-evidence ladder: which model a process holds, and how sure we are.

Theory of operation
-------------------
Evidence that a process holds a model file comes from five places, ranked:

``api`` > ``mapped`` > ``cmdline`` > ``path-arg`` > ``installed``

* ``api``: the runtime's own local API named the model (``/props`` ``model_path``, Ollama
  ``/api/ps``); see :mod:`gputaskman.intel.llm`.
* ``mapped``: the file is memory-mapped by the process (``/proc/PID/maps``).
* ``cmdline``: the value of a runtime's model flag (``-m``, ``--model``, ...).
* ``path-arg``: some other argument that looks like a model file. Informational only.
* ``installed``: the file sits in a model store. Says nothing about any process.

:func:`assess` groups evidence by model (canonical path, else API name) into
:class:`ModelClaim`. Only ``api``, ``mapped`` and ``cmdline`` corroborate: a claim is
*confirmed* when at least two different of those three agree. A claim whose best evidence is
``path-arg`` (or ``installed``) is informational: ``allows_detail`` is False, which means no
process classification, no API probing, no full GGUF header read and no estimates for it.

Secrets: redaction and model-argument discovery are ``gputaskman.base.procargs`` (one list of
secret flags for the whole tool), run by ``procinfo`` on every scanned process; its rows
(`ModelEvidence`: redacted argv, resolved paths) become evidence through
:func:`from_procinfo`, so a secret value can never become a model path.
The API key itself, needed to probe a llama-server that was started with one, is taken from
the raw argv by :func:`api_key_from_argv` and handed only to the prober, never shown.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gputaskman.base import procargs
from gputaskman.intel import hfcache

__all__ = [
    "CORROBORATING",
    "Evidence",
    "ModelClaim",
    "ModelEvidence",
    "Source",
    "api_key_from_argv",
    "assess",
    "from_procinfo",
    "mapped_store_files",
]


class Source(StrEnum):
    API = "api"
    MAPPED = "mapped"
    CMDLINE = "cmdline"
    PATH_ARG = "path-arg"
    INSTALLED = "installed"

    @property
    def rank(self) -> int:
        """0 is strongest."""
        return _RANK[self]


_RANK = {s: i for i, s in enumerate(Source)}
CORROBORATING = frozenset({Source.API, Source.MAPPED, Source.CMDLINE})


@dataclass(frozen=True, slots=True)
class ModelEvidence:
    """One reason to think the process holds a model file: a row of ``procinfo``'s scan
    (``ProcInfo.models``), which `runtimes.classify` and `from_procinfo` read. It is defined
    here, below both procinfo and runtimes, so each imports it one way.

    `evidence` is ``mapped`` (the file is in the memory map), ``cmdline`` (the value of a
    model flag) or ``path-arg`` (a model-looking argument; informational only).
    `path` is the absolute path as the process sees it (None when relative and the cwd is
    unknown, or when the argument is a name); `raw` is the argument as written (None for
    mapped); `name` is set instead of `path` for a Hugging Face repo id on the command line
    (``--model Qwen/Qwen2.5-0.5B-Instruct`` with no such folder where the process runs): a
    name, matched against an API's and the hub cache's, never joined to the cwd. `deleted`
    means the maps line ended in ``(deleted)``. `exists` / `size_bytes` come from a stat through
    ``/proc/PID/root`` (mapped and cmdline evidence only) and are None when not checked.
    """

    evidence: str
    path: str | None
    raw: str | None = None
    flag: str | None = None
    deleted: bool = False
    exists: bool | None = None
    size_bytes: int | None = None
    name: str | None = None


def api_key_from_argv(argv: Sequence[str]) -> str | None:
    """The ``--api-key`` a llama-server was started with (for the prober only), or None."""
    return procargs.flag_value(argv, ("--api-key",))


def from_procinfo(models: Iterable[ModelEvidence]) -> list[Evidence]:
    """Evidence from ``procinfo.ProcInfo.models`` (``ModelEvidence`` rows), paths resolved.

    A row without a path (relative argument, unknown cwd) is dropped unless it is a name (a
    repo id on the command line: name-only evidence); a mapped file that was deleted keeps its
    path (the process still holds it) with ``(deleted)`` in ``detail``.
    """
    out: list[Evidence] = []
    for m in models:
        path, kind = m.path, m.evidence
        if not path and m.name and kind == Source.CMDLINE:
            out.append(Evidence(Source.CMDLINE, model=m.name, detail=m.flag))
            continue
        if not path or kind not in (Source.MAPPED, Source.CMDLINE, Source.PATH_ARG):
            continue
        real = path if m.deleted else os.path.realpath(path)
        detail = m.flag or ("(deleted)" if m.deleted else None)
        # a hub cache path names its repo by its shape alone (no I/O): the row is named at once
        cp = hfcache.parse_cache_path(real)
        model = cp.repo_id if cp is not None and cp.repo_type == "model" else None
        out.append(Evidence(Source(kind), path=real, model=model, detail=detail))
    return out


def mapped_store_files(
    paths: Iterable[str], name_for: Callable[[str], object | None], limit: int = 64
) -> list[Evidence]:
    """``mapped`` evidence for mapped files a model store names (Ollama blobs have no
    extension, so an extension filter misses them). ``name_for`` is
    ``stores.StoreIndex.name_for``; at most ``limit`` paths are looked at."""
    out = []
    for i, p in enumerate(paths):
        if i >= limit:
            break
        if name_for(p) is not None:
            out.append(Evidence(Source.MAPPED, path=os.path.realpath(p), detail="store blob"))
    return out


@dataclass(frozen=True, slots=True)
class Evidence:
    """One observation. ``path`` is canonical when known; ``model`` is an API's model id."""

    source: Source
    path: str | None = None
    model: str | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if self.path is None and self.model is None:
            raise ValueError("evidence needs a path or a model name")


@dataclass(frozen=True, slots=True)
class ModelClaim:
    """All evidence about one model of one process."""

    path: str | None
    model: str | None  # the API's name for it, when an API named it
    evidence: tuple[Evidence, ...]

    @property
    def sources(self) -> frozenset[Source]:
        return frozenset(e.source for e in self.evidence)

    @property
    def best(self) -> Source:
        return min(self.sources, key=lambda s: s.rank)

    @property
    def confirmed(self) -> bool:
        """At least two different corroborating sources (api, mapped, cmdline) agree."""
        return len(self.sources & CORROBORATING) >= 2

    @property
    def allows_detail(self) -> bool:
        """May this claim drive classification, probing, header reads and estimates?"""
        return self.best in CORROBORATING

    @property
    def status(self) -> str:
        if self.confirmed:
            return "confirmed"
        return "single source" if self.allows_detail else "informational"

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "model": self.model,
            "evidence": self.best.value,
            "sources": sorted(s.value for s in self.sources),
            "status": self.status,
            "confirmed": self.confirmed,
        }


def assess(evidence: Iterable[Evidence]) -> list[ModelClaim]:
    """Group evidence into claims, strongest first.

    Evidence with a path groups by path. API evidence with only a model name joins the one
    path claim whose file name (or API name) equals it; otherwise it stands alone.
    """
    by_path: dict[str, list[Evidence]] = {}
    names_only: list[Evidence] = []
    for e in evidence:
        if e.path is not None:
            by_path.setdefault(e.path, []).append(e)
        else:
            names_only.append(e)
    by_name: dict[str, list[Evidence]] = {}
    for e in names_only:
        assert e.model is not None
        matches = [
            p
            for p, evs in by_path.items()
            if os.path.basename(p) == e.model or any(x.model == e.model for x in evs)
        ]
        if len(matches) == 1:
            by_path[matches[0]].append(e)
        else:
            by_name.setdefault(e.model, []).append(e)
    claims = [
        ModelClaim(p, next((e.model for e in evs if e.model), None), tuple(evs))
        for p, evs in by_path.items()
    ]
    claims += [ModelClaim(None, n, tuple(evs)) for n, evs in by_name.items()]
    claims.sort(key=lambda c: (not c.confirmed, c.best.rank, c.path or c.model or ""))
    return claims
