"""The replay TUI: the live app's screen, fed from a record file instead of a collector.

Theory of operation
-------------------
`ReplayApp` subclasses `app.GtmApp`, so header, process table, inspector, system panel,
sorting and GPU switching are the live app's own code. The seam is
`GtmApp.request_refresh`, which the live app's timer calls every interval to start a
collection: here it instead advances the `playback.Playback` clock by the wall time since
the last tick and, when the frame changed, hands the recorded snapshot to the live app's
`on_sample_ready`. No collector is ever created (the factory given to the base class
raises), so replay never samples the GPU.

Keys added to the live app's: space play/pause, ``.``/``,`` one snapshot forward/back,
``]``/``[`` ten seconds, ``}``/``{`` a minute, ``+``/``-`` speed, ``0``-``9`` jump to
0-90 % of the recording. The status line says where playback is, at what speed, and
whether the timeline is recorded time or one second per snapshot.
"""

from __future__ import annotations

import time
from typing import ClassVar

from textual.binding import Binding

from gputaskman.offline.playback import Playback, RecordSource
from gputaskman.offline.recordfile import SnapshotError
from gputaskman.tui.app import GtmApp, SampleReady
from gputaskman.tui.screens.help import HelpScreen

TICK = 0.1  # seconds between playback clock updates


def _clock(seconds: float) -> str:
    """``M:SS.s`` below an hour (short recordings need the tenths), else ``H:MM:SS``."""
    if seconds < 3600:
        return f"{int(seconds // 60)}:{seconds % 60:04.1f}"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _no_collector() -> object:
    raise RuntimeError("replay never samples the GPU")


class ReplayApp(GtmApp):
    TITLE = "gputaskman replay"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("space", "toggle_pause", "play/pause", key_display="space"),
        Binding("full_stop", "step(1)", "next snapshot", key_display="."),
        Binding("comma", "step(-1)", "previous snapshot", key_display=","),
        Binding("right_square_bracket", "seek(10)", "forward 10 s", key_display="]"),
        Binding("left_square_bracket", "seek(-10)", "back 10 s", key_display="["),
        Binding("right_curly_bracket", "seek(60)", "forward 1 min", key_display="}"),
        Binding("left_curly_bracket", "seek(-60)", "back 1 min", key_display="{"),
        Binding("plus,equals_sign", "faster", "faster", key_display="+"),
        Binding("minus", "slower", "slower", key_display="-"),
        *(
            Binding(str(d), f"seek_percent({d * 10})", f"jump to {d * 10}%", show=False)
            for d in range(10)
        ),
    ]

    def __init__(self, source: RecordSource, playback: Playback, *, gpu: int | None = None) -> None:
        # read-only: a recording's processes are not this machine's to signal
        super().__init__(_no_collector, gpu=gpu, interval=TICK, readonly=True)  # type: ignore[arg-type]
        self.source = source
        self.playback = playback
        self.sub_title = str(source.path) + (f" · host {source.host}" if source.host else "")
        self.frame_index: int | None = None
        self._last_tick = time.monotonic()
        self._reported = False

    # -- the seam: the live app's timer lands here

    def request_refresh(self) -> None:
        now = time.monotonic()
        elapsed, self._last_tick = now - self._last_tick, now
        self.playback.advance(elapsed)
        if self.frame_index != self.playback.index:
            self.show_frame()
        elif self.playback.playing:
            self.render_status()

    def show_frame(self) -> None:
        if not self._reported:
            self._reported = True
            for message in self.source.report.lines():
                self.notify(message, severity="warning", timeout=8)
        i = self.playback.index
        if self.frame_index is not None and i != self.frame_index + 1:
            self.history.clear()  # a jump: the frames before are not this one's past
        self.frame_index = i
        try:
            snapshot, system = self.source.load(i)
        except (OSError, SnapshotError) as exc:
            # skipped: the previous frame stays on screen, and the status says why
            line = self.source.frames[i].lineno
            self.last_error = f"snapshot {i + 1} (line {line}) skipped: {exc}"
            self.notify(self.last_error, severity="warning", timeout=8)
            self.render_status()
            return
        self.on_sample_ready(SampleReady(snapshot, system, 0.0))

    # -- status

    def render_status(self) -> None:
        pb = self.playback
        state = f"▶ {pb.speed:g}x" if pb.playing else f"⏸ paused ({pb.speed:g}x)"
        i = pb.index
        parts = [
            state,
            f"snapshot {i + 1}/{pb.count} (line {self.source.frames[i].lineno})",
            f"{_clock(pb.position)} / {_clock(pb.duration)} {pb.time_label}",
        ]
        if self.snapshot is not None:
            taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.snapshot.taken))
            parts.append(f"taken {taken}")
        skipped = self.source.malformed_count
        if skipped:
            parts.append(f"{skipped} malformed line(s) skipped")
        if self.last_error:
            parts.append(self.last_error)
        parts.append("? help")
        self.status.update(" · ".join(parts))

    # -- actions

    def _moved(self) -> None:
        self._last_tick = time.monotonic()
        if self.frame_index != self.playback.index:
            self.show_frame()
        else:
            self.render_status()

    def action_toggle_pause(self) -> None:
        self.playback.toggle()
        self._moved()

    def action_refresh_now(self) -> None:
        self.frame_index = None
        self._moved()

    def action_step(self, frames: int) -> None:
        self.playback.step(frames)
        self._moved()

    def action_seek(self, seconds: float) -> None:
        self.playback.seek_by(seconds)
        self._moved()

    def action_seek_percent(self, percent: float) -> None:
        self.playback.seek_fraction(percent / 100)
        self._moved()

    def action_faster(self) -> None:
        self.playback.faster()
        self.render_status()

    def action_slower(self) -> None:
        self.playback.slower()
        self.render_status()

    def action_help(self) -> None:
        mine = [b for b in ReplayApp.BINDINGS if b.show]
        keys = {b.key for b in mine}
        live = [
            b
            for b in GtmApp.BINDINGS
            if b.key not in keys
            and b.action != "refresh_now"
            and self.check_action(b.action, ()) is not False
        ]
        shown = [Binding(b.key_display or b.key, b.action, b.description) for b in mine]
        self.push_screen(HelpScreen([*shown, Binding("0-9", "", "jump to 0-90%"), *live]))


def create_replay_app(
    source: RecordSource, *, speed: float = 1.0, gpu: int | None = None, playing: bool = True
) -> ReplayApp:
    """The replay app for the CLI and tests."""
    playback = source.playback(speed)
    if playing:
        playback.play()
    return ReplayApp(source, playback, gpu=gpu)
