"""LLM detail for one process: runtime buffer logs, and the weights / KV / compute view.

Theory of operation
-------------------
Three sources can say how a process's GPU (or host) bytes split:

1. **Runtime logs** (runtime-reported). llama.cpp prints, per device, one line per buffer::

       load_tensors:   CPU_Mapped model buffer size =     0.41 MiB
       llama_kv_cache:        CPU KV buffer size =     0.06 MiB
       sched_reserve:        CPU compute buffer size =     0.70 MiB

   (only with ``-v``; ``CUDA0`` etc. stand where ``CPU`` is on GPU builds). It prints them
   **twice**: a first sizing pass with ``0.00 MiB`` model and KV buffers, then the real ones
   (``shared/FACTS.md``). :func:`parse_buffer_log` splits the lines into passes (a model line
   after KV/compute lines, or a KV line after compute lines, opens a new pass), drops passes
   whose model and KV buffers are all zero, and returns the last complete pass (model, KV and
   compute all present), else the last pass marked incomplete. Lines of one kind and device
   in one pass add up (an SWA model prints two KV caches). :func:`read_buffer_log` reads only
   a bounded head and tail of the file and caches by (path, size, mtime).
2. **Server APIs** (runtime-reported): :mod:`gputaskman.intel.serverprobe` (re-exported here).
3. **The GGUF header** (estimated): weights from tensor sizes, KV cache from the formula in
   :mod:`gputaskman.intel.gguf`.
4. **Safetensors headers and ``config.json``** (`hfmodel`): the weights' bytes (estimated in
   VRAM), and, with a serving runtime's KV pool in tokens, the pool's bytes
   (runtime-reported; `poolview`). A runtime's other figures (Ollama's ``size_vram``, the
   pool's use) are kept beside the parts in ``figures``, never summed.

:func:`build_view` combines them for one model claim of one process. Per part, a
runtime-reported value beats an estimate; the estimate stays visible as an alternative, and
estimates are never added into a measured or runtime-reported total (``reported_total`` sums
runtime parts only, ``estimated_total`` estimates only). ``other`` is the process's measured
bytes minus the parts, computed only when every part is runtime-reported (then it is
*inferred*), never from estimates. Markers: ``*`` when only one explanation fits (a single
runtime report, or an estimate whose every input is known) or when every candidate gives
exactly the same bytes; ``?`` on the owner when the model-to-process link is heuristic
(not confirmed by two corroborating sources). A ``path-arg``-only claim gets no view at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from gputaskman.base.filecache import ParsedFiles, read_tail
from gputaskman.base.procargs import flag_value
from gputaskman.base.readings import Kind, Reading, Reason
from gputaskman.intel import poolview
from gputaskman.intel.evidence import ModelClaim
from gputaskman.intel.gguf import GGUFHeader
from gputaskman.intel.hfmodel import ModelFiles
from gputaskman.intel.kvcache import KV_CACHE_TYPES, kv_cache_estimate
from gputaskman.intel.serverprobe import (
    ListenSocket,
    ProbeResult,
    ServedModel,
    ServerProber,
    listening_sockets,
    probe,
)

__all__ = [
    "BufferSizes",
    "ListenSocket",
    "LlmView",
    "ProbeResult",
    "ServedModel",
    "ServerProber",
    "ViewPart",
    "build_view",
    "cache_types_from_argv",
    "context_from_argv",
    "listening_sockets",
    "log_files",
    "parse_buffer_log",
    "probe",
    "read_buffer_log",
]

MIB = 1024 * 1024
LOG_HEAD = 1024 * 1024
LOG_TAIL = 256 * 1024
_BUF_LINE = re.compile(
    r"(?<![\w.\-])(?P<dev>[A-Za-z][\w\-.]*)\s+(?P<kind>model|KV|compute)"
    r" buffer size\s*=\s*(?P<mib>\d+(?:\.\d+)?) MiB"
)
_KINDS = ("model", "KV", "compute")


@dataclass(frozen=True, slots=True)
class BufferSizes:
    """One pass of llama.cpp buffer lines: bytes per kind per device (runtime-reported)."""

    by_device: Mapping[str, Mapping[str, int]]  # device -> {"model"|"KV"|"compute": bytes}
    complete: bool
    source: str  # the log file

    def total(self, kind: str, device: str | None = None) -> int | None:
        vals = [
            d[kind]
            for dev, d in self.by_device.items()
            if kind in d and (device is None or dev == device)
        ]
        return sum(vals) if vals else None


def parse_buffer_log(text: str, source: str = "") -> BufferSizes | None:
    """The last complete, non-sizing pass of buffer lines in ``text`` (see module doc)."""
    passes: list[dict[str, dict[str, int]]] = []
    cur: dict[str, dict[str, int]] | None = None
    seen: set[str] = set()
    for line in text.splitlines():
        if "buffer size" not in line:
            continue
        m = _BUF_LINE.search(line)
        if not m:
            continue
        kind = m["kind"]
        if (
            cur is None
            or (kind == "model" and seen & {"KV", "compute"})
            or (kind == "KV" and "compute" in seen)
        ):
            cur = {}
            passes.append(cur)
            seen = set()
        seen.add(kind)
        dev = cur.setdefault(m["dev"], {})
        dev[kind] = dev.get(kind, 0) + round(float(m["mib"]) * MIB)

    def kinds(p: dict[str, dict[str, int]]) -> set[str]:
        return {k for d in p.values() for k in d}

    def sizing(p: dict[str, dict[str, int]]) -> bool:
        vals = [v for d in p.values() for k, v in d.items() if k in ("model", "KV")]
        return bool(vals) and all(v == 0 for v in vals)

    real = [p for p in passes if not sizing(p)]
    complete = [p for p in real if kinds(p) >= set(_KINDS)]
    if complete:
        return BufferSizes(complete[-1], True, source)
    if real:
        return BufferSizes(real[-1], False, source)
    return None


_logs: ParsedFiles[BufferSizes | None] = ParsedFiles()


def read_buffer_log(path: str) -> BufferSizes | None:
    """Parse a log file's tail (and head, if the tail has no pass); cached by (size, mtime).

    Reads at most ``LOG_TAIL + LOG_HEAD`` bytes. Raises OSError when the file is unreadable.
    """
    return _logs.get(path, lambda f, size: _parse_log_file(f, size, path))


def _parse_log_file(f: BinaryIO, size: int, path: str) -> BufferSizes | None:
    res = parse_buffer_log(read_tail(f, size, LOG_TAIL), path)
    if res is None and size > LOG_TAIL:
        f.seek(0)
        res = parse_buffer_log(
            f.read(min(LOG_HEAD, size - LOG_TAIL)).decode("utf-8", "replace"), path
        )
    return res


def log_files(
    pid: int, argv: Sequence[str] = (), cwd: str | None = None, proc: str = "/proc"
) -> list[str]:
    """Regular files the process logs to: its stdout/stderr and a ``--log-file`` argument."""
    out: list[str] = []
    for fd in (1, 2):
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except OSError:
            continue
        if (
            target.startswith("/")
            and not target.startswith("/dev/")
            and os.path.isfile(target)
            and target not in out
        ):
            out.append(target)
    val = flag_value(argv, ("--log-file",))
    if val:
        p = os.path.realpath(os.path.join(cwd or "", val))
        if p not in out:
            out.append(p)
    return out


def context_from_argv(argv: Sequence[str]) -> int | None:
    """llama.cpp's ``-c``/``--ctx-size`` (0 means "from the model"), else None."""
    v = flag_value(argv, ("-c", "--ctx-size"))
    try:
        n = int(v) if v is not None else None
    except ValueError:
        return None
    return n if n and n > 0 else None


def cache_types_from_argv(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """llama.cpp's ``-ctk``/``--cache-type-k`` and ``-ctv``/``--cache-type-v``, else None."""
    k = flag_value(argv, ("-ctk", "--cache-type-k"))
    v = flag_value(argv, ("-ctv", "--cache-type-v"))
    return (k.lower() if k else None, v.lower() if v else None)


@dataclass(frozen=True, slots=True)
class ViewPart:
    name: str  # "weights" | "kv_cache" | "compute" | "other"
    reading: Reading
    alternatives: tuple[Reading, ...] = ()
    marker: str = ""  # "*" or ""

    def to_json(self) -> dict[str, object]:
        r = self.reading
        return {
            "bytes": r.value,
            "provenance": r.kind.value,
            "source": r.source,
            "reason": r.reason.value if r.reason else None,
            "detail": r.detail,
            "marker": self.marker or None,
            "alternatives": [
                {"bytes": a.value, "provenance": a.kind.value, "source": a.source}
                for a in self.alternatives
            ],
        }


@dataclass(frozen=True, slots=True)
class LlmView:
    """The model a process holds and how its bytes split; see the module docstring."""

    model: str | None
    path: str | None
    evidence: str
    status: str  # "confirmed" | "single source"
    owner_marker: str  # "?" or ""
    runtime: str | None = None
    architecture: str | None = None
    file_type: str | None = None
    parameter_count: int | None = None
    n_ctx: int | None = None
    n_ctx_source: str | None = None
    parts: tuple[ViewPart, ...] = ()
    reported_total: int | None = None
    estimated_total: int | None = None
    notes: tuple[str, ...] = field(default=())
    format: str | None = None  # "gguf" | "safetensors": the header read
    kv_cache_dtype: str | None = None  # the runtime's KV cache dtype, when it says
    # a runtime's own figures beside the parts (runtime-reported); None: no runtime answered
    figures: tuple[tuple[str, Reading], ...] | None = None

    def part(self, name: str) -> ViewPart | None:
        return next((p for p in self.parts if p.name == name), None)

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "path": self.path,
            "evidence": self.evidence,
            "status": self.status,
            "owner_marker": self.owner_marker or None,
            "runtime": self.runtime,
            "architecture": self.architecture,
            "file_type": self.file_type,
            "parameter_count": self.parameter_count,
            "n_ctx": self.n_ctx,
            "n_ctx_source": self.n_ctx_source,
            "parts": {p.name: p.to_json() for p in self.parts},
            "reported_total": self.reported_total,
            "estimated_total": self.estimated_total,
            "notes": list(self.notes),
            "format": self.format,
            "kv_cache_dtype": self.kv_cache_dtype,
            "figures": {
                n: {"value": r.value, "provenance": r.kind.value, "source": r.source}
                for n, r in self.figures or ()
            },
        }


def _choose(
    name: str, runtime: list[Reading], estimates: list[tuple[Reading, bool]], missing_source: str
) -> ViewPart:
    """Runtime beats estimate. ``estimates`` carry whether all their inputs were known."""
    cands = runtime + [e for e, _ in estimates]
    if not cands:
        return ViewPart(
            name, Reading.missing(Reason.UNAVAILABLE, missing_source, kind=Kind.ESTIMATED)
        )
    chosen = cands[0]
    values = {c.value for c in cands}
    if len(values) == 1 and len(cands) > 1:
        marker = "*"  # every explanation gives exactly the same bytes
    elif runtime:
        marker = "*" if len(runtime) == 1 else ""
    else:
        marker = "*" if len(estimates) == 1 and estimates[0][1] else ""
    return ViewPart(name, chosen, tuple(cands[1:]), marker)


def build_view(
    claim: ModelClaim,
    *,
    header: GGUFHeader | None = None,
    files: ModelFiles | None = None,
    buffers: BufferSizes | None = None,
    served: ServedModel | None = None,
    runtime: str | None = None,
    friendly_name: str | None = None,
    argv: Sequence[str] = (),
    server_argv: Sequence[str] = (),
    device: str | None = None,
    measured_bytes: int | None = None,
) -> LlmView | None:
    """The view of one model claim; None for an informational (path-arg only) claim.

    ``header``: the model's GGUF header (read only when ``claim.allows_detail``); ``files``:
    its safetensors headers and config.json instead. ``server_argv``: the command line of
    the process whose API answered (its ``--dtype``, tensor-parallel size), else ``argv``.
    ``buffers``: parsed runtime log; ``served``: the API's row for this model.
    ``device``: restrict log buffers to one device (e.g. ``CUDA0``); None sums all.
    ``measured_bytes``: the process's measured bytes on that device, for ``other``.
    """
    if not claim.allows_detail:
        return None
    notes: list[str] = []
    # Context size: API > cmdline > header (the header's is the training context).
    n_ctx, n_ctx_src = None, None
    if served and served.n_ctx:
        n_ctx, n_ctx_src = served.n_ctx, "api"
    elif context_from_argv(argv):
        n_ctx, n_ctx_src = context_from_argv(argv), "cmdline"
    # Cache types: llama.cpp's default is f16 for both, so its argv settles them; other
    # runtimes choose elsewhere (Ollama: OLLAMA_KV_CACHE_TYPE), so f16 is then an assumption.
    ctk, ctv = cache_types_from_argv(argv)
    types_known = bool(argv) and runtime == "llama.cpp"
    ctk = ctk or "f16"
    ctv = ctv or ctk
    if ctk not in KV_CACHE_TYPES or ctv not in KV_CACHE_TYPES:
        notes.append(f"KV cache type {ctk}/{ctv} has no formula here; estimated as f16")
        ctk = ctv = "f16"
        types_known = False

    weights_rt: list[Reading] = []
    kv_rt: list[Reading] = []
    compute_rt: list[Reading] = []
    dev_label = device or "all devices"
    if buffers is not None:
        src = f"llama.cpp log {os.path.basename(buffers.source)} ({dev_label})"
        for kind, bucket in (("model", weights_rt), ("KV", kv_rt), ("compute", compute_rt)):
            v = buffers.total(kind, device)
            if v is not None:
                bucket.append(Reading.runtime(v, f"{src}: {kind} buffer"))
        if not buffers.complete:
            notes.append("log has no complete set of buffer lines yet")
    w_rt, weights_est = poolview.weights_readings(served, runtime, files)
    weights_rt += w_rt
    pool, pool_notes = poolview.kv_pool_reading(served, runtime, files, server_argv or argv)
    if pool is not None:
        kv_rt.append(pool)
    notes += pool_notes
    kv_est: list[tuple[Reading, bool]] = []
    if header is not None:
        wb = header.weights_bytes
        if wb is not None:
            weights_est.append((Reading.estimated(wb, "gguf tensor sizes"), True))
        kv = kv_cache_estimate(header, n_ctx, ctk, ctv)
        if kv is not None:
            src = (
                f"gguf KV formula ({kv.cache_type_k}/{kv.cache_type_v}, n_ctx={kv.n_ctx} "
                f"from {n_ctx_src or kv.n_ctx_source})"
            )
            kv_est.append((Reading.estimated(kv.bytes, src), n_ctx is not None and types_known))
            notes.extend(kv.notes)
            if n_ctx is None:
                n_ctx, n_ctx_src = kv.n_ctx, kv.n_ctx_source

    parts = [
        _choose("weights", weights_rt, weights_est, "no log, API or header size"),
        _choose("kv_cache", kv_rt, kv_est, "no log or header KV shape"),
        _choose("compute", compute_rt, [], "compute buffers only come from runtime logs"),
    ]
    all_runtime = all(p.reading.kind is Kind.RUNTIME and p.reading.known for p in parts)
    if measured_bytes is not None and all_runtime:
        rest = measured_bytes - sum(int(p.reading.value or 0) for p in parts)
        other = (
            Reading.inferred(rest, "measured minus runtime-reported parts")
            if rest >= 0
            else Reading.missing(
                Reason.UNAVAILABLE,
                "measured minus runtime-reported parts",
                "parts exceed the measured bytes",
                Kind.INFERRED,
            )
        )
    else:
        other = Reading.missing(
            Reason.UNAVAILABLE,
            "measured minus runtime-reported parts",
            "needs measured bytes and runtime-reported parts",
            Kind.INFERRED,
        )
    parts.append(ViewPart("other", other))

    rt_vals = [
        int(p.reading.value)
        for p in parts[:3]
        if p.reading.kind is Kind.RUNTIME and p.reading.value is not None
    ]
    est_vals = [
        int(p.reading.value)
        for p in parts[:3]
        if p.reading.kind is Kind.ESTIMATED and p.reading.value is not None
    ]
    name = (
        friendly_name
        or claim.model
        or (header.name if header else None)
        or (os.path.basename(claim.path) if claim.path else None)
    )
    return LlmView(
        model=name,
        path=claim.path,
        evidence=claim.best.value,
        status=claim.status,
        owner_marker="" if claim.confirmed else "?",
        runtime=runtime,
        architecture=header.architecture
        if header
        else (files.config.model_type if files and files.config else None),
        file_type=header.file_type if header else (files.file_type if files else None),
        parameter_count=header.parameter_count
        if header
        else (files.parameter_count if files else None) or (served.n_params if served else None),
        n_ctx=n_ctx,
        n_ctx_source=n_ctx_src,
        parts=tuple(parts),
        reported_total=sum(rt_vals) if rt_vals else None,
        estimated_total=sum(est_vals) if est_vals else None,
        notes=tuple(notes),
        format="gguf" if header is not None else ("safetensors" if files is not None else None),
        kv_cache_dtype=(
            poolview.kv_cache_dtype(
                served, server_argv or argv, files.config if files else None, runtime
            )
            if served is not None and (served.kv_pool_tokens or served.kv_cache_dtype)
            else None
        ),
        figures=poolview.figures(served, runtime, pool),
    )
