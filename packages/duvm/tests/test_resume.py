"""`duvm enable --resume` (duvm.node.lifecycle.resume): what it refuses, with which words, before it
touches anything; the successful path runs under QEMU (test_kernel_nbd_qemu.py), where the kernel
has nbd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from duvm.cli import main
from duvm.node.attach import attach_state
from duvm.node.lifecycle import control, resume

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="resume needs root")


def test_state_dir_is_added_once_and_a_users_choice_stands(tmp_path: Path) -> None:
    assert resume.with_state_dir(["-v"], tmp_path) == [
        "-v",
        "--state-dir",
        str(tmp_path.resolve() / "daemon-state"),
    ]
    assert resume.with_state_dir(["--state-dir=/x"], tmp_path) == ["--state-dir=/x"]


def _daemon_info(tmp_path: Path, pid: int, args: list[str]) -> control.DaemonInfo:
    return control.DaemonInfo(
        pid,
        str(tmp_path / "nbd.sock"),
        ["127.0.0.1:7070"],
        1 << 20,
        1,
        str(tmp_path / "daemon.log"),
        0.0,
        "h:/run/duvm",
        args,
    )


def test_resume_command_needs_a_daemon_that_kept_state(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="without --state-dir"):
        resume.resume_command(_daemon_info(tmp_path, 1, ["-v"]))
    cmd = resume.resume_command(_daemon_info(tmp_path, 1, ["--state-dir", "/s"]))
    assert cmd[4] == "--resume" and cmd[-2:] == ["--state-dir", "/s"] and "--client-id" in cmd


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@needs_root
def test_refusals_before_anything_is_started(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["enable", "--resume", "--state-dir", str(tmp_path)]) == 1
    assert "not enabled" in capsys.readouterr().err
    att = attach_state.Attachment(
        socket=str(tmp_path / "nbd.sock"), method=attach_state.METHOD_FUSE, device="/dev/loop7"
    )
    attach_state.save_state(control.state_path(tmp_path), att)
    with pytest.raises(control.ControlError, match="cannot take a restarted daemon"):
        resume.resume(tmp_path)
    att.method, att.nbd_netlink, att.nbd_device = attach_state.METHOD_KERNEL, True, "/dev/nbd0"
    attach_state.save_state(control.state_path(tmp_path), att)
    with pytest.raises(control.ControlError, match="no daemon record"):
        resume.resume(tmp_path)
    # a daemon that still runs (a stand-in whose command line reads like one's)
    alive = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "duvm.cli", "daemon"]
    )
    try:
        info = _daemon_info(tmp_path, alive.pid, ["--state-dir", "/s"])
        control.daemon_path(tmp_path).write_text(json.dumps(asdict(info)))
        with pytest.raises(control.ControlError, match=f"pid {alive.pid}.* still runs"):
            resume.resume(tmp_path)
    finally:
        alive.kill()
        alive.wait()
    # a dead one that kept no state
    info = _daemon_info(tmp_path, _dead_pid(), ["-v"])
    control.daemon_path(tmp_path).write_text(json.dumps(asdict(info)))
    with pytest.raises(control.ControlError, match="without --state-dir"):
        resume.resume(tmp_path)
    assert not (tmp_path / "daemon.log").exists()  # nothing was started


@needs_root
def test_a_supervisors_resume_reads_no_record_and_starts_a_new_log(tmp_path: Path) -> None:
    """Catches a resume that rereads state.json/daemon.json, appends to the dead daemon's log
    or reads the new one back although the supervisor handed it the records: on a node under
    pressure those pages may be on the device whose server is dead, and touching them waits
    out the kernel's dead-connection timeout (seen in CI: the restarted daemon's state read
    failed with EIO; in the QEMU guest: the supervisor stuck reading a failed try's log)."""
    att = attach_state.Attachment(
        socket=str(tmp_path / "nbd.sock"),
        method=attach_state.METHOD_KERNEL,
        device="/dev/nbd7",
        nbd_device="/dev/nbd7",
        nbd_netlink=True,
    )
    old = _daemon_info(tmp_path, _dead_pid(), ["--state-dir", str(tmp_path / "ds")])
    (tmp_path / "daemon.log").write_text("the dead daemon's last words\n")
    # no state.json, no daemon.json: read, they would make resume say "not enabled"
    with pytest.raises(control.ControlError) as failed:
        resume.resume(tmp_path, timeout=30, known=(att, old))
    assert str(failed.value) == f"the resumed daemon exited: see {tmp_path / 'daemon.log'}"
    assert (tmp_path / "daemon.log.1").read_text() == "the dead daemon's last words\n"
    new_log = (tmp_path / "daemon.log").read_text()
    assert new_log.startswith("--- duvm enable --resume at ")
    assert "last words" not in new_log and "duvm daemon:" in new_log  # the new daemon's own
    # the record of the daemon it started is written (fresh pages, no swap-in needed)
    assert control.load_daemon(tmp_path).pid != old.pid
