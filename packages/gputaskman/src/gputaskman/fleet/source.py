"""What the fleet's views, outputs and recorder read from: the direct poller
(`poller.Poller`) or Prometheus (`promfleet.PromFleet`), each publishing one `HostState` per
host from its own thread."""

from __future__ import annotations

from typing import Protocol

from gputaskman.fleet.poller import HostState
from gputaskman.fleet.targets import Target


class FleetSource(Protocol):
    interval: float  # seconds between refreshes
    timeout: float  # seconds one refresh may take
    version: int  # bumped on every publication

    def states(self) -> tuple[HostState, ...]: ...

    @property
    def targets(self) -> tuple[Target, ...]:
        """The hosts known now (Prometheus: those it scraped in the last round)."""
        ...

    @property
    def error(self) -> str | None:
        """Why the source as a whole could not be read in its last round (None: it was)."""
        ...

    def poll_now(self) -> None: ...

    def focus(self, name: str | None) -> None:
        """Host `name` is open in the TUI (None: none is): read it as live as possible."""
        ...

    @property
    def origin(self) -> str:
        """Where the states come from, for the status line ("": the hosts themselves)."""
        ...

    def wait_polled(self, timeout: float) -> bool:
        """Wait until every host has been read (or failed) once (True), or `timeout`."""
        ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...


class FixedSource:
    """Host states that do not change by themselves (a saved fleet document shown in the
    TUI: screenshots, tests); `set` replaces them."""

    origin = ""
    error: str | None = None

    def __init__(
        self, states: tuple[HostState, ...], interval: float = 1.0, timeout: float = 2.0
    ) -> None:
        self._states = states
        self.interval = interval
        self.timeout = timeout
        self.version = 1
        self.polled = 0  # poll_now calls
        self.focused: str | None = None

    @property
    def targets(self) -> tuple[Target, ...]:
        return tuple(s.target for s in self._states)

    def states(self) -> tuple[HostState, ...]:
        return self._states

    def set(self, states: tuple[HostState, ...]) -> None:
        self._states = states
        self.version += 1

    def poll_now(self) -> None:
        self.polled += 1

    def focus(self, name: str | None) -> None:
        self.focused = name

    def wait_polled(self, timeout: float) -> bool:
        return True

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 10.0) -> None:
        pass
