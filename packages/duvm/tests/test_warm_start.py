"""A restart without a standby forks the supervisor, whose interpreter has the daemon's code
loaded (duvm.node.lifecycle.warm_start), and the fork rewrites its command line to read as a
daemon's (duvm.base.proctitle).

The restart tests run the supervisor's loop in this process over a real daemon and real
memservers (test_standby.py's `Node`), so the daemon is forked from pytest's interpreter; the
kernel's part is `KernelStandIn`, as in test_standby.py. The same restart under the real
`duvm supervise` and the kernel's driver runs in the QEMU guests: the kernel-nbd CI guest ends
the standby, then the daemon (test_kernel_nbd_qemu.py, `guest_fork`), as every ``:dkill``
stress run does after its workload.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from duvm.base import proctitle
from duvm.base.procstat import stat_fields
from duvm.node.attach import processes
from duvm.node.lifecycle import control, resume, supervise, warm_start
from test_standby import PAGE, KernelStandIn, Node, _pattern, _wait_said, node  # noqa: F401

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the supervisor and resume run as root")


def _words(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


def test_words_that_do_not_fit_are_left_off_and_an_option_without_its_value_too() -> None:
    assert proctitle.fitting(["python", "-m", "x"], 16) == b"python\0-m\0x\0".ljust(16, b"\0")
    # "--peers" fits but its value does not: both are left off
    assert proctitle.fitting(["py", "--peers", "a" * 30], 16) == b"py\0".ljust(16, b"\0")
    with pytest.raises(ValueError):
        proctitle.fitting(["a" * 20], 16)


def test_a_flag_among_the_words_that_must_show_stays_when_the_next_option_does_not_fit() -> None:
    """Catches the rule above applied to `--resume`, a flag among the words that must show:
    in a supervisor started as `python .../pytest` (66 bytes here) it was left off, the fork
    could not read as a resumed daemon, and every restart fell back to a new interpreter."""
    words = ["/ci/.venv/bin/python", "-m", "duvm.cli", "daemon", "--resume", "--socket", "/s"]
    room = sum(len(w) + 1 for w in words[:5]) + 5  # "--socket" does not fit
    assert proctitle.fitting(words, room, keep=5).rstrip(b"\0").split(b"\0")[4] == b"--resume"


def test_a_rewritten_command_line_reads_as_a_daemon_within_the_area_the_kernel_gave() -> None:
    """Catches a rewrite that runs past the argument area (the kernel would then read one
    string into the environment, and `duvm_runs` would not find "daemon" among the words),
    and one that leaves the old words' tail showing."""
    code = (
        "import sys, time\n"
        "from duvm.base import proctitle\n"
        "words = [sys.executable, '-m', 'duvm.cli', 'daemon', '--socket', '/run/duvm/nbd.sock',"
        " '--peers', 'x' * 400]\n"
        "print(proctitle.set_command_line(words, 4), flush=True)\n"
        "time.sleep(30)\n"
    )
    argv = [sys.executable, "-c", code, "supervise", "--state-dir", "/run/duvm-test-area"]
    before = sum(len(a.encode()) + 1 for a in argv)  # the area exec laid out
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        shown = proc.stdout.readline()  # type: ignore[union-attr]
        raw = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        words = _words(proc.pid)
        want = [sys.executable, "-m", "duvm.cli", "daemon", "--socket", "/run/duvm/nbd.sock"]
        assert words == want
        assert shown.strip() == repr(words)
        assert len(raw) == before  # the same area, NUL-padded: nothing of the old words
        assert b"supervise" not in raw and b"state-dir" not in raw
        assert processes.duvm_runs(proc.pid, "daemon", processes.start_time(proc.pid))
        assert not processes.duvm_runs(proc.pid, "supervise")
        ps = subprocess.run(
            ["ps", "-o", "args=", "-p", str(proc.pid)], capture_output=True, text=True, check=True
        )
        assert ps.stdout.split() == words
    finally:
        proc.kill()
        proc.wait()


def _restart(stand: Node, start: resume.Starter, during=None) -> dict:
    """Kill the node's daemon under a watching supervisor (no standby) whose restarts start
    with `start`, with a request of the client held; return what was seen."""
    daemon = stand.start_daemon()
    kernel = KernelStandIn(stand.socket)
    for p in range(0, 128, 2):
        kernel.write(p * PAGE, _pattern(p, 1))
    log: list[str] = []
    seen: dict = {"log": log, "old": daemon}
    errors: list[BaseException] = []

    def events() -> None:
        try:
            _wait_said(log, f"watching daemon pid {daemon.pid}")
            seen["t_kill"] = time.monotonic()
            os.kill(daemon.pid, signal.SIGKILL)
            assert kernel.read(0, PAGE) == _pattern(0, 1)  # held across the death, then served
            seen["served_s"] = time.monotonic() - seen["t_kill"]
            for p in range(128):
                want = _pattern(p, 1) if p % 2 == 0 else bytes(PAGE)
                assert kernel.read(p * PAGE, PAGE) == want, f"page {p}"
            kernel.write(200 * PAGE, _pattern(200, 3))
            assert kernel.read(200 * PAGE, PAGE) == _pattern(200, 3)
            _wait_said(log, "resumed: daemon pid")
            new = control.load_daemon(stand.state_dir)
            assert new is not None
            seen["new"] = new
            seen["alive"] = control.daemon_alive(new)
            seen["words"] = _words(new.pid)
            seen["ppid"] = int(stat_fields(new.pid)[1])  # type: ignore[index]
            if during is not None:
                during(new, seen)
        except BaseException as exc:  # judged in the main thread
            errors.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # ends watch(): its _Stop notes it

    started: list[resume.Started] = []

    def starting(cmd: list[str], log: Path) -> resume.Started:
        proc = start(cmd, log)
        started.append(proc)  # every daemon of the test ends with it, even with a rule broken
        return proc

    t = threading.Thread(target=events, daemon=True)
    t.start()
    gave_up: list[str] = []
    try:
        rc = supervise.watch(
            stand.state_dir,
            say=log.append,
            spares=None,
            resume_fn=functools.partial(resume.resume, reattach=kernel.reattach),
            start=starting,
            give_up=lambda att, why: gave_up.append(why),
            reattach=kernel.reattach,
            make_room=lambda need_kib, say: contextlib.nullcontext(),  # never this machine's OOM
            link_events=lambda say: None,
        )
        t.join(30)
    finally:
        kernel.close()
        for proc in started:
            proc.kill()
            proc.wait(10)
    assert not errors, (errors, log)
    assert rc == 0 and gave_up == [] and kernel.reconnects == 1, log
    return seen


def test_a_daemon_killed_with_no_standby_is_forked_from_the_loaded_code_and_serves_again(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """The whole restart without a standby but the kernel: the daemon is SIGKILLed with a
    request of the client held, the supervisor forks a new daemon from its loaded code, which
    serves the held request and every page written before. Catches a restart that starts an
    interpreter after all (the new daemon is not this process's fork: its log has no fork
    line and its command line carries every argument), a fork whose command line still reads
    as its parent's (`duvm status` and the supervisor would not find the daemon), a fork that
    keeps a descriptor of its parent's open (here a socket pair whose other end must see its
    peer close, as a standby must see its supervisor's), and a preload that misses a module
    the daemon then reads from disk during the restart."""
    assert warm_start.preload() == []
    mine, theirs = socket.socketpair()

    def during(new: control.DaemonInfo, seen: dict) -> None:
        mine.close()  # the supervisor's end gone: only the fork could keep it open
        theirs.settimeout(5)
        seen["eof"] = theirs.recv(1) == b""

    try:
        seen = _restart(node, warm_start.fork_daemon, during)
    finally:
        theirs.close()
        with contextlib.suppress(OSError):
            mine.close()
    new, log = seen["new"], seen["log"]
    assert seen["ppid"] == os.getpid() and seen["alive"], log
    assert seen["words"][:5] == [sys.executable, "-m", "duvm.cli", "daemon", "--resume"]
    text = Path(new.log).read_text()
    assert f"a daemon forked from the supervisor (pid {os.getpid()})" in text, text
    assert "after the warm start" not in text, text  # every module was loaded already
    assert seen["eof"], "the forked daemon kept its parent's socket open"
    print(f"the held request served {1000 * seen['served_s']:.0f} ms after the SIGKILL")


def test_a_fork_that_cannot_read_as_a_daemon_is_followed_by_a_daemon_started_the_usual_way(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches a warm start that serves although its command line could not be rewritten
    (the supervisor would take it for dead and start another over it), and a supervisor that
    keeps forking on the retries instead of starting a daemon the usual way."""
    warm_start.preload()

    def cannot(words: list[str], keep: int) -> list[str]:
        raise OSError("no /proc/self/mem here")

    seen = _restart(node, functools.partial(warm_start.fork_daemon, rename=cannot))
    log = seen["log"]
    failed = [m for m in log if m.startswith("resume failed: the resumed daemon exited")]
    assert len(failed) == 1, log
    assert "resume failed" not in " ".join(log[log.index(failed[0]) + 1 :]), log
    new = seen["new"]
    assert seen["alive"] and "--resume" in seen["words"] and "--peers" in seen["words"]
    text = Path(new.log).read_text()
    assert "forked from the supervisor" not in text
    old = Path(new.log).with_name(Path(new.log).name + ".1").read_text()
    assert "cannot become a daemon here (no /proc/self/mem here)" in old, old


@pytest.mark.parametrize(
    ("peers", "verbs"), [(["127.0.0.1:1"], False), (["rdma://10.0.0.1:5"], True)]
)
def test_the_rdma_transport_is_loaded_only_for_a_daemon_that_may_use_it(
    peers: list[str], verbs: bool
) -> None:
    """Catches a supervisor that loads the verbs library beside a daemon that never uses
    RDMA, and one that leaves it for an RDMA daemon to read from disk during its restart."""
    code = (
        "import sys\n"
        "from duvm.node.lifecycle import warm_start\n"
        "print(warm_start.preload(sys.argv[1:]), 'duvm.rdma._verbs' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *peers], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["[]", str(verbs)], out.stderr


def test_a_fork_that_fails_unforeseen_ends_and_never_returns_into_the_supervisor(
    tmp_path: Path,
) -> None:
    """Catches a child whose unforeseen error propagates out of `fork_daemon`: it would go on
    as a second copy of the supervisor (here, of this test session) instead of ending."""
    assert warm_start.preload() == []

    def unforeseen(words: list[str], keep: int) -> list[str]:
        raise RuntimeError("something nobody planned for")

    log = tmp_path / "daemon.log"
    cmd = [sys.executable, "-m", "duvm.cli", "daemon", "--resume"]
    child = warm_start.fork_daemon(cmd, log, rename=unforeseen)
    try:
        assert child.wait(30) == 70
    finally:
        child.kill()
        child.wait(10)
    assert "RuntimeError: something nobody planned for" in log.read_text()
