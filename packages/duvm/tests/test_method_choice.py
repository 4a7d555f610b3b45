"""Which block-device path `duvm enable` takes (duvm.node.attach.attach.resolve_method): `auto`
takes kernel nbd and nothing else; the nbdfuse + loop fallback, which can hang a node short of
memory as a whole, only when asked for by name. Enable, doctor and the demo say the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from duvm.cli import demo
from duvm.node.attach import attach, attach_fuse, attach_kernel, attach_state
from duvm.node.doctor import doctor_host
from duvm.node.doctor.doctor_check import FAIL, OK
from duvm.node.lifecycle import control

DUVM = [sys.executable, "-m", "duvm.cli"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="enable needs root")


def _says_both_ways(text: str) -> None:
    assert "no nbd driver" in text and "method auto does not take" in text
    assert "--method nbdfuse-loop" in text and "modprobe nbd" in text
    assert attach_fuse.MEASURED_RISK in text  # the measured reason, not a vague one


def test_auto_never_resolves_to_the_fallback() -> None:
    """Catches `auto` falling back to nbdfuse + loop on a kernel without nbd: that path hung
    QEMU guests under whole-node memory pressure, and a node duvm hangs is the one outcome it
    must never cause; taking it must be the user's explicit choice. Asked of a kernel without
    nbd (`kernel_nbd=False`), and of this one's own answer where it has none."""
    said = [False] if attach_kernel.available() else [False, None]
    for kernel_nbd in said:
        with pytest.raises(attach_state.AttachError) as err:
            attach.resolve_method("auto", kernel_nbd=kernel_nbd)
        _says_both_ways(str(err.value))
        if not attach_fuse.problems():  # the opt-in: by name it is taken
            fuse = attach.resolve_method(attach_state.METHOD_FUSE, kernel_nbd=kernel_nbd)
            assert fuse == attach_state.METHOD_FUSE
        with pytest.raises(attach_state.AttachError, match="no nbd driver"):
            attach.resolve_method(attach_state.METHOD_KERNEL, kernel_nbd=kernel_nbd)
        with pytest.raises(attach_state.AttachError, match="unknown attach method"):
            attach.resolve_method("floppy", kernel_nbd=kernel_nbd)
    for method in ("auto", attach_state.METHOD_KERNEL):  # with nbd, auto takes it
        assert attach.resolve_method(method, kernel_nbd=True) == attach_state.METHOD_KERNEL


@needs_root
def test_enable_refuses_before_starting_anything(tmp_path: Path) -> None:
    """Catches the refusal coming after the daemon started (or not at all): enable must stop
    before any process, state file or mount exists, and with the same answer attach gives."""
    state = tmp_path / "state"
    cfg = control.Config(peers=["127.0.0.1:1"], size=16 << 20, state_dir=state)
    calls: list[tuple[str, list[Path]]] = []

    def without_nbd(method: str) -> str:  # attach's answer on a kernel without nbd
        calls.append((method, sorted(state.iterdir()) if state.exists() else []))
        return attach.resolve_method(method, kernel_nbd=False)

    with pytest.raises(attach_state.AttachError) as err:
        control.enable(cfg, resolve_method=without_nbd)
    _says_both_ways(str(err.value))
    assert calls == [("auto", [])]  # resolved once, before anything was written
    assert not state.exists() or not any(state.iterdir())


@needs_root
def test_enable_cli_says_why_in_one_line(tmp_path: Path) -> None:
    if attach_kernel.available():
        pytest.skip("this kernel has nbd: auto takes it (the refusal is tested in-process)")
    state = tmp_path / "state"
    res = subprocess.run(
        [*DUVM, "enable", "--peers", "127.0.0.1:1", "--size", "16M", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("duvm enable: ") and res.stderr.count("\n") == 1, res.stderr
    _says_both_ways(res.stderr)
    assert not state.exists() or not any(state.iterdir())


def test_doctor_fails_auto_without_kernel_nbd_and_warns_on_the_opt_in() -> None:
    nbd = (False, doctor_host.kernel_nbd(doctor_host.Probe())[1])
    fuse = (True, doctor_host.fuse_loop(doctor_host.Probe())[1])
    auto = doctor_host.check_block_device("auto", nbd, fuse)
    assert (auto.status, auto.required) == (FAIL, True)
    _says_both_ways(f"{auto.detail}; fix: {auto.fix}")
    assert "--method nbdfuse-loop" not in auto.detail  # the advice once, in the fix
    chosen = doctor_host.check_block_device(attach_state.METHOD_FUSE, nbd, fuse)
    assert chosen.status == OK and attach_fuse.MEASURED_RISK in chosen.detail
    with_nbd = doctor_host.check_block_device("auto", (True, nbd[1]), fuse)
    assert with_nbd.status == OK and with_nbd.detail == "method auto: kernel nbd"


def test_doctor_cli_shows_the_refusal() -> None:
    if attach_kernel.available():
        pytest.skip("this kernel has nbd: auto takes it")
    res = subprocess.run(
        [*DUVM, "doctor", "--json", "--peers", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    block = checks["block-device"]
    assert res.returncode == 1 and block["status"] == "fail"
    _says_both_ways(f"{block['detail']}; fix: {block['fix']}")


def test_the_demo_names_its_method() -> None:
    """The demo's workload runs in a memory cgroup, so it passes the fallback by name where
    the kernel has no nbd (this one's own answer: a kernel without nbd cannot be had where it
    has one)."""
    auto = attach_state.METHOD_KERNEL if attach_kernel.available() else attach_state.METHOD_FUSE
    assert demo.demo_method("auto") == auto
    assert demo.demo_method(attach_state.METHOD_KERNEL) == attach_state.METHOD_KERNEL
