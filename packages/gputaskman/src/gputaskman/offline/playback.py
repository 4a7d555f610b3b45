"""The playback behind ``gputaskman replay``: a record file's frames and the clock, UI-free.

Theory of operation
-------------------
`RecordSource.open` scans the file once (`recordfile.iter_record`): every line is parsed
and checked to be a snapshot object, so malformed lines are counted and reported up front
(with line numbers); a trailing incomplete line (what a killed recorder leaves) is skipped
and mentioned, not counted as malformed. Only each good line's byte offset and ``taken``
are kept; a frame is re-read and converted to model objects when shown (a small cache
holds the last few), so an hours-long recording does not sit in memory. Converting is
the costly half of reading a line, so it is not done for every line up front: a line
whose JSON is a snapshot but whose content cannot be shown (rare: hand-edited or
damaged files) is found when first shown, skipped (the previous frame stays on screen)
and reported then. Nothing here samples the GPU.

`Playback` is the clock, and knows nothing about files or terminals, so it is tested
without either. Its timeline is the recorded ``taken`` times when they strictly increase
(``recorded_time`` true); otherwise (a clock step, concatenated files, equal stamps) it
falls back to one second per snapshot and says so (``time_label``), because showing
made-up spacing as if it had been recorded would overstate what the file knows.
``advance(wall_seconds)`` moves the position by wall time times `speed` while playing and
stops at the end; `step` moves by whole snapshots and pauses; `seek*` jump to a time; the
current frame is the last one at or before the position.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputaskman.base.readings import Snapshot
from gputaskman.offline.recorded import RecordedSystem, snapshot_from_json
from gputaskman.offline.recordfile import SnapshotError, describe_lines, iter_record, read_entry

SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
SECONDS_PER_SNAPSHOT = 1.0  # the timeline when recorded times cannot be used


def strictly_increasing(times: Sequence[float]) -> bool:
    return all(b > a for a, b in itertools.pairwise(times))


class Playback:
    """Position, play/pause, speed, step and seek over a sequence of snapshot times."""

    def __init__(self, taken: Sequence[float], *, speed: float = 1.0) -> None:
        if not taken:
            raise ValueError("no snapshots to play")
        self.recorded_time = strictly_increasing(taken)
        if self.recorded_time:
            self.times = [t - taken[0] for t in taken]
        else:
            self.times = [i * SECONDS_PER_SNAPSHOT for i in range(len(taken))]
        self.taken = list(taken)
        self.position = 0.0
        self.playing = False
        self.speed = 1.0
        self.set_speed(speed)

    # -- state

    @property
    def count(self) -> int:
        return len(self.times)

    @property
    def duration(self) -> float:
        return self.times[-1]

    @property
    def index(self) -> int:
        """The frame shown: the last one at or before the position."""
        return max(0, bisect.bisect_right(self.times, self.position + 1e-9) - 1)

    @property
    def at_end(self) -> bool:
        return self.position >= self.duration

    @property
    def time_label(self) -> str:
        if self.recorded_time:
            return "recorded time"
        return f"not recorded time ({SECONDS_PER_SNAPSHOT:g} s per snapshot)"

    # -- playing

    def play(self) -> None:
        if self.at_end:  # playing from the end starts over
            self.position = 0.0
        self.playing = self.count > 1

    def pause(self) -> None:
        self.playing = False

    def toggle(self) -> None:
        if self.playing:
            self.pause()
        else:
            self.play()

    def advance(self, wall_seconds: float) -> bool:
        """Move by `wall_seconds` of real time while playing; True when the frame changed."""
        if not self.playing or wall_seconds <= 0:
            return False
        before = self.index
        self.position = min(self.duration, self.position + wall_seconds * self.speed)
        if self.at_end:
            self.playing = False
        return self.index != before

    # -- moving

    def step(self, frames: int) -> int:
        """Move `frames` snapshots (negative: back) and pause; returns the new index."""
        self.pause()
        i = max(0, min(self.count - 1, self.index + frames))
        self.position = self.times[i]
        return i

    def seek(self, seconds: float) -> int:
        """Jump to `seconds` from the start of the timeline (clamped)."""
        if not math.isfinite(seconds):
            raise ValueError(f"cannot seek to {seconds}")
        self.position = max(0.0, min(self.duration, seconds))
        return self.index

    def seek_by(self, seconds: float) -> int:
        return self.seek(self.position + seconds)

    def seek_fraction(self, fraction: float) -> int:
        return self.seek(self.duration * max(0.0, min(1.0, fraction)))

    def seek_index(self, index: int) -> int:
        return self.seek(self.times[max(0, min(self.count - 1, index))])

    # -- speed

    def set_speed(self, speed: float) -> None:
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive number, not {speed}")
        self.speed = speed

    def faster(self) -> float:
        self.speed = next((s for s in SPEEDS if s > self.speed), self.speed)
        return self.speed

    def slower(self) -> float:
        self.speed = next((s for s in reversed(SPEEDS) if s < self.speed), self.speed)
        return self.speed


# ---------------------------------------------------------------------------- file


@dataclass(frozen=True, slots=True)
class FrameRef:
    lineno: int
    offset: int
    length: int
    taken: float


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What reading the file found, for the user."""

    path: str
    frames: int
    malformed: tuple[tuple[int, str], ...]  # (line number, why), not the trailing line
    incomplete_last_line: int | None  # its line number when skipped

    def lines(self) -> list[str]:
        out = []
        if self.malformed:
            nums = [n for n, _ in self.malformed]
            out.append(
                f"skipped {len(nums)} malformed line(s): {describe_lines(nums)} "
                f"(line {nums[0]}: {self.malformed[0][1]})"
            )
        if self.incomplete_last_line is not None:
            out.append(
                f"skipped the incomplete last line {self.incomplete_last_line} "
                "(the recording was interrupted mid-write)"
            )
        return out


class RecordSource:
    """A record file's good lines, loaded on demand (see the module docstring)."""

    CACHE = 8

    def __init__(
        self, path: str | Path, frames: list[FrameRef], report: LoadReport, host: str | None = None
    ) -> None:
        self.path = Path(path)
        self.host = host  # in a fleet file: whose snapshots these are
        self.frames = frames
        self.report = report
        # frames whose JSON was a snapshot but whose content could not be shown, found
        # when first loaded: frame index -> why
        self.late_malformed: dict[int, str] = {}
        self._cache: OrderedDict[int, tuple[Snapshot, RecordedSystem]] = OrderedDict()

    @classmethod
    def open(
        cls,
        path: str | Path,
        progress: Callable[[int, int], None] | None = None,
        host: str | None = None,
    ) -> RecordSource:
        """Scan the file (raises OSError when it cannot be read). `progress(bytes_read,
        file_size)` is called now and then, for a long file. With `host`, the file is a
        fleet record and the frames are that host's snapshots."""
        frames: list[FrameRef] = []
        malformed: list[tuple[int, str]] = []
        incomplete = None
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for e in iter_record(f, host):
                if progress is not None and e.lineno % 500 == 0:
                    progress(e.offset, size)
                if e.doc is None:
                    if e.incomplete:
                        incomplete = e.lineno
                    else:
                        malformed.append((e.lineno, e.error or "?"))
                    continue
                frames.append(FrameRef(e.lineno, e.offset, e.length, e.taken))
        report = LoadReport(str(path), len(frames), tuple(malformed), incomplete)
        return cls(path, frames, report, host)

    @property
    def malformed_count(self) -> int:
        return len(self.report.malformed) + len(self.late_malformed)

    def playback(self, speed: float = 1.0) -> Playback:
        return Playback([f.taken for f in self.frames], speed=speed)

    def doc(self, index: int) -> dict[str, Any]:
        f = self.frames[index]
        return read_entry(self.path, f.offset, f.length, self.host)

    def load(self, index: int) -> tuple[Snapshot, RecordedSystem]:
        """The snapshot and system of frame `index`. Raises SnapshotError (and remembers
        it in `late_malformed`) when the line cannot be shown or the file changed."""
        hit = self._cache.get(index)
        if hit is not None:
            self._cache.move_to_end(index)
            return hit
        try:
            got = snapshot_from_json(self.doc(index))
        except SnapshotError as exc:
            self.late_malformed[index] = str(exc)
            raise
        self._cache[index] = got
        if len(self._cache) > self.CACHE:
            self._cache.popitem(last=False)
        return got
