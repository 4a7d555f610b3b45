"""The supervisor's mending of a connection the kernel reports dead (duvm.node.lifecycle.linkmend)
on its own: which reports make it hand the device a new connection, and what it does when it
cannot. The whole path (a real daemon and standby, the kernel's part played over the daemon's
socket) is test_standby.py's; the real driver's reports come in the kernel-nbd QEMU guest."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from duvm.node.attach import attach_state
from duvm.node.lifecycle import control, linkmend
from duvm.wire import nbdnetlink

STAND_IN = "import time; time.sleep(120)"  # named `duvm.cli daemon` on its command line


class Reports:
    """The driver's reports as a test posts them (a `linkmend.LinkEvents`)."""

    def __init__(self) -> None:
        self.waiting: list[int] = []
        self.closed = False

    def fileno(self) -> int:
        return 0  # never polled here

    def take(self) -> list[int]:
        out, self.waiting = self.waiting, []
        return out

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def daemon() -> Iterator[control.DaemonInfo]:
    p = subprocess.Popen([sys.executable, "-c", STAND_IN, "duvm.cli", "daemon"])
    try:
        yield control.DaemonInfo(
            p.pid, "/run/duvm-test/nbd.sock", [], 1 << 20, 1, "log", time.time(), "c", []
        )
    finally:
        p.kill()
        p.wait()


ATT = attach_state.Attachment(
    socket="/run/duvm-test/nbd.sock",
    method=attach_state.METHOD_KERNEL,
    device="/dev/nbd7",
    nbd_device="/dev/nbd7",
    nbd_netlink=True,
)


def _mender(reports: Reports, handed: list[str], said: list[str], fail: bool = False):
    def reattach(att: attach_state.Attachment, path: str) -> None:
        if fail:
            raise attach_state.AttachError("the daemon refused the handshake")
        handed.append(path)

    return linkmend.Mender(reports, reattach, said.append, settle_s=0)


def test_only_its_own_device_or_lost_reports_make_it_hand(daemon: control.DaemonInfo) -> None:
    """Catches a mender that hands a connection for another device's report (a second
    handing is dropped by the driver, but each costs a handshake), or that ignores reports
    lost to a full socket buffer (`LOST`: its own may be among them)."""
    reports, handed, said = Reports(), [], []
    m = _mender(reports, handed, said)
    assert m.mend(ATT, daemon) is False and handed == []  # nothing reported
    reports.waiting = [3, 12]
    assert m.mend(ATT, daemon) is False and handed == []
    reports.waiting = [3, 7, 7]  # two reports of one cut: one handing
    assert m.mend(ATT, daemon) is True and handed == [daemon.socket]
    reports.waiting = [nbdnetlink.LOST]
    assert m.mend(ATT, daemon) is True and handed == [daemon.socket] * 2
    assert m.handed == 2 and len(said) == 2
    assert f"while daemon pid {daemon.pid} runs: handed it a new one (2 since" in said[-1]


def test_a_dead_daemon_is_left_to_the_takeover(daemon: control.DaemonInfo) -> None:
    """Catches a mender that hands the device a connection to a daemon that has died: the
    takeover (or the restart) gives the device its successor's, and a handing to the dead
    daemon's socket would only fail or, worse, reach a stale listener."""
    reports, handed, said = Reports(), [], []
    m = _mender(reports, handed, said)
    dead = subprocess.Popen([sys.executable, "-c", "pass", "duvm.cli", "daemon"])
    dead.wait()
    gone = control.DaemonInfo(dead.pid, daemon.socket, [], 1 << 20, 1, "log", 0.0, "c", [])
    reports.waiting = [7]
    assert m.mend(ATT, gone) is False and handed == [] and said == []


def test_a_handing_that_fails_is_said_and_the_supervisor_goes_on(
    daemon: control.DaemonInfo,
) -> None:
    """Catches a mender whose failed handing ends the supervisor (an exception out of its
    loop): the daemon may still die later, and only the supervisor would take it over."""
    reports, handed, said = Reports(), [], []
    m = _mender(reports, handed, said, fail=True)
    reports.waiting = [7]
    assert m.mend(ATT, daemon) is False and m.handed == 0
    assert said == [
        f"the kernel reported /dev/nbd7's connection dead while daemon pid {daemon.pid} runs; "
        "handing it a new one failed: the daemon refused the handshake"
    ]
    m.close()
    assert reports.closed
