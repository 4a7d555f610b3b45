"""The fleet poller: every host's ``/snapshot.json`` polled at once, each on its own clock,
with a timeout per poll and backoff after failures, so a dead or slow host never slows the
others.

Theory of operation
-------------------
One thread runs one asyncio event loop; each host has one coroutine that polls, publishes
the result and sleeps until its next poll. Nothing a host does can hold another: connecting,
sending and reading are non-blocking, and every poll (connect included) has `timeout`
seconds to finish. Reading a document (`reader.read_body`) runs on the loop; it is bounded by
the size cap and takes well under a millisecond for a typical host.

Each host keeps one HTTP/1.1 connection open between polls (`serve` keeps it), so a poll is
one request and one answer, not a TCP and TLS handshake; a connection the host closed while
idle is noticed before any byte of the answer and replaced once within the same poll. A
poll sends the ETag of the document it has (``If-None-Match``): a host whose sample has not
changed answers a bodiless 304, and an answer whose bytes are those of the document already
held is not read again either. Either way the host is up with the same document: `seq` does
not move, so a recorder never writes one sample twice.

Schedule: after an answer the next poll is due `interval` seconds after this one started
(ticks missed by a slow answer are skipped, not made up). After a failure (no connection, no
whole answer within the timeout, a refused token, a document this version cannot read) the
delay doubles from `interval` up to `backoff_max`, and the row says when the next try is;
one good answer resets it. `poll_now` wakes every host at once.

What the UI reads: `states()`, one frozen `HostState` per host in the order given, replaced
whole on every poll (never mutated, so a reader on another thread sees a consistent state).
A host that goes down keeps its last document in `document` (and in `body` the bytes it was
read from, which ``fleet --json`` and ``fleet record`` write out), with its status and reason
saying it is not current: a view shows the reason, never zeros. `seq` counts the distinct
documents read, so a recorder knows which answers are new.

Reading only the table's part (`table_only`, the TUI): the open host is read whole. When its
whole document is refused where the table's part was read, the host takes that refusal's
status (``incompatible``) and keeps it while it serves the same bytes (an ETag's 304 for them
included), open or not; a new document is read afresh.

Bounded memory: each answer is capped (`reader.MAX_DOCUMENT_BYTES`), and the bytes buffered by
all answers in flight together are capped at `MAX_BUFFERED_BYTES`; an answer that would pass
that is dropped with a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import Document
from gputaskman.fleet.httpwire import (
    HttpError,
    HttpResponse,
    ResponseReader,
    TooLarge,
    request_bytes,
)
from gputaskman.fleet.reader import MAX_DOCUMENT_BYTES, Answer, read_answer, read_body
from gputaskman.fleet.targets import PATH, Target

DEFAULT_TIMEOUT = 2.0  # seconds for one whole poll, connect included
DEFAULT_BACKOFF_MAX = 30.0
MAX_BUFFERED_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class HostState:
    """One host as the last poll left it (see the module docstring)."""

    target: Target
    status: HostStatus = HostStatus.WAITING
    reason: str | None = "not polled yet"
    document: Document | None = None  # the last document read (current only when up)
    body: bytes | None = None  # the bytes it was read from, valid JSON (for --json and record)
    answered_at: float | None = None  # time.time() of the last answer with a document
    latency_s: float | None = None  # of the last poll that got an answer
    seq: int = 0  # distinct documents read so far (the same sample again is not counted)
    polls: int = 0
    failures: int = 0  # consecutive polls that read no document
    next_poll_in_s: float | None = None  # after a failure: the backoff delay
    from_series: bool = False  # `document` was built from Prometheus's series, not answered
    whole: bool = True  # False: `document` holds only what the fleet table shows

    @property
    def up(self) -> bool:
        return self.status is HostStatus.UP


class _Failed(Exception):
    def __init__(self, status: HostStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Closed(Exception):
    """The connection closed before a whole answer; `early`: before any byte of it."""

    def __init__(self, early: bool, why: str) -> None:
        super().__init__(why)
        self.early = early


class _Budget:
    """Bytes buffered by all answers in flight (one event loop: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one host; one request at a time."""

    def __init__(self, max_body: int, budget: _Budget) -> None:
        self.max_body = max_body
        self.budget = budget
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reader: ResponseReader | None = None
        self._waiter: asyncio.Future[HttpResponse] | None = None
        self._held = 0  # bytes this answer holds against the budget

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        w, r = self._waiter, self._reader
        if w is None or w.done() or r is None:
            self.close()  # bytes nobody asked for: this connection is not reused
            return
        if self.budget.used + len(data) > self.budget.limit:
            self._fail(w, _Failed(HostStatus.ERROR, "too many bytes in flight from all hosts"))
            return
        self.budget.used += len(data)
        self._held += len(data)
        try:
            resp = r.feed(data)
        except HttpError as exc:
            self._fail(w, exc)
            return
        if resp is not None:
            self._release()
            w.set_result(resp)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w, r = self._waiter, self._reader
        if w is None or w.done() or r is None:
            return
        self._release()
        if isinstance(exc, ssl.SSLError):
            w.set_exception(_Failed(HostStatus.REFUSED, f"TLS: {exc.reason or exc}"))
        elif r.received == 0:
            w.set_exception(_Closed(True, "the host closed the connection without answering"))
        else:
            try:
                w.set_result(r.eof())
            except HttpError as err:
                w.set_exception(_Closed(False, str(err)))

    def _fail(self, w: asyncio.Future[HttpResponse], exc: Exception) -> None:
        self._release()
        w.set_exception(exc)
        self.close()

    def _release(self) -> None:
        self.budget.used -= self._held
        self._held = 0

    async def request(self, data: bytes, timeout: float) -> HttpResponse:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._reader = ResponseReader(self.max_body)
        self._waiter = loop.create_future()
        self.transport.write(data)
        try:
            return await asyncio.wait_for(self._waiter, max(0.0, timeout))
        finally:
            self._release()
            self._waiter = self._reader = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Poller:
    """Polls `targets` on a background thread (see the module docstring)."""

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        interval: float = 1.0,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
        max_document_bytes: int = MAX_DOCUMENT_BYTES,
        table_only: bool = False,
    ) -> None:
        self.targets = tuple(targets)
        self.table_only = table_only  # read only the table's part (but the open host whole)
        self._focus_name: str | None = None
        self.interval = interval
        self.timeout = timeout
        self.token = token
        self.tls = tls
        self.backoff_max = max(backoff_max, interval)
        self.max_document_bytes = max_document_bytes
        self._states = [HostState(t) for t in self.targets]
        self._changed = threading.Condition()
        self.version = 0  # bumped on every published poll
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sleepers: dict[int, asyncio.Future[None]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gtm-fleet-poller", daemon=True)
        self._budget = _Budget(MAX_BUFFERED_BYTES)
        # host index -> the bytes whose whole document was refused, and that refusal (the
        # loop's thread only): those bytes served again are that refusal again, not "up"
        self._refused: dict[int, tuple[bytes, Answer]] = {}

    # -- the UI's side (any thread)

    def states(self) -> tuple[HostState, ...]:
        return tuple(self._states)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The polling thread's id for the OS (None before `start`): what to measure."""
        return self._thread.native_id

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def poll_now(self) -> None:
        self._wake()

    def focus(self, name: str | None) -> None:
        """Host `name` is open in the TUI: read its answers whole (when `table_only`), the
        one it holds at once, on the polling thread."""
        self._focus_name = name
        loop = self._loop
        if name is not None and self.table_only and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._read_whole, name)

    def _read_whole(self, name: str) -> None:
        i = next((i for i, t in enumerate(self.targets) if t.name == name), None)
        if i is None:
            return
        prev = self._states[i]
        if prev.whole or prev.body is None:
            return
        ans = read_body(prev.body)
        if ans.document is not None:
            new = dataclasses.replace(prev, document=ans.document, whole=True)
        else:
            # the whole document is refused where the table's part was not: the host is not
            # up while it serves these bytes (`_host` answers them with this refusal), and
            # what it holds is still only the table's part
            self._refused[i] = (prev.body, ans)
            if not prev.up:
                return  # down already, for its own reason
            failures = prev.failures + 1
            new = dataclasses.replace(
                prev,
                status=ans.status,
                reason=ans.reason,
                failures=failures,
                next_poll_in_s=self._backoff(failures),
            )
        with self._changed:
            self._states[i] = new
            self.version += 1
            self._changed.notify_all()

    @property
    def origin(self) -> str:
        return ""  # the hosts themselves

    @property
    def error(self) -> str | None:
        return None  # each host fails on its own, never the poller as a whole

    def wait_polled(self, timeout: float) -> bool:
        """Wait until every host has been polled at least once (True), or `timeout`."""
        with self._changed:
            return self._changed.wait_for(
                lambda: all(s.polls for s in self._states), timeout=timeout
            )

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake_all)

    # -- the loop's side

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._host(i) for i in range(len(self.targets))))

    def _wake_all(self) -> None:
        for fut in self._sleepers.values():
            if not fut.done():
                fut.set_result(None)

    async def _sleep(self, i: int, delay: float) -> None:
        loop = asyncio.get_running_loop()
        fut = self._sleepers[i] = loop.create_future()
        handle = loop.call_later(delay, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            handle.cancel()

    def _publish(self, i: int, ans: Answer, latency: float | None) -> HostState:
        prev = self._states[i]
        if ans.unchanged and prev.document is not None:
            new = dataclasses.replace(
                prev,
                status=HostStatus.UP,
                reason=None,
                answered_at=time.time(),
                latency_s=latency,
                polls=prev.polls + 1,
                failures=0,
                next_poll_in_s=None,
            )
        elif ans.status is HostStatus.UP and ans.document is not None:
            new = dataclasses.replace(
                prev,
                status=ans.status,
                reason=None,
                document=ans.document,
                body=ans.body,
                whole=ans.whole,
                answered_at=time.time(),
                latency_s=latency,
                seq=prev.seq + 1,
                polls=prev.polls + 1,
                failures=0,
                next_poll_in_s=None,
            )
        else:
            if ans.unchanged:  # a 304 for a document this state does not hold: no answer
                ans = Answer(HostStatus.ERROR, "HTTP 304 without an earlier document")
            failures = prev.failures + (ans.status is not HostStatus.STARTING)
            new = dataclasses.replace(
                prev,
                status=ans.status,
                reason=ans.reason,
                latency_s=latency if latency is not None else prev.latency_s,
                polls=prev.polls + 1,
                failures=failures,
                next_poll_in_s=self._backoff(failures),
            )
        with self._changed:
            self._states[i] = new
            self.version += 1
            self._changed.notify_all()
        return new

    def _backoff(self, failures: int) -> float:
        if failures <= 1:
            return self.interval
        return min(self.backoff_max, self.interval * 2 ** (failures - 1))

    async def _host(self, i: int) -> None:
        t = self.targets[i]
        loop = asyncio.get_running_loop()
        conn: _Connection | None = None
        etag: str | None = None  # of the document this host's state holds
        body = b""  # that document's bytes
        while not self._stopping:
            started = loop.time()
            latency = None
            request = request_bytes(t.address, PATH, self.token, etag)
            whole = not self.table_only or t.name == self._focus_name
            try:
                resp, conn = await self._fetch(t, conn, request, started + self.timeout)
                latency = loop.time() - started
                held = self._states[i]
                refused = self._refused.get(i)
                if refused is not None and (
                    resp.status == 304 or (resp.status == 200 and resp.body == refused[0])
                ):
                    ans = refused[1]  # the bytes whose whole document was refused, again
                elif resp.status == 200 and resp.body == body and (held.whole or not whole):
                    ans = Answer(HostStatus.UP, unchanged=True)  # the same sample again
                else:
                    ans = read_answer(resp, self.token is not None, whole)
                if ans.status is HostStatus.UP and not ans.unchanged:
                    etag, body = resp.headers.get("etag"), resp.body
                    self._refused.pop(i, None)
            except _Failed as f:
                ans = Answer(f.status, f.reason)
            except TooLarge as exc:
                ans = Answer(HostStatus.INCOMPATIBLE, str(exc))
            except HttpError as exc:
                ans = Answer(HostStatus.INCOMPATIBLE, f"not HTTP this view reads: {exc}")
            except Exception as exc:  # a bug here must not stop this host's polling
                ans = Answer(HostStatus.ERROR, f"{type(exc).__name__}: {exc}")
            if ans.status is not HostStatus.UP and conn is not None and not conn.closed:
                conn.close()  # whatever happened, start clean
                conn = None
            state = self._publish(i, ans, latency)
            if state.up and not state.whole and t.name == self._focus_name:
                self._read_whole(t.name)  # read before the host was opened, or a 304
                state = self._states[i]
            if state.up:
                due = started + self.interval
                now = loop.time()
                if due <= now:  # a slow answer: skip the missed ticks
                    due = now + self.interval - (now - started) % self.interval
                delay = due - now
            else:
                delay = state.next_poll_in_s or self.interval
            if not self._stopping:
                await self._sleep(i, delay)
        if conn is not None:
            conn.close()

    async def _fetch(
        self, t: Target, conn: _Connection | None, request: bytes, deadline: float
    ) -> tuple[HttpResponse, _Connection | None]:
        loop = asyncio.get_running_loop()
        fresh = conn is None or conn.closed
        if fresh:
            conn = await self._connect(t, deadline)
        assert conn is not None
        try:
            resp = await conn.request(request, deadline - loop.time())
        except _Closed as exc:
            conn.close()
            if not (exc.early and not fresh):
                raise _Failed(HostStatus.UNREACHABLE, str(exc)) from None
            # the host closed the idle connection: once more on a new one
            conn = await self._connect(t, deadline)
            try:
                resp = await conn.request(request, deadline - loop.time())
            except _Closed as again:
                conn.close()
                raise _Failed(HostStatus.UNREACHABLE, str(again)) from None
            except TimeoutError:
                conn.close()
                raise _Failed(HostStatus.SLOW, self._slow()) from None
        except TimeoutError:
            conn.close()
            raise _Failed(HostStatus.SLOW, self._slow()) from None
        if not resp.keep_alive:
            conn.close()
            conn = None
        return resp, conn

    def _slow(self) -> str:
        return f"no whole answer within {self.timeout:g} s"

    async def _connect(self, t: Target, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if t.tls:
            tls = self.tls or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self.max_document_bytes, self._budget),
                    t.host,
                    t.port,
                    ssl=tls,
                    server_hostname=t.host if tls is not None else None,
                    ssl_handshake_timeout=max(0.1, deadline - loop.time()) if tls else None,
                ),
                max(0.0, deadline - loop.time()),
            )
        except TimeoutError:
            raise _Failed(
                HostStatus.UNREACHABLE, f"no connection within {self.timeout:g} s"
            ) from None
        except ssl.SSLError as exc:
            raise _Failed(HostStatus.REFUSED, f"TLS: {exc.reason or exc}") from None
        except ConnectionRefusedError:
            raise _Failed(HostStatus.UNREACHABLE, "connection refused") from None
        except socket.gaierror as exc:
            raise _Failed(HostStatus.UNREACHABLE, f"name not found ({exc.strerror})") from None
        except OSError as exc:
            raise _Failed(HostStatus.UNREACHABLE, exc.strerror or str(exc)) from None
        return conn
