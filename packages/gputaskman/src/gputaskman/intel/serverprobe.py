"""Local LLM server APIs: which ports a process listens on, and what its API says.

Theory of operation
-------------------
*Look, don't touch*: the only network traffic gputaskman sends is ``GET`` requests, with
short timeouts, to TCP ports the process itself is listening on. :func:`listening_sockets`
finds those ports without psutil: the socket inodes in ``/proc/PID/fd`` (links
``socket:[N]``) matched against the LISTEN rows (state ``0A``) of ``/proc/PID/net/tcp`` and
``tcp6`` (the process's own network namespace). A wildcard address is probed on loopback.

:class:`ServerProber` runs probes on a small thread pool so a UI thread never waits:
``submit()`` schedules, ``result()`` returns the latest cached :class:`ProbeResult` (or None),
``probe_now()`` waits with a deadline (for one-shot ``--json``). Results are cached per key
(``(pid, create_time)``) for ``ttl`` seconds. Each runtime is a table entry (:data:`RUNTIMES`):
the endpoints to GET and a parser per endpoint that turns a documented response shape into
:class:`ServedModel` rows and gauges. A response that is not the documented shape is ignored
with a reason in ``ProbeResult.errors``; bodies are capped at ``MAX_BODY`` bytes.

Endpoints (each runtime's documentation):
* llama.cpp ``llama-server``: ``/props`` (``model_path``, ``default_generation_settings.n_ctx``),
  ``/slots`` (per-slot ``n_ctx``), ``/v1/models`` (``data[].id``, ``meta.size``,
  ``meta.n_params``), ``/metrics`` (Prometheus, ``llamacpp:*``; only with ``--metrics``).
  With ``--api-key`` every endpoint but ``/health`` needs ``Authorization: Bearer <key>``.
* Ollama: ``/api/ps`` (loaded models with ``size`` and ``size_vram``), ``/api/tags`` (installed).
* LM Studio: ``/api/v0/models`` (``state`` ``loaded``/``not-loaded``,
  ``loaded_context_length``).
* vLLM: ``/v1/models`` (``id``, ``root``, ``max_model_len``), ``/metrics`` (``vllm:*`` gauges,
  the KV pool from ``vllm:cache_config_info`` and its use).
* SGLang: ``/get_server_info``; text-generation-inference: ``/info``. Their shapes, and the
  parsers of every runtime's KV pool figures, are `serverapis`'s.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from gputaskman.base.frozen import fields_of
from gputaskman.intel.evidence import Evidence, Source
from gputaskman.intel.serverapis import (
    BadAnswer,
    ServedModel,
    parse_prometheus,
    parse_sglang_server_info,
    parse_tgi_info,
    parse_vllm_metrics,
    text,
    uint,
)

__all__ = [
    "MAX_BODY",
    "RUNTIMES",
    "ListenSocket",
    "ProbeResult",
    "ServedModel",
    "ServerProber",
    "listening_sockets",
    "parse_prometheus",
    "probe",
]

MAX_BODY = 1024 * 1024
_LISTEN = "0A"


@dataclass(frozen=True, slots=True)
class ListenSocket:
    host: str  # the address to connect to (loopback for a wildcard listener)
    port: int
    family: str  # "tcp" | "tcp6"


def _socket_inodes(pid: int, proc: str) -> set[int]:
    inodes: set[int] = set()
    fd_dir = f"{proc}/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed between listdir and readlink
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _hex_addr(hexaddr: str, family: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if family == "tcp":
        return ".".join(str(b) for b in raw[::-1])
    # IPv6 is four little-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_sockets(pid: int, proc: str = "/proc") -> list[ListenSocket]:
    """TCP sockets ``pid`` is listening on. Raises OSError when ``/proc/PID/fd`` is unreadable."""
    inodes = _socket_inodes(pid, proc)
    out: list[ListenSocket] = []
    if not inodes:
        return out
    for family in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/{pid}/net/{family}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _LISTEN:
                continue
            try:
                inode = int(cols[9])
                addr_hex, port_hex = cols[1].split(":")
                host = _hex_addr(addr_hex, family)
                port = int(port_hex, 16)
            except ValueError:
                continue
            if inode not in inodes:
                continue
            if host in ("0.0.0.0", "::"):
                host = "127.0.0.1" if family == "tcp" else "::1"
            if host.startswith("::ffff:"):
                host = host[7:]
            s = ListenSocket(host, port, family)
            if s not in out:
                out.append(s)
    return out


@dataclass(frozen=True, slots=True)
class ProbeResult:
    runtime: str | None
    endpoint: str | None  # "host:port" that answered
    models: tuple[ServedModel, ...] = ()
    gauges: Mapping[str, float] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    taken: float = 0.0
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.runtime is not None

    def evidence(self, cwd: str | None = None) -> list[Evidence]:
        """``api`` evidence for loaded models (path resolved against the process's cwd)."""
        out = []
        for m in self.models:
            if m.loaded is False:
                continue
            path = m.path
            if path and not os.path.isabs(path) and cwd:
                path = os.path.join(cwd, path)
            if path:
                path = os.path.realpath(path)
            if path or m.name:
                out.append(
                    Evidence(
                        Source.API,
                        path=path,
                        model=m.name,
                        detail=f"{self.runtime} API on {self.endpoint}",
                    )
                )
        return out


_int, _str = uint, text
_Bad = BadAnswer  # the name the tests and older callers use


def _parse_props(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    if not isinstance(doc, dict) or not _str(doc.get("model_path")):
        raise _Bad("no model_path")
    dgs = doc.get("default_generation_settings")
    n_ctx = _int(dgs.get("n_ctx")) if isinstance(dgs, dict) else None
    n_ctx = n_ctx if n_ctx is not None else _int(doc.get("n_ctx"))
    path = doc["model_path"]
    return [ServedModel(os.path.basename(path), path, True, n_ctx=n_ctx)], {}


def _parse_slots(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    if not isinstance(doc, list) or not all(isinstance(s, dict) for s in doc):
        raise _Bad("not a list of slots")
    ctx = [_int(s.get("n_ctx")) for s in doc]
    gauges: dict[str, float] = {"slots": float(len(doc))}
    if ctx and all(c is not None for c in ctx):
        gauges["slots_n_ctx_total"] = float(sum(c for c in ctx if c is not None))
    return [], gauges


def _parse_openai_models(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise _Bad("no data list")
    out = []
    for d in data:
        if not isinstance(d, dict) or not _str(d.get("id")):
            continue
        meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
        root = _str(d.get("root"))
        path = root if root and os.path.isabs(root) else None
        ident = d["id"]
        if path is None and os.path.isabs(ident):
            path = ident
        out.append(
            ServedModel(
                ident,
                path,
                True,
                weights_bytes=_int(meta.get("size")),
                n_params=_int(meta.get("n_params")),
                n_ctx=_int(d.get("max_model_len")),
            )
        )
    if not out:
        raise _Bad("no model entries")
    return out, {}


def _parse_vllm_models(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    # llama-server answers /v1/models too; vLLM marks its rows owned_by "vllm". Its `root` is
    # the --model value as given: a path, or a Hugging Face repo id (a name) that names the
    # model better than `id` (the --served-model-name).
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not any(
        isinstance(d, dict) and d.get("owned_by") == "vllm" for d in data
    ):
        raise _Bad("no model owned_by vllm")
    rows, gauges = _parse_openai_models(doc)
    roots = [_str(d.get("root")) for d in data if isinstance(d, dict) and _str(d.get("id"))]
    return [
        replace(r, name=root) if root and not os.path.isabs(root) else r
        for r, root in zip(rows, roots, strict=False)
    ], gauges


def _parse_ollama(doc: Any, loaded: bool) -> tuple[list[ServedModel], dict[str, float]]:
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, list):
        raise _Bad("no models list")
    out = []
    for m in models:
        if not isinstance(m, dict) or not (_str(m.get("name")) or _str(m.get("model"))):
            continue
        out.append(
            ServedModel(
                _str(m.get("name")) or _str(m.get("model")),
                None,
                loaded,
                size_bytes=_int(m.get("size")),
                vram_bytes=_int(m.get("size_vram")) if loaded else None,
                n_ctx=_int(m.get("context_length")),
            )
        )
    return out, {}


def _parse_lmstudio(doc: Any) -> tuple[list[ServedModel], dict[str, float]]:
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise _Bad("no data list")
    out = []
    for d in data:
        if not isinstance(d, dict) or not _str(d.get("id")):
            continue
        state = d.get("state")
        loaded = True if state == "loaded" else False if state == "not-loaded" else None
        out.append(ServedModel(d["id"], None, loaded, n_ctx=_int(d.get("loaded_context_length"))))
    return out, {}


Parser = Callable[[Any], tuple[list[ServedModel], dict[str, float]]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    parse: Parser
    text: bool = False  # Prometheus text instead of JSON
    identifies: bool = False  # a valid answer proves the runtime


def _metrics(prefixes: Sequence[str]) -> Parser:
    return lambda text: ([], parse_prometheus(text, prefixes))


RUNTIMES: dict[str, tuple[Endpoint, ...]] = {
    "llama.cpp": (
        Endpoint("/props", _parse_props, identifies=True),
        Endpoint("/slots", _parse_slots),
        Endpoint("/v1/models", _parse_openai_models),
        Endpoint("/metrics", _metrics(["llamacpp:"]), text=True),
    ),
    "ollama": (
        Endpoint("/api/ps", lambda d: _parse_ollama(d, True), identifies=True),
        Endpoint("/api/tags", lambda d: _parse_ollama(d, False)),
    ),
    "lmstudio": (Endpoint("/api/v0/models", _parse_lmstudio, identifies=True),),
    "vllm": (
        Endpoint("/v1/models", _parse_vllm_models, identifies=True),
        Endpoint("/metrics", parse_vllm_metrics, text=True),
    ),
    "sglang": (Endpoint("/get_server_info", parse_sglang_server_info, identifies=True),),
    "tgi": (Endpoint("/info", parse_tgi_info, identifies=True),),
}


def _get(host: str, port: int, path: str, timeout: float, api_key: str | None) -> bytes:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Accept": "application/json", "User-Agent": "gputaskman"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(MAX_BODY + 1)
        if resp.status != 200:
            raise _Bad(f"HTTP {resp.status}")
        if len(body) > MAX_BODY:
            raise _Bad(f"body over {MAX_BODY} bytes")
        return body
    finally:
        conn.close()


def _fill(m: ServedModel, n: ServedModel) -> ServedModel:
    have = fields_of(m)
    return replace(
        m, **{k: v for k, v in fields_of(n).items() if have[k] is None and v is not None}
    )


def _merge(models: list[ServedModel], new: list[ServedModel]) -> None:
    """Merge rows naming the same model (by name or path); later fields fill gaps. A row with
    neither name nor path is about the whole server: it fills the gaps of every model."""
    for n in new:
        if n.name is None and n.path is None:
            models[:] = [_fill(m, n) for m in models]
            continue
        for i, m in enumerate(models):
            if (
                (m.name and m.name == n.name)
                or (m.path and m.path == n.path)
                or (m.path and n.name and os.path.basename(m.path) == os.path.basename(n.name))
            ):
                models[i] = _fill(m, n)
                break
        else:
            models.append(n)


def probe(
    sockets: Sequence[ListenSocket],
    runtime: str | None = None,
    *,
    api_key: str | None = None,
    timeout: float = 0.5,
    deadline_s: float = 3.0,
) -> ProbeResult:
    """Probe the given listening sockets synchronously (use :class:`ServerProber` from a UI).

    ``runtime`` picks the endpoint table; None tries each table until one identifies itself.
    Stops at ``deadline_s`` in total, whatever is left.
    """
    t0 = time.monotonic()
    errors: list[str] = []
    tables = [runtime] if runtime in RUNTIMES else list(RUNTIMES)
    for sock in sockets:
        for rt in tables:
            models: list[ServedModel] = []
            gauges: dict[str, float] = {}
            identified = False
            for ep in RUNTIMES[rt]:
                if time.monotonic() - t0 > deadline_s:
                    errors.append(f"deadline of {deadline_s}s reached")
                    break
                where = f"GET {sock.host}:{sock.port}{ep.path}"
                try:
                    body = _get(sock.host, sock.port, ep.path, timeout, api_key)
                    doc = body.decode("utf-8", "replace") if ep.text else json.loads(body)
                    rows, g = ep.parse(doc)
                except (OSError, http.client.HTTPException) as e:
                    errors.append(f"{where}: {type(e).__name__}: {e}")
                    if ep.identifies:
                        break
                    continue
                except (_Bad, ValueError, UnicodeDecodeError) as e:
                    errors.append(f"{where}: ignored, {e}")
                    if ep.identifies:
                        break
                    continue
                identified = identified or ep.identifies
                _merge(models, rows)
                gauges.update(g)
            if identified:
                return ProbeResult(
                    rt,
                    f"{sock.host}:{sock.port}",
                    tuple(models),
                    gauges,
                    tuple(errors),
                    time.time(),
                    time.monotonic() - t0,
                )
    return ProbeResult(None, None, (), {}, tuple(errors), time.time(), time.monotonic() - t0)


class ServerProber:
    """Probes off the caller's thread and caches results per key for ``ttl`` seconds."""

    def __init__(
        self,
        *,
        timeout: float = 0.5,
        ttl: float = 10.0,
        max_workers: int = 2,
        deadline_s: float = 3.0,
    ) -> None:
        self.timeout = timeout
        self.ttl = ttl
        self.deadline_s = deadline_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gtm-probe")
        self._lock = threading.Lock()
        self._done: dict[Any, tuple[float, ProbeResult]] = {}
        self._running: dict[Any, Future[ProbeResult]] = {}

    def submit(
        self,
        key: Any,
        sockets: Sequence[ListenSocket],
        runtime: str | None = None,
        api_key: str | None = None,
    ) -> Future[ProbeResult] | None:
        """Schedule a probe unless a fresh result or a running probe exists. Never blocks."""
        with self._lock:
            hit = self._done.get(key)
            if hit and time.monotonic() - hit[0] < self.ttl:
                return None
            if key in self._running:
                return self._running[key]
            fut = self._pool.submit(
                probe,
                list(sockets),
                runtime,
                api_key=api_key,
                timeout=self.timeout,
                deadline_s=self.deadline_s,
            )
            self._running[key] = fut
        fut.add_done_callback(lambda f, k=key: self._finish(k, f))
        return fut

    def _finish(self, key: Any, fut: Future[ProbeResult]) -> None:
        try:
            res = fut.result()
        except Exception as e:  # a bug in a parser must not kill the pool's caller
            res = ProbeResult(None, None, errors=(f"probe failed: {e!r}",), taken=time.time())
        with self._lock:
            self._running.pop(key, None)
            self._done[key] = (time.monotonic(), res)

    def result(self, key: Any) -> ProbeResult | None:
        """The latest finished result for ``key`` (possibly stale), or None. Never blocks."""
        with self._lock:
            hit = self._done.get(key)
        return hit[1] if hit else None

    def probe_now(
        self,
        key: Any,
        sockets: Sequence[ListenSocket],
        runtime: str | None = None,
        api_key: str | None = None,
    ) -> ProbeResult | None:
        """Submit and wait up to the deadline (for one-shot output, never for a UI)."""
        fut = self.submit(key, sockets, runtime, api_key)
        if fut is not None:
            with contextlib.suppress(Exception):
                fut.result(timeout=self.deadline_s + self.timeout + 1.0)
            if fut.done():
                self._finish(key, fut)  # idempotent; the done-callback may not have run yet
        return self.result(key)

    def forget(self, live_keys: set[Any]) -> None:
        """Drop cached results of processes that are gone."""
        with self._lock:
            for k in [k for k in self._done if k not in live_keys]:
                del self._done[k]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
