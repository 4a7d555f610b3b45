"""WSL: the Windows host's GPU counters, streamed through interop, and context tracking.

Theory of operation
-------------------
Inside WSL2 the GPU belongs to Windows. Linux processes reach it through ``/dev/dxg``,
and Windows charges all of their GPU memory to one host process, the VM worker
``vmwp.exe``. So the only *measured* per-process figures are the host's, and the VM's
total is one number.

**Host stream.** `HostStream` runs ``powershell.exe`` (through WSL interop) with
`POWERSHELL_SCRIPT`, which keeps one ``Get-Counter -Continuous`` query open on the same
PDH counters the Windows backend reads (`win.pdh.COUNTERS`) and prints each sample in a
compact, tab-separated line format of our own (every line starts with ``gtm1``; anything
else PowerShell prints is ignored as noise)::

    gtm1 T <seq> <unix_ms>              a sample starts
    gtm1 C <L|N|E|D|S> <instance> <v>   one counter value (L Local Usage, N Non Local Usage,
                                        E engine %, D adapter Dedicated Usage, S Shared Usage)
    gtm1 P <pid> <process name>         the name of a PID seen in this sample
    gtm1 X <L|N|E|D|S|*> <message>      a counter set (or everything) failed, and why
    gtm1 Z <seq>                        the sample is complete

`StreamParser` is sans-io: bytes in, complete `HostFrame` values out. A sample without its
``Z`` line is never used (an interrupted sample says nothing), a line longer than
`MAX_LINE` is dropped and counted (a broken peer cannot make us buffer without bound), and
malformed lines are counted, never guessed. `HostFrame.reads()` turns a frame into the
`win.pdh.CounterRead` mapping, so `win.pdh.aggregate` does the same arithmetic for WSL as
for Windows.

**Context tracking.** `ContextTracker` infers how much of the ``vmwp.exe`` total belongs to
which Linux process holding ``/dev/dxg``, from one sample to the next:

* no holder: the total is the VM's own use (WSLg and friends): it becomes the *baseline*;
* exactly one holder: it gets ``total - baseline`` (the only explanation, marked unique),
  or, with no baseline seen yet, ``total`` as an upper bound (not unique);
* exactly one new holder and no one gone: it gets the rise of the total since the last
  sample (not unique when others hold contexts too: they could have grown at that moment);
* a holder that left takes its inference with it; if the inferences ever add up to more
  than the total minus the baseline, they are all dropped (no explanation fits).

Inferred values are ``Kind.INFERRED`` readings: shown, sorted by, never summed. They sit
under the ``vmwp.exe`` row, whose measured bytes are the only ones counted.

Not validated on WSL hardware: tests replay synthetic sequences shaped like what the host
prints, not measurements.
"""

from __future__ import annotations

import base64
import contextlib
import io
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, cast

from gputaskman.backends.win import pdh
from gputaskman.base.readings import Kind, Reading, Reason

TAG: Final = "gtm1"
MAX_LINE: Final = 64 * 1024
COUNTER_CODES: Final = {
    "L": pdh.LOCAL,
    "N": pdh.NON_LOCAL,
    "E": pdh.ENGINE,
    "D": pdh.ADAPTER_DEDICATED,
    "S": pdh.ADAPTER_SHARED,
}
VM_WORKER: Final = "vmwp"  # vmwp.exe, the Hyper-V VM worker process that runs WSL2
SOURCE: Final = "wsl:context tracking (vmwp.exe total)"

POWERSHELL_SCRIPT: Final = r"""
$ErrorActionPreference = 'Continue'
[Console]::OutputEncoding = New-Object System.Text.UTF8Encoding $false
$inv = [Globalization.CultureInfo]::InvariantCulture
if (-not (Get-Counter -ListSet 'GPU Process Memory' -ErrorAction SilentlyContinue)) {
  $why = "no 'GPU Process Memory' counter set (Windows before 10 1709, or localized names)"
  [Console]::Out.Write("gtm1`tX`t*`t$why`n")
  exit 2
}
$paths = @('\GPU Process Memory(*)\Local Usage', '\GPU Process Memory(*)\Non Local Usage',
           '\GPU Engine(*)\Utilization Percentage', '\GPU Adapter Memory(*)\Dedicated Usage',
           '\GPU Adapter Memory(*)\Shared Usage')
function Clean([string]$s) { return ($s -replace '[\t\r\n]', ' ') }
function Code([string]$p) {
  $p = $p.ToLowerInvariant()
  if ($p.Contains('gpu process memory')) { if ($p.EndsWith('\non local usage')) { return 'N' }
                                           if ($p.EndsWith('\local usage')) { return 'L' } }
  if ($p.Contains('gpu engine')) { return 'E' }
  if ($p.Contains('gpu adapter memory')) { if ($p.EndsWith('\dedicated usage')) { return 'D' }
                                           if ($p.EndsWith('\shared usage')) { return 'S' } }
  return $null
}
$seq = 0
try {
  Get-Counter -Counter $paths -Continuous -SampleInterval __INTERVAL__ `
              -ErrorAction SilentlyContinue | ForEach-Object {
    $seq++
    $ms = ([DateTimeOffset]$_.Timestamp).ToUnixTimeMilliseconds()
    $lines = New-Object System.Collections.Generic.List[string]
    $lines.Add("gtm1`tT`t$seq`t$ms")
    $pids = @{}
    foreach ($s in $_.CounterSamples) {
      $c = Code $s.Path
      if ($null -eq $c -or $s.Status -ne 0) { continue }
      $v = ([double]$s.CookedValue).ToString('R', $inv)
      $lines.Add("gtm1`tC`t$c`t$(Clean $s.InstanceName)`t$v")
      if ($s.InstanceName -match '^pid_(\d+)_') { $pids[[int]$Matches[1]] = $true }
    }
    if ($pids.Count -gt 0) {
      foreach ($p in (Get-Process -Id @($pids.Keys) -ErrorAction SilentlyContinue)) {
        $lines.Add("gtm1`tP`t$($p.Id)`t$(Clean $p.ProcessName)")
      }
    }
    $lines.Add("gtm1`tZ`t$seq")
    [Console]::Out.Write(($lines -join "`n") + "`n")
    [Console]::Out.Flush()
  }
} catch {
  [Console]::Out.Write("gtm1`tX`t*`t$(Clean $_.Exception.Message)`n")
}
"""


def powershell_command(interval: float = 1.0, exe: str = "powershell.exe") -> list[str]:
    """The interop command line: the script passed as -EncodedCommand (UTF-16LE base64),
    so no quoting survives a trip through two shells badly."""
    script = POWERSHELL_SCRIPT.replace("__INTERVAL__", str(max(1, round(interval))))
    encoded = base64.b64encode(script.encode("utf-16-le")).decode("ascii")
    return [
        exe,
        "-NoProfile",
        "-NonInteractive",
        "-ExecutionPolicy",
        "Bypass",
        "-EncodedCommand",
        encoded,
    ]


@dataclass(slots=True)
class HostFrame:
    """One complete host sample."""

    seq: int
    taken: float  # Unix seconds (host clock)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # pdh path -> values
    failures: dict[str, str] = field(default_factory=dict)  # pdh path (or "*") -> message
    names: dict[int, str] = field(default_factory=dict)

    def reads(self) -> dict[str, pdh.CounterRead]:
        """As `win.pdh` reads: a failed set is failed, an absent one is an empty answer."""
        out: dict[str, pdh.CounterRead] = {}
        for path in pdh.COUNTERS:
            msg = self.failures.get(path) or self.failures.get("*")
            if msg is not None:
                out[path] = pdh.CounterRead.failed(0, f"host: {msg}")
            else:
                out[path] = pdh.CounterRead.ok(self.counters.get(path, {}))
        return out


@dataclass(slots=True)
class StreamStats:
    noise: int = 0  # lines that are not ours (PowerShell banners, warnings)
    malformed: int = 0  # our tag, but unreadable
    overlong: int = 0  # lines over MAX_LINE, dropped
    incomplete: int = 0  # samples started and never finished
    errors: list[str] = field(default_factory=list)  # X lines outside a sample (last 5)


class StreamParser:
    """Sans-io parser of the host stream: `feed(bytes)` returns the frames it completed."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skipping = False  # inside an overlong line, until its newline
        self._frame: HostFrame | None = None
        self.stats = StreamStats()

    def feed(self, data: bytes) -> list[HostFrame]:
        out: list[HostFrame] = []
        self._buf += data
        pos = 0  # consumed prefix, dropped once at the end (not per line: that is quadratic)
        while True:
            nl = self._buf.find(b"\n", pos)
            if nl < 0:
                del self._buf[:pos]
                if len(self._buf) > MAX_LINE:
                    self._buf.clear()
                    if not self._skipping:
                        self.stats.overlong += 1
                    self._skipping = True
                return out
            line = bytes(self._buf[pos:nl])
            pos = nl + 1
            if self._skipping:
                self._skipping = False
                continue
            if len(line) > MAX_LINE:
                self.stats.overlong += 1
                continue
            frame = self._line(line.decode("utf-8", "replace").rstrip("\r"))
            if frame is not None:
                out.append(frame)

    def _line(self, text: str) -> HostFrame | None:
        parts = text.split("\t")
        if parts[0].lstrip("\ufeff") != TAG or len(parts) < 2:
            if text.strip():
                self.stats.noise += 1
            return None
        kind, args = parts[1], parts[2:]
        try:
            if kind == "T":
                if self._frame is not None:
                    self.stats.incomplete += 1
                seq, ms = int(args[0]), int(args[1])
                self._frame = HostFrame(seq, ms / 1000.0)
                return None
            if kind == "X" and len(args) >= 2:
                where = COUNTER_CODES.get(args[0], "*")
                if self._frame is None:
                    self.stats.errors = [*self.stats.errors[-4:], args[1]]
                else:
                    self._frame.failures[where] = args[1]
                return None
            f = self._frame
            if f is None:
                self.stats.malformed += 1
                return None
            if kind == "C" and len(args) == 3 and args[0] in COUNTER_CODES:
                value = float(args[2])
                f.counters.setdefault(COUNTER_CODES[args[0]], {})[args[1]] = value
            elif kind == "P" and len(args) >= 2:
                f.names[int(args[0])] = "\t".join(args[1:])
            elif kind == "Z" and len(args) == 1:
                self._frame = None
                if int(args[0]) != f.seq:
                    self.stats.incomplete += 1
                    return None
                return f
            else:
                self.stats.malformed += 1
        except (ValueError, IndexError):
            self.stats.malformed += 1
        return None


class HostStream:
    """Runs the host command and keeps the latest complete frame (a reader thread).

    `command` defaults to `powershell_command()`; tests pass any program that prints the
    line format. `latest()` returns the newest frame and, when the stream is not usable,
    why (not started, exited with its stderr, no complete sample yet).
    """

    def __init__(self, command: Sequence[str] | None = None, interval: float = 1.0) -> None:
        self.command = list(command) if command is not None else powershell_command(interval)
        self.parser = StreamParser()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest: HostFrame | None = None
        self._received: float | None = None
        self._start_error: str | None = None
        self._stderr = b""

    def start(self) -> None:
        if self._proc is not None or self._start_error is not None:
            return
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            self._start_error = f"cannot run {self.command[0]}: {exc}"
            return
        self._thread = threading.Thread(target=self._pump, name="gtm-wsl-host", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        # read1: whatever has arrived (up to 64 KiB), so a frame is seen as soon as it ends;
        # Popen's default bufsize makes the pipe an io.BufferedReader, which has it
        read = cast(io.BufferedReader, proc.stdout).read1
        for chunk in iter(lambda: read(65536), b""):
            frames = self.parser.feed(chunk)
            if frames:
                with self._lock:
                    self._latest = frames[-1]
                    self._received = time.monotonic()
        if proc.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                self._stderr = proc.stderr.read(4096)

    def latest(self, max_age: float | None = None) -> tuple[HostFrame | None, str | None]:
        """(frame, None) when a fresh frame exists, else (last frame or None, why)."""
        if self._start_error is not None:
            return None, self._start_error
        if self._proc is None:
            return None, "host stream not started"
        with self._lock:
            frame, received = self._latest, self._received
        code = self._proc.poll()
        if code is not None:
            # let the reader finish so a last frame and stderr are not lost
            if self._thread is not None:
                self._thread.join(timeout=1.0)
            with self._lock:
                frame = self._latest
            err = self._stderr.decode("utf-8", "replace").strip().splitlines()
            tail = f": {err[-1]}" if err else ""
            errors = "; ".join(self.parser.stats.errors)
            why = f"host counter stream exited with code {code}{tail}"
            return frame, why + (f" ({errors})" if errors else "")
        if frame is None:
            return None, "waiting for the first host sample"
        if max_age is not None and received is not None and time.monotonic() - received > max_age:
            return frame, f"last host sample is older than {max_age:.0f}s"
        return frame, None

    @property
    def exited(self) -> bool:
        """True once the child has ended (or could not be started)."""
        if self._start_error is not None:
            return True
        return self._proc is not None and self._proc.poll() is not None

    def restart(self) -> None:
        """End the child (if any) and start a fresh one with a fresh parser. The last frame
        is dropped: a sample from before the gap must not pass for a current one."""
        self.close()
        self.parser = StreamParser()
        self._proc, self._thread = None, None
        with self._lock:
            self._latest, self._received = None, None
        self._start_error, self._stderr = None, b""
        self.start()

    def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=3)
        if self._thread is not None:
            self._thread.join(timeout=3)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def is_vm_worker(name: str | None) -> bool:
    return name is not None and name.lower().removesuffix(".exe") == VM_WORKER


@dataclass(frozen=True, slots=True)
class Inference:
    """What the tracker says about one holder: a reading (inferred or missing) and whether
    it is the only explanation (the ``*`` marker)."""

    reading: Reading
    unique: bool = False


Key = tuple[int, float | None]  # (pid, create_time) of a Linux process holding /dev/dxg


class ContextTracker:
    """Infers per-process shares of the vmwp.exe total; see the module docstring."""

    def __init__(self) -> None:
        self.baseline: int | None = None
        self._sizes: dict[Key, tuple[int, bool, str]] = {}  # key -> (bytes, unique, how)
        self._prev_total: int | None = None
        self._prev_holders: frozenset[Key] | None = None

    def update(self, vm_total: int | None, holders: Sequence[Key]) -> dict[Key, Inference]:
        current = frozenset(holders)
        if vm_total is None:
            self._prev_total, self._prev_holders = None, None
            why = Reading.missing(
                Reason.UNAVAILABLE, SOURCE, "the host's vmwp.exe total is unknown", Kind.INFERRED
            )
            return {k: Inference(why) for k in current}
        for k in list(self._sizes):
            if k not in current:
                del self._sizes[k]  # a holder that left takes its share with it
        if not current:
            self.baseline = vm_total
            self._sizes.clear()
        elif len(current) == 1:
            (only,) = current
            if self.baseline is not None and vm_total < self.baseline:
                self.baseline = None  # the VM's own use shrank: the baseline no longer holds
            if self.baseline is not None:
                self._sizes[only] = (vm_total - self.baseline, True, "VM total minus idle baseline")
            else:
                self._sizes[only] = (
                    vm_total,
                    False,
                    "upper bound: the whole VM total (no idle baseline seen yet)",
                )
        elif (
            self._prev_holders is not None
            and self._prev_total is not None
            and self._prev_holders < current
            and len(current - self._prev_holders) == 1
            and vm_total >= self._prev_total
        ):
            (new,) = current - self._prev_holders
            self._sizes[new] = (
                vm_total - self._prev_total,
                False,
                "rise of the VM total when this process opened /dev/dxg",
            )
        budget = vm_total - (self.baseline or 0)
        if sum(v for v, _, _ in self._sizes.values()) > budget:
            self._sizes.clear()  # inferences exceed what the VM holds: none of them fits
        self._prev_total, self._prev_holders = vm_total, current
        out: dict[Key, Inference] = {}
        for k in current:
            if k in self._sizes:
                v, unique, how = self._sizes[k]
                # with other holders present, any share may have grown since: not unique
                out[k] = Inference(
                    Reading(v, Kind.INFERRED, SOURCE, detail=how), unique and len(current) == 1
                )
            else:
                out[k] = Inference(
                    Reading.missing(
                        Reason.UNAVAILABLE,
                        SOURCE,
                        "several processes hold GPU contexts; the VM total cannot be split",
                        Kind.INFERRED,
                    )
                )
        return out
