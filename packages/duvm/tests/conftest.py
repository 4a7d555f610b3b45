"""Fixtures shared by the duvm tests. Their helper modules (memserver_raw, memserver_relay,
duvm_processes) sit beside them and import by name; with `--import-mode=importlib` pytest does
not put this folder on sys.path itself, so it is put there once, here."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from duvm.base import accel
from duvm.memserver.server import MemServer

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

StartPool = Callable[..., Awaitable[tuple[list[MemServer], list[tuple[str, int]]]]]


@pytest.fixture
async def memserver_pool() -> AsyncIterator[StartPool]:
    """`await memserver_pool(n, capacity)` starts n in-process memservers on loopback.

    Returns (servers, addresses). At teardown every server then in the returned list is closed,
    so a test that replaces `servers[i]` with a restarted one gets that one closed too.
    """
    pools: list[list[MemServer]] = []

    async def start(
        n: int, capacity: int, lease_s: float = 60
    ) -> tuple[list[MemServer], list[tuple[str, int]]]:
        srvs = [MemServer(capacity, lease_s=lease_s, lock=False) for _ in range(n)]
        pools.append(srvs)
        addrs = [await s.start() for s in srvs]
        return srvs, addrs

    try:
        yield start
    finally:
        for srvs in pools:
            for s in srvs:
                await s.close()


FastPath = Callable[..., Awaitable[str]]


async def _fast(start: Callable[..., bool], offset: int, buf: memoryview) -> str:
    """Drive one request through a store's callback fast path the way nbdconnection does: hand
    it to `start` (`store.start_read`/`start_write`); `done(tag, None)` finishes,
    `done(tag, coroutine)` continues there, `done(tag, exc)` fails. Returns how it finished:
    "fast" (from the callback, or at once) or "continued" (through the general path)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    how: list[str] = []

    def done(tag: object, cont: object) -> None:
        assert tag == "tag"
        if cont is None or type(cont) is memoryview:
            if cont is not None:  # answered from the store's own buffer (readahead)
                buf[:] = cont
            how.append("fast")
            fut.set_result(None)
        elif isinstance(cont, BaseException):
            how.append("failed")
            fut.set_exception(cont)
        else:
            how.append("continued")
            task = asyncio.ensure_future(cont)  # type: ignore[arg-type]
            task.add_done_callback(
                lambda t: (
                    fut.set_exception(t.exception()) if t.exception() else fut.set_result(None)
                )
            )

    assert start(offset, buf, done, "tag"), "the fast path declined"
    await fut
    assert len(how) == 1, how  # done is called exactly once
    # The NBD server takes each request in a loop iteration of its own (the client's next
    # request arrives after this reply), so what the store left for later runs before it.
    await asyncio.sleep(0)
    return how[0]


@pytest.fixture
def fast() -> FastPath:
    """`await fast(store.start_read, offset, buf)`: see `_fast`."""
    return _fast


@pytest.fixture
def pick_path(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """`pick_path(path, module)`: what is built from now on takes the pure-Python reference
    ("reference") or the compiled `module` ("compiled"; skipped, with the reason, where that
    module is not built)."""

    def pick(path: str, module: str) -> None:
        if path == "reference":
            monkeypatch.setenv(accel.ENV, "1")
        elif (why := accel.state(module)) != "compiled":
            pytest.skip(f"compiled path: {why}")
        else:
            monkeypatch.delenv(accel.ENV, raising=False)

    return pick


def _load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module, loaded as when run (its folder on sys.path, so it can
    import its neighbours; itself in sys.modules while it loads, for its dataclasses)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
        sys.path.remove(str(BENCHMARKS))
    return mod


@pytest.fixture
def benchmark() -> Callable[[str], ModuleType]:
    """`benchmark("nbd_trace")`: a script of benchmarks/ as a module, to call its functions."""
    return _load_benchmark


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port bound here but not listening: connecting to it is refused (held for
    the test, so no other socket, nor a connect's own source port, can take it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
