"""The model-evidence ladder: which model a process holds, and how sure we are.

Theory of operation
-------------------
Evidence that a process holds a model file comes from five places, ranked:

``api`` > ``mapped`` > ``cmdline`` > ``path-arg`` > ``installed``

* ``api``: the runtime's own local API named the model (``/props`` ``model_path``, Ollama
  ``/api/ps``); see :mod:`gputaskman.llm`.
* ``mapped``: the file is memory-mapped by the process (``/proc/PID/maps``).
* ``cmdline``: the value of a runtime's model flag (``-m``, ``--model``, ...).
* ``path-arg``: some other argument that looks like a model file. Informational only.
* ``installed``: the file sits in a model store. Says nothing about any process.

:func:`assess` groups evidence by model (canonical path, else API name) into
:class:`ModelClaim`. Only ``api``, ``mapped`` and ``cmdline`` corroborate: a claim is
*confirmed* when at least two different of those three agree. A claim whose best evidence is
``path-arg`` (or ``installed``) is informational: ``allows_detail`` is False, which means no
process classification, no API probing, no full GGUF header read and no estimates for it.

Secrets: :func:`redact_argv` replaces the values of secret flags (``--api-key``, tokens,
passwords, ``--flag=value`` forms too) with ``<redacted>``; :func:`model_args` works on the
redacted argv, so a secret value can never become a model path. The same redaction is for
every place a command line is shown. (Helper D's ``procinfo.py`` did not exist when this was
written; if it grows its own redaction, one of the two should call the other.)
The API key itself, needed to probe a llama-server that was started with one, is taken from
the raw argv by :func:`api_key_from_argv` and handed only to the prober, never shown.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "CORROBORATING",
    "MODEL_EXTENSIONS",
    "REDACTED",
    "Evidence",
    "ModelClaim",
    "Source",
    "api_key_from_argv",
    "assess",
    "is_secret_flag",
    "model_args",
    "redact_argv",
]

REDACTED = "<redacted>"


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

# Flags whose value is a secret. Matched exactly, plus any long flag whose name contains one
# of _SECRET_WORDS (``--hf-token``, ``--openai-api-key``, ``--db-password``).
_SECRET_FLAGS = frozenset({"--api-key", "--api-key-file", "-hft", "--hf-token", "--token",
                           "--password", "--secret", "--ssl-key-file", "--auth"})
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "auth", "credential")
# Flags whose value is a model file, per runtime (llama.cpp, whisper.cpp, vLLM, others).
_MODEL_FLAGS = frozenset({"-m", "--model", "--model-path", "--model-file", "-md",
                          "--model-draft", "--mmproj", "--lora", "--model-vocoder", "-mv"})
MODEL_EXTENSIONS = (".gguf", ".ggml", ".bin", ".safetensors", ".onnx", ".pt", ".pth",
                    ".ckpt", ".llamafile", ".mlmodel", ".tflite", ".engine", ".plan")
MAX_ARGS = 512
MAX_ARG_LEN = 4096


def is_secret_flag(flag: str) -> bool:
    f = flag.split("=", 1)[0].lower()
    if f in _SECRET_FLAGS:
        return True
    return f.startswith("--") and any(w in f for w in _SECRET_WORDS)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret flag's value replaced by ``<redacted>``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-") and is_secret_flag(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def api_key_from_argv(argv: Sequence[str]) -> str | None:
    """The ``--api-key`` a llama-server was started with (for the prober only), or None."""
    for i, arg in enumerate(argv):
        if arg == "--api-key" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return None


def model_args(argv: Sequence[str], cwd: str | None = None) -> list[Evidence]:
    """``cmdline`` evidence from model flags and ``path-arg`` evidence from model-like args.

    Works on the redacted argv (a secret value is never a path). Paths are joined to ``cwd``
    when relative and resolved (symlinks, ``..``). Bounded to ``MAX_ARGS`` arguments.
    """
    args = redact_argv(list(argv)[:MAX_ARGS])
    out: list[Evidence] = []
    seen: set[tuple[Source, str]] = set()

    def add(src: Source, raw: str, detail: str) -> None:
        if not raw or raw == REDACTED or len(raw) > MAX_ARG_LEN or "\0" in raw:
            return
        path = _resolve(raw, cwd)
        if (src, path) not in seen:
            seen.add((src, path))
            out.append(Evidence(src, path=path, detail=detail))

    skip_next = False
    for i, arg in enumerate(args[1:], start=1):
        if skip_next:
            skip_next = False
            continue
        flag, eq, val = arg.partition("=")
        if arg.startswith("-") and flag in _MODEL_FLAGS:
            if eq:
                add(Source.CMDLINE, val, f"{flag}=")
            elif i + 1 < len(args):
                add(Source.CMDLINE, args[i + 1], flag)
                skip_next = True
            continue
        cand = val if (arg.startswith("-") and eq) else arg
        if cand.lower().endswith(MODEL_EXTENSIONS) and not is_secret_flag(flag):
            add(Source.PATH_ARG, cand, f"argument {i}")
    # A path given to a model flag is not also a path-arg.
    flagged = {e.path for e in out if e.source is Source.CMDLINE}
    return [e for e in out if e.source is Source.CMDLINE or e.path not in flagged]


def _resolve(path: str, cwd: str | None) -> str:
    if not os.path.isabs(path) and cwd:
        path = os.path.join(cwd, path)
    return os.path.realpath(path) if os.path.isabs(path) else os.path.normpath(path)


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
        matches = [p for p, evs in by_path.items()
                   if os.path.basename(p) == e.model or any(x.model == e.model for x in evs)]
        if len(matches) == 1:
            by_path[matches[0]].append(e)
        else:
            by_name.setdefault(e.model, []).append(e)
    claims = [ModelClaim(p, next((e.model for e in evs if e.model), None), tuple(evs))
              for p, evs in by_path.items()]
    claims += [ModelClaim(None, n, tuple(evs)) for n, evs in by_name.items()]
    claims.sort(key=lambda c: (not c.confirmed, c.best.rank, c.path or c.model or ""))
    return claims
