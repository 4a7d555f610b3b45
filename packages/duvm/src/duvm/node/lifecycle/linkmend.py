"""A connection the kernel cut while its daemon lives gets a new one at once.

Theory of operation: the kernel nbd driver's receive worker marks its connection slot dead
when its loop ends, whatever socket the slot holds by then (`recv_work` calls
`nbd_mark_nsock_dead` on the slot, which shuts that socket down). When a daemon is SIGKILLed,
a request sent meanwhile can mark the slot dead first; the successor's connection then takes
the slot, and the old worker, kept off the CPU by the realtime supervisor and standby, ends
afterwards and cuts the successor's connection: every request waits for the dead-connection
timeout while the new daemon idles. Seen in the QEMU guest (the kernel's log: "reconnected
socket", then 68 ms later "Receive control failed (result -32)" and "Dead connection, failed
to find a fallback"; docs/BENCHMARKS.md, "A takeover that served nobody"). The driver reports
each slot that goes from live to dead (``NBD_CMD_LINK_DEAD``, `duvm.wire.nbdnetlink`): the
supervisor listens, and when a report names its device while the daemon runs, it waits
`SETTLE_S` (the cutting worker ends first; it could cut the next connection too) and hands the
device a new connection to the daemon. A report that needs nothing (the crash's own, read
after the takeover) costs one connection the driver drops: it takes one only in place of a
dead one (DECISIONS.md D51).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from duvm.node.attach import attach_state
from duvm.node.lifecycle import control, resume
from duvm.wire import nbdnetlink

# the takeover's pause between handings, for the same reason: the driver's workers run first
SETTLE_S = resume.HAND_RETRY_S


class LinkEvents(Protocol):
    """Reports of a device's connection gone dead (`nbdnetlink.LinkDeadEvents`)."""

    def fileno(self) -> int: ...

    def take(self) -> list[int]:
        """The device indexes reported since the last call (`nbdnetlink.LOST`: some were
        lost), without waiting."""
        ...

    def close(self) -> None: ...


def kernel_events(say: Callable[[str], None]) -> LinkEvents | None:
    """The driver's own reports, or None (said once) where they cannot be heard."""
    try:
        return nbdnetlink.subscribe_link_dead()
    except OSError as exc:
        say(
            f"the kernel's reports of dead connections are not heard ({exc}): a connection "
            "it cuts while the daemon runs waits for its dead-connection timeout"
        )
        return None


class Mender:
    """Hands a device a new connection to its running daemon when the kernel reports the one
    it had dead (see the module docstring). `reattach` is `attach_kernel.reattach`."""

    def __init__(
        self,
        events: LinkEvents,
        reattach: Callable[[attach_state.Attachment, str], None],
        say: Callable[[str], None],
        settle_s: float = SETTLE_S,
    ) -> None:
        self._events, self._reattach, self._say = events, reattach, say
        self._settle_s = settle_s
        self.handed = 0  # connections handed since this supervisor started

    def fileno(self) -> int:
        return self._events.fileno()

    def mend(self, att: attach_state.Attachment, daemon: control.DaemonInfo) -> bool:
        """Read the reports; when one names `att`'s device (or some were lost) and `daemon`
        still runs, hand the device a new connection to it. True when one was handed. A dead
        daemon is left to the takeover or the restart, which hand their own."""
        reported = self._events.take()
        if not reported or att.nbd_device is None:
            return False
        index = nbdnetlink.device_index(att.nbd_device)
        if index not in reported and nbdnetlink.LOST not in reported:
            return False
        if not control.daemon_alive(daemon):
            return False
        time.sleep(self._settle_s)
        self._events.take()  # what came meanwhile is mended by this handing too
        try:
            self._reattach(att, daemon.socket)
        except Exception as exc:  # a failed mending must not end the supervisor
            self._say(
                f"the kernel reported {att.device}'s connection dead while daemon pid "
                f"{daemon.pid} runs; handing it a new one failed: {exc}"
            )
            return False
        self.handed += 1
        self._say(
            f"the kernel reported {att.device}'s connection dead while daemon pid {daemon.pid} "
            f"runs: handed it a new one ({self.handed} since this supervisor started; the "
            "driver keeps it only in place of a dead one)"
        )
        return True

    def close(self) -> None:
        self._events.close()
