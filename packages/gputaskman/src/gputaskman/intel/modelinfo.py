"""Which model a process holds, and its weights / KV cache / compute view, for the collector.

Theory of operation
-------------------
The collector hands every row it shows to `ModelResolver.resolve` with the `procinfo.ProcInfo`
of that process. Resolution has two halves:

* **Cheap, on the collector's thread** (no I/O): the evidence procinfo already found
  (``mapped``, ``cmdline``, ``path-arg``) goes through `evidence.assess`, giving a
  `model.ModelRef` at once, named after the file.
* **Costly, in `gather`**: everything that does I/O. Mapped Ollama blobs (no model extension)
  are found by re-reading ``/proc/PID/maps`` for LLM-looking processes; the store index names
  the files; the process's own listening ports are probed (GET only, short timeouts) when a
  claim allows detail, procinfo classified an LLM runtime from mapped libraries or detected a
  serving runtime (`runtimes.detect_server`); a process whose own ports do not answer is
  linked to the process that answers for it (`api_owners`: an Ollama runner's ``ollama
  serve``, a vLLM engine core's or worker's API server, a TGI shard's router); the evidence is
  folded into model folders (`hubmodels.fold`: hub cache blobs and safetensors shards, repo
  ids looked up in the hub cache); the model's header is read (GGUF: 90-200 ms for a real
  model; safetensors headers and ``config.json``; cached by path/size/mtime); the runtime's
  buffer log is parsed; an app adapter (`apps`) reads the selected model.
  `gather` returns `Inputs`; `llm.build_view` then turns them plus this refresh's measured
  bytes into an `llm.LlmView` (pure arithmetic, done every refresh).

With ``background=True`` (the TUI and ``record``) `gather` runs on a small thread pool: a
refresh never waits on it; a row shows the cheap ref (``pending``) until its job finishes,
and results are re-gathered every `ttl` seconds (logs and APIs change). With
``background=False`` (``--once``/``--json``) `gather` runs inline, so one-shot output is
complete. A path-arg-only claim is informational: no probing, header read or estimates.

The raw (unredacted) command line is read here only for the API key a llama-server was
started with and for ``--log-file``; it is never stored in a result or shown.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gputaskman.base import procfs
from gputaskman.base.procargs import program, redact_argv, split_cmdline
from gputaskman.base.readings import ModelRef
from gputaskman.intel import apps, evidence, gguf, hfcache, hfmodel, hubmodels, llm, stores
from gputaskman.intel.evidence import Evidence, ModelClaim, Source
from gputaskman.intel.runtimes import LLM, SERVER_PROGRAMS, SERVER_TITLES

if TYPE_CHECKING:
    from gputaskman.intel.procinfo import ProcInfo

__all__ = ["Inputs", "ModelResolver", "Resolved", "gather"]

# Mapped files looked at for store blobs (an Ollama runner maps few; a browser maps many).
MAX_STORE_PATHS = 64
# Process names whose mapped files are checked against the store index even without a
# model extension (Ollama's runner maps a blob named sha256-<hex>).
BLOB_PROCESS_NAMES = ("ollama", "ollama_llama_se", "ollama-runner")


@dataclass(frozen=True, slots=True)
class Inputs:
    """What `gather` found for one process (all I/O done)."""

    claims: tuple[ModelClaim, ...]
    friendly: Mapping[str, stores.StoreName] = field(default_factory=dict)  # path -> name
    header: gguf.GGUFHeader | None = None
    header_error: str | None = None
    buffers: llm.BufferSizes | None = None
    probe: llm.ProbeResult | None = None
    probed_pid: int | None = None
    runtime: str | None = None
    app: apps.AppModel | None = None
    cost_s: float = 0.0
    files: hfmodel.ModelFiles | None = None  # safetensors headers and config.json
    server_argv: tuple[str, ...] = ()  # the redacted command line of the process probed


@dataclass(frozen=True, slots=True)
class Resolved:
    """One row's model: the ref (None: no model known), the view, the app's selection."""

    ref: ModelRef | None = None
    view: llm.LlmView | None = None
    app: apps.AppModel | None = None


def _runtime_hint(info: ProcInfo) -> str | None:
    """The API table to try, from the mapped runtime libraries (None: try every table)."""
    keys = set(info.runtime_keys)
    name = (info.name or "").lower()
    if info.server is not None:
        return info.server.key
    if name.startswith("ollama"):
        return "ollama"
    if "llama" in keys or any(k.startswith("ggml") for k in keys) or name.startswith("llama"):
        return "llama.cpp"
    if name.startswith("lm studio") or name.startswith("lms"):
        return "lmstudio"
    return None


def _llm_by_libraries(info: ProcInfo) -> bool:
    c = info.classification
    return c is not None and c.category == LLM and not c.heuristic


def cheap_claims(info: ProcInfo) -> list[ModelClaim]:
    """Claims from procinfo's evidence only (no I/O)."""
    return evidence.assess(evidence.from_procinfo(info.models))


def _raw_argv(pid: int, proc: str) -> tuple[str, ...]:
    try:
        return split_cmdline(procfs.read_proc(pid, "cmdline", root=proc))
    except procfs.ProcError:
        return ()


def _store_blobs(info: ProcInfo, index: stores.StoreIndex, proc: str) -> list[Evidence]:
    """``mapped`` evidence for mapped store files without a model extension."""
    from gputaskman.intel.procinfo import mapped_paths

    try:
        text = procfs.read_proc(info.pid, "maps", root=proc).decode("utf-8", "replace")
    except procfs.ProcError:
        return []
    paths = sorted(p for p in mapped_paths(text) if ".so" not in os.path.basename(p))
    return evidence.mapped_store_files(paths, index.name_for, limit=MAX_STORE_PATHS)


def _link_names(
    api: Sequence[Evidence], friendly: Mapping[str, stores.StoreName]
) -> list[Evidence]:
    """Give name-only API evidence (Ollama's ``/api/ps`` names ``llama3.2:3b``) the path of
    the one mapped blob the store index calls by that name."""
    out = []
    for e in api:
        if e.path is None and e.model is not None:
            hits = [p for p, n in friendly.items() if e.model == n.name or e.model in n.aliases]
            if len(hits) == 1:
                e = replace(e, path=hits[0])
        out.append(e)
    return out


def _server_of(pid: int, proc: str) -> str | None:
    """The serving runtime a process runs, from its name and command line alone."""
    try:
        st = procfs.read_stat(pid, root=proc)
        argv = split_cmdline(procfs.read_proc(pid, "cmdline", root=proc))
    except procfs.ProcError:
        return None
    if st.name.lower().startswith("ollama"):
        return "ollama"
    prog = program(argv)[0]
    if prog in SERVER_PROGRAMS:
        return SERVER_PROGRAMS[prog]
    seen = [st.name.lower(), *(a.lower() for a in argv[:1])]
    return next((k for p, k in SERVER_TITLES for x in seen if x.startswith(p)), None)


def _children(pid: int, proc: str) -> list[int]:
    try:
        raw = procfs.read_proc(pid, f"task/{pid}/children", root=proc)
    except procfs.ProcError:
        return []  # a kernel without CONFIG_PROC_CHILDREN: no siblings to look at
    return [int(x) for x in raw.split()[:64] if x.isdigit()]


def api_owners(pid: int, runtime: str | None, proc: str = procfs.PROC) -> list[tuple[int, str]]:
    """Processes whose API answers for ``pid``'s model, nearest first, as ``(pid, runtime)``:
    an ``ollama serve`` parent (its runner's port is not the documented API); a parent (up
    to 3 levels) running the same serving runtime (vLLM's engine core and workers, SGLang's
    scheduler, whose API server spawned them); for text-generation-inference, the router its
    launcher started beside the shard. The walk up stops at the first parent of another kind.
    GET probes go to those processes' own ports only."""
    out: list[tuple[int, str]] = []
    cur = pid
    for _ in range(3):
        try:
            cur = procfs.read_stat(cur, root=proc).ppid
        except procfs.ProcError:
            break
        if cur <= 1:
            break
        rt = _server_of(cur, proc)
        if rt == "ollama" and runtime in (None, "ollama", "llama.cpp"):
            out.append((cur, "ollama"))
            break
        if rt is None or rt != runtime:
            break  # the family ends here: nothing above it answers for this process
        out.append((cur, rt))  # a TP worker's engine core, then the API server above it
        if rt == "tgi":
            out += [(c, "tgi") for c in _children(cur, proc) if c != pid]
    return out


def _sockets(pid: int, proc: str) -> list[llm.ListenSocket]:
    try:
        return llm.listening_sockets(pid, proc=proc)
    except OSError:
        return []


def _blob_file(path: str) -> str | None:
    """The snapshot file name of a hub cache blob (None for any other path)."""
    cp = hfcache.parse_cache_path(path)
    if cp is None or cp.kind != "blob" or cp.blob is None:
        return None
    links = hfcache.blob_files(cp.repo_dir, cp.blob)
    return links[0][1] if links else None


def gather(
    info: ProcInfo,
    index: stores.StoreIndex,
    *,
    proc: str = procfs.PROC,
    probe_timeout: float = 0.5,
    probe_deadline: float = 3.0,
) -> Inputs:
    """Do every costly look for one process (see the module docstring). Never raises for
    a process that vanished or refused a read: what could not be read is simply absent."""
    t0 = time.perf_counter()
    pid, cwd = info.pid, info.cwd
    app = None
    spec = apps.spec_for_process(info.name or "")
    if spec is not None:
        app = apps.read_app_model(spec)
    evs = evidence.from_procinfo(info.models)
    name = (info.name or "").lower()
    has_mapped = any(e.source is Source.MAPPED for e in evs)
    if not has_mapped and (name.startswith(BLOB_PROCESS_NAMES) or _llm_by_libraries(info)):
        evs += _store_blobs(info, index, proc)
    claims = evidence.assess(evs)
    friendly: dict[str, stores.StoreName] = {}
    for c in claims:
        if c.path is not None:
            n = index.name_for(c.path, cwd)
            if n is not None:
                friendly[c.path] = n
    detail = any(c.allows_detail for c in claims)
    result: llm.ProbeResult | None = None
    probed = None
    runtime = _runtime_hint(info)
    raw: tuple[str, ...] = ()
    server_argv: tuple[str, ...] = ()
    if detail or _llm_by_libraries(info) or info.server is not None:
        raw = _raw_argv(pid, proc)
        socks = _sockets(pid, proc)
        probed = pid
        if socks:
            result = llm.probe(
                socks,
                runtime,
                api_key=evidence.api_key_from_argv(raw),
                timeout=probe_timeout,
                deadline_s=probe_deadline,
            )
        owners_for = (
            "ollama" if any(n.store == "ollama" for n in friendly.values()) else None
        ) or (info.server.key if info.server is not None else None)
        if (result is None or not result.ok) and owners_for is not None:
            for owner, rt in api_owners(pid, owners_for, proc):
                osocks = _sockets(owner, proc)
                if not osocks:
                    continue
                oraw = _raw_argv(owner, proc)
                res = llm.probe(
                    osocks,
                    rt,
                    api_key=evidence.api_key_from_argv(oraw),
                    timeout=probe_timeout,
                    deadline_s=probe_deadline,
                )
                if res.ok:
                    probed, runtime, result, raw_owner = owner, rt, res, oraw
                    server_argv = redact_argv(raw_owner).argv
                    break
        if result is not None and result.ok:
            runtime = result.runtime
            if not server_argv:
                server_argv = redact_argv(raw).argv
            evs = [*evs, *_link_names(result.evidence(cwd), friendly)]
    argv_for = server_argv or info.cmdline or ()
    roots = hubmodels.hub_roots(index.roots.huggingface, info.user, argv_for)
    evs = hubmodels.fold(evs, roots, hubmodels.revision_from_argv(argv_for))
    claims = evidence.assess(evs)
    for c in claims:
        if c.path is not None and c.path not in friendly:
            n = index.name_for(c.path, cwd)
            if n is not None:
                friendly[c.path] = n
    header = None
    header_error = None
    files = None
    buffers = None
    best = claims[0] if claims else None
    if best is not None and best.allows_detail and best.path is not None:
        got = hubmodels.read_header(best.path, _blob_file(best.path))
        header, files, header_error = got.gguf, got.files, got.error
        for p in llm.log_files(pid, raw, cwd, proc=proc):
            with contextlib.suppress(OSError):
                buffers = llm.read_buffer_log(p)
            if buffers is not None:
                break
    return Inputs(
        tuple(claims),
        friendly,
        header,
        header_error,
        buffers,
        result,
        probed,
        runtime,
        app,
        time.perf_counter() - t0,
        files,
        server_argv,
    )


def _served_for(claim: ModelClaim, probe: llm.ProbeResult | None) -> llm.ServedModel | None:
    if probe is None:
        return None
    for m in probe.models:
        if m.loaded is False:
            continue
        if claim.path and m.path and os.path.realpath(m.path) == claim.path:
            return m
        if claim.model and m.name == claim.model:
            return m
    loaded = [m for m in probe.models if m.loaded is not False]
    return loaded[0] if len(loaded) == 1 and claim.sources & {Source.API} else None


def _ref(
    claim: ModelClaim, name: str | None, store: str | None, *, pending: bool, inputs: Inputs | None
) -> ModelRef:
    p = inputs.probe if inputs is not None else None
    return ModelRef(
        name=name or claim.model or (os.path.basename(claim.path) if claim.path else "?"),
        evidence=claim.best.value,
        confirmed=claim.confirmed,
        path=claim.path,
        store=store,
        status=claim.status,
        sources=tuple(sorted(s.value for s in claim.sources)),
        pending=pending,
        api_runtime=p.runtime if p is not None else None,
        api_endpoint=p.endpoint if p is not None else None,
        api_errors=tuple(p.errors) if p is not None else (),
        header_error=inputs.header_error if inputs is not None else None,
    )


def build(
    info: ProcInfo,
    inputs: Inputs | None,
    *,
    argv: Sequence[str] | None,
    measured_bytes: int | None,
    device: str | None,
) -> Resolved:
    """The row's `Resolved` from gathered inputs (None: not gathered yet, cheap ref only)."""
    if inputs is None:
        claims = cheap_claims(info)
        if not claims:
            return Resolved()
        return Resolved(_ref(claims[0], None, None, pending=True, inputs=None))
    if not inputs.claims:
        return Resolved(app=inputs.app)
    claim = inputs.claims[0]
    store = inputs.friendly.get(claim.path) if claim.path else None
    view = None
    if claim.allows_detail:
        view = llm.build_view(
            claim,
            header=inputs.header,
            files=inputs.files,
            server_argv=inputs.server_argv,
            buffers=inputs.buffers,
            served=_served_for(claim, inputs.probe),
            runtime=inputs.runtime,
            friendly_name=store.name if store else None,
            argv=argv or (),
            device=device,
            measured_bytes=measured_bytes,
        )
    name = view.model if view is not None else (store.name if store else None)
    ref = _ref(claim, name, store.store if store else None, pending=False, inputs=inputs)
    return Resolved(ref, view, inputs.app)


class ModelResolver:
    """Caches `gather` per ``(pid, create_time)``; see the module docstring."""

    def __init__(
        self,
        *,
        background: bool = True,
        index: stores.StoreIndex | None = None,
        proc: str = procfs.PROC,
        ttl: float = 10.0,
        max_workers: int = 2,
        probe_timeout: float = 0.5,
        probe_deadline: float = 3.0,
    ) -> None:
        self.background = background
        self.index = index if index is not None else stores.StoreIndex()
        self.proc = proc
        self.ttl = ttl
        self.probe_timeout = probe_timeout
        self.probe_deadline = probe_deadline
        self._lock = threading.Lock()
        self._done: dict[tuple[int, float | None], tuple[float, Inputs]] = {}
        self._running: dict[tuple[int, float | None], Any] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._pool = None
        if background:
            # Daemon threads, not a ThreadPoolExecutor: the interpreter joins executor
            # threads at exit, so one read stuck on a dead network or FUSE mount would keep
            # `record` or the TUI from ever exiting.
            self._pool = [
                threading.Thread(target=self._work, name=f"gtm-model-{i}", daemon=True)
                for i in range(max_workers)
            ]
            for t in self._pool:
                t.start()

    def _gather(self, info: ProcInfo) -> Inputs:
        return gather(
            info,
            self.index,
            proc=self.proc,
            probe_timeout=self.probe_timeout,
            probe_deadline=self.probe_deadline,
        )

    def inputs(self, info: ProcInfo) -> Inputs | None:
        """Gathered inputs for `info` (inline when not in background; else cached, with a
        job submitted when missing or older than `ttl`). Never blocks in background mode."""
        key = info.key
        now = time.monotonic()
        with self._lock:
            hit = self._done.get(key)
        if self._pool is None:
            if hit is None or now - hit[0] >= self.ttl:
                hit = (now, self._gather(info))
                with self._lock:
                    self._done[key] = hit
            return hit[1]
        if hit is None or now - hit[0] >= self.ttl:
            with self._lock:
                if key not in self._running and not self._closed:
                    self._running[key] = info
                    self._queue.put(key)
        return hit[1] if hit is not None else None

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                info = self._running.get(key)
            try:
                inputs = self._gather(info)
            except Exception:
                # a bug in one probe must not leave the row pending forever: no detail
                inputs = Inputs(())
            with self._lock:
                self._running.pop(key, None)
                self._done[key] = (time.monotonic(), inputs)
                self._idle.notify_all()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no job is queued or running (tests, benchmarks). True when idle."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._running, timeout)

    def resolve(
        self, info: ProcInfo, *, measured_bytes: int | None = None, device: str | None = None
    ) -> Resolved:
        return build(
            info,
            self.inputs(info),
            argv=info.cmdline,
            measured_bytes=measured_bytes,
            device=device,
        )

    def costs(self) -> list[float]:
        """Seconds each cached look took (benchmarks)."""
        with self._lock:
            return [inputs.cost_s for _, inputs in self._done.values()]

    def forget(self, live: Iterable[tuple[int, float | None]]) -> None:
        keep = set(live)
        with self._lock:
            for k in [k for k in self._done if k not in keep]:
                del self._done[k]

    def close(self) -> None:
        """Stop taking jobs; workers finish their current look and exit (never joined)."""
        with self._lock:
            self._closed = True
            self._running.clear()
            self._idle.notify_all()
        for _ in self._pool or ():
            self._queue.put(None)
