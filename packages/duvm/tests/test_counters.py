"""Counters: each component owns and increments its own; status and metrics read them through
`BlockStore.counters()`. Also the shape rule that replaced the mixins: `RemoteStore` is
composed of its request paths, it does not inherit them."""

from __future__ import annotations

import ast
import errno
from pathlib import Path

import duvm.store as store_pkg
import pytest
from duvm.base.metrics import LatencyByKind
from duvm.node.daemon.metrics import NBD_KINDS, DaemonCollector
from duvm.node.daemon.nbdserver import NBDServer
from duvm.node.daemon.status import daemon_status
from duvm.store.counters import Counters, merge
from duvm.store.crypt_store import CryptStore
from duvm.store.memory_store import MemoryStore
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import PAGE_SIZE, BlockStore, StorageError

STORE_DIR = Path(store_pkg.__file__).parent
PS = PAGE_SIZE


def _counter_classes() -> dict[str, list[tuple[str, str]]]:
    """Each counter name -> the (module file, class) of every Counters class that has it."""
    import importlib

    for path in STORE_DIR.glob("*.py"):  # every owner must be imported to be seen
        importlib.import_module(f"duvm.store.{path.stem}")
    owners: dict[str, list[tuple[str, str]]] = {}
    todo = list(Counters.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        module = cls.__module__.rsplit(".", 1)[-1] + ".py"
        for name in cls.__dataclass_fields__:
            owners.setdefault(name, []).append((module, cls.__name__))
    return owners


def _increments() -> list[tuple[str, int, str]]:
    """(module file, line, counter name) of every `<x>.counters.NAME += ...` and
    `<x>.own_counters.NAME += ...` in duvm.store."""
    found = []
    for path in sorted(STORE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.AugAssign):
                continue
            t = node.target
            holder = t.value if isinstance(t, ast.Attribute) else None
            if holder is None:
                continue
            name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", "")
            if name in ("counters", "own_counters"):
                found.append((path.name, node.lineno, t.attr))
    return found


def test_every_counter_is_incremented_only_in_the_module_that_owns_it() -> None:
    """Catches state written by more than one class: a component counting into another's
    counters (as the slab table once counted the write path's stores into a shared dict, so
    two classes wrote "stores")."""
    owners = _counter_classes()
    incs = _increments()
    assert len(incs) > 30, "the scan found too few increments to mean anything"
    wrong = [
        f"{mod}:{line} increments {name}, owned by {owners.get(name)}"
        for mod, line, name in incs
        if mod not in {m for m, _ in owners.get(name, [])}
    ]
    assert wrong == []


def test_no_shared_stats_dict_is_left_in_the_stores() -> None:
    """Catches a return to one `stats` dict that several classes write into."""
    offenders = []
    for path in sorted(STORE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.AugAssign)
                and isinstance(node.target, ast.Subscript)
                and isinstance(node.target.value, ast.Attribute)
                and node.target.value.attr in ("stats", "_stats")
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_the_remote_store_is_composed_not_mixed_in() -> None:
    """Catches a request path inherited as a mixin that reaches into its host class."""
    assert RemoteStore.__bases__ == (BlockStore,)


def test_merge_sums_a_name_counted_by_several_components() -> None:
    assert merge({"a": 1, "w": 2}, {"w": 3}, {}) == {"a": 1, "w": 5}


async def test_a_tag_failure_is_counted_and_reaches_the_metrics() -> None:
    """Catches a filter whose counters status and metrics never see (tag failures, the sign
    of a memserver returning bytes this node did not write, were counted but shown nowhere)."""
    inner = MemoryStore(16 * PS)
    cs = CryptStore(inner)
    await cs.write(2 * PS, memoryview(bytes(range(256)) * 16))
    raw = bytearray(PS)
    await inner.read(2 * PS, memoryview(raw))
    raw[100] ^= 1  # the store below hands back other bytes than were written
    await inner.write(2 * PS, memoryview(raw))
    with pytest.raises(StorageError) as e:
        await cs.read(2 * PS, memoryview(bytearray(PS)))
    assert e.value.errno == errno.EIO
    # outcome: counted once, beside the counters of the store below
    c = cs.counters()
    assert c["tag_failures"] == 1 and c["pages_sealed"] == 1 and c["pages_opened"] == 0
    assert c["write"] == 2 and c["read"] == 2  # MemoryStore's own, through the filter
    # mechanism: the daemon's snapshot and its Prometheus collector read them from there
    server = NBDServer(cs)
    snap = daemon_status(cs, server)
    assert snap.counters == c and snap.replication is None
    families = {
        m.name: m for m in DaemonCollector(server, None, LatencyByKind(NBD_KINDS)).collect()
    }
    assert families["duvm_daemon_tag_failures"].samples[0].value == 1
    # a counter no layer keeps is absent, never 0
    assert "duvm_daemon_failovers" not in families
