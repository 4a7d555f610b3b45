"""How long a request waits while no replica of its slab answers, against the limits around it."""

from __future__ import annotations

from duvm.memserver.pagestore import DEFAULT_LEASE_S
from duvm.node.attach.attach import DEFAULT_NBD_TIMEOUT_S
from duvm.node.attach.attach_kernel import DEFAULT_DEAD_CONN_TIMEOUT_S
from duvm.store.remote_health import DEFAULT_OP_TIMEOUT
from duvm.store.remote_store import RemoteStore
from duvm.store.replica_errors import DEFAULT_UNREACHABLE_WAIT


def test_swap_ins_wait_for_the_last_replica_as_long_as_waiting_can_help():
    """Catches a wait that outlives the kernel's nbd request timeout (the kernel would fail
    the request and reset the connection itself) or the memservers' lease (it would wait for
    pages already freed), and a wait much shorter than those: 30 s let a memserver host too
    busy to answer kill the swapping program with SIGBUS (docs/BENCHMARKS.md, "A run that
    lost pages when the host itself was overloaded")."""
    budget = min(DEFAULT_NBD_TIMEOUT_S, DEFAULT_LEASE_S, DEFAULT_DEAD_CONN_TIMEOUT_S)
    # the wait starts once the stalled connection is noticed and aborted
    spent = DEFAULT_OP_TIMEOUT + DEFAULT_UNREACHABLE_WAIT
    assert spent < budget
    assert 0.8 * (budget - DEFAULT_OP_TIMEOUT) <= DEFAULT_UNREACHABLE_WAIT


def test_a_store_waits_the_default_unless_told_otherwise():
    import inspect

    default = inspect.signature(RemoteStore.__init__).parameters["unreachable_wait"].default
    assert default == DEFAULT_UNREACHABLE_WAIT
