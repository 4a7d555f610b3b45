"""The RDMA transport in duvm's control plane, on a machine without RDMA: peer addresses that
name a transport, the daemon's settings, `duvm doctor`'s RDMA checks and what `duvm status`
says about each peer's transport. (The transport itself: test_rdma_qemu.py.)"""

from __future__ import annotations

import argparse
import resource

import pytest
from duvm.base.units import parse_peer
from duvm.node.daemon import daemon
from duvm.node.doctor import doctor_rdma
from duvm.node.doctor.doctor_check import FAIL, OK, SKIP, WARN, Options
from duvm.node.lifecycle import control


@pytest.mark.parametrize(
    "text,want",
    [
        ("10.1.2.3:7070", ("10.1.2.3", 7070, "tcp")),
        ("rdma://10.1.2.3:7070", ("10.1.2.3", 7070, "rdma")),
        ("AUTO://[fd00::1]:7070", ("fd00::1", 7070, "auto")),
        ("tcp://node7", ("node7", 7070, "tcp")),
    ],
)
def test_a_peer_names_its_transport(text: str, want: tuple) -> None:
    assert parse_peer(text, 7070) == want


@pytest.mark.parametrize(
    "text,why",
    [
        ("udp://h:1", "unknown transport 'udp'"),
        ("rdma://h", "needs a port"),
        ("rdma://:5", "no host"),
    ],
)
def test_a_bad_peer_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_peer(text)


def test_the_daemon_gives_each_peer_its_transport() -> None:
    parser = argparse.ArgumentParser()
    daemon.add_arguments(parser)
    args = parser.parse_args(
        [
            "--socket",
            "/tmp/x.sock",
            "--size",
            "8M",
            "--peers",
            "rdma://127.0.0.1:7070,127.0.0.1:7071,auto://127.0.0.1:7072",
        ]
    )
    cfg = daemon.settings_from_args(args)
    assert cfg.peers == [("127.0.0.1", 7070), ("127.0.0.1", 7071), ("127.0.0.1", 7072)]
    assert cfg.transports == ["rdma", "tcp", "auto"]


def test_doctor_skips_rdma_when_no_peer_asks_for_it() -> None:
    checks = doctor_rdma.check_rdma(Options(peers=["127.0.0.1:7070"]))
    assert [(c.name, c.status) for c in checks] == [("rdma", SKIP)]


def test_doctor_fails_rdma_peers_without_a_device_and_warns_for_auto_ones() -> None:
    """This machine has no verbs device: an rdma:// peer cannot work (a required FAIL that
    says why and how), an auto:// one falls back to TCP (a warning)."""
    strict = doctor_rdma.check_rdma(Options(peers=["rdma://127.0.0.1:7070"]), timeout=0.5)
    rdma = next(c for c in strict if c.name == "rdma")
    assert (rdma.status, rdma.required) == (FAIL, True)
    assert "no verbs device" in rdma.detail or "not built" in rdma.detail, rdma
    assert rdma.fix
    loose = doctor_rdma.check_rdma(Options(peers=["auto://127.0.0.1:7070"]), timeout=0.5)
    assert next(c for c in loose if c.name == "rdma").status == WARN


def test_memlock_is_checked_against_the_staging_buffers(tmp_path) -> None:
    """Catches a memlock check that passes a limit too small for the staging buffers (one
    16 MiB buffer per RDMA peer), fails a process that may lock without limit (no limit,
    CAP_IPC_LOCK), or misreads the capability from /proc/self/status."""
    no_cap = tmp_path / "status"
    no_cap.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    with_cap = tmp_path / "status_cap"
    with_cap.write_text("CapEff:\t0000000000004000\n")
    assert doctor_rdma.has_ipc_lock(str(with_cap))
    assert not doctor_rdma.has_ipc_lock(str(no_cap))
    assert not doctor_rdma.has_ipc_lock(str(tmp_path / "missing"))
    c = doctor_rdma.check_memlock(2, True, limit=lambda: 8 << 20, ipc_lock=lambda: False)
    assert (c.status, c.required) == (FAIL, True)
    assert "8 MiB" in c.detail and "32 MiB" in c.detail and "LimitMEMLOCK" in c.fix
    loose = doctor_rdma.check_memlock(2, False, limit=lambda: 8 << 20, ipc_lock=lambda: False)
    assert loose.status == WARN
    assert doctor_rdma.check_memlock(2, True, lambda: 32 << 20, lambda: False).status == OK
    assert doctor_rdma.check_memlock(2, True, lambda: 64 << 20, lambda: False).status == OK
    capped = doctor_rdma.check_memlock(2, True, lambda: 8 << 20, lambda: True)
    assert (capped.status, capped.detail.split(":")[0]) == (OK, "CAP_IPC_LOCK")
    unlimited = doctor_rdma.check_memlock(2, True, lambda: resource.RLIM_INFINITY, lambda: False)
    assert (unlimited.status, unlimited.detail) == (OK, "no locked-memory limit")
    # by default it judges this process's own limit and capability
    assert doctor_rdma.memlock_limit() == resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert doctor_rdma.check_memlock(2, True) == doctor_rdma.check_memlock(
        2, True, doctor_rdma.memlock_limit, doctor_rdma.has_ipc_lock
    )


def test_status_says_how_each_peers_pages_move() -> None:
    peers = [
        {"peer": "rdma://127.0.0.1:7070"},
        {"peer": "auto://127.0.0.1:7071"},
        {"peer": "127.0.0.1:7072"},
    ]
    daemon_peers = [
        {"peer": "127.0.0.1:7070", "transport_in_use": "rdma", "rdma_device": "mlx5_0"},
        {
            "peer": "127.0.0.1:7071",
            "transport_in_use": "tcp",
            "rdma_error": "the memserver refused RDMA: this memserver does not serve RDMA",
        },
        {"peer": "127.0.0.1:7072", "transport_in_use": "tcp"},
    ]
    control._add_transports(peers, daemon_peers)
    assert peers[0]["transport"] == {
        "asked": "rdma",
        "in_use": "rdma",
        "rdma_device": "mlx5_0",
        "rdma_error": None,
    }
    texts = [control._transport_text(p["transport"]) for p in peers]
    assert texts == [
        ", by RDMA (mlx5_0)",
        ", by TCP (RDMA: the memserver refused RDMA: this memserver does not serve RDMA)",
        ", by TCP",
    ]
    assert control._transport_text({"asked": "rdma", "in_use": None}) == ""
