"""A real verbs stack in the QEMU test guest: Soft-RoCE (rdma_rxe) on its virtio NIC, first with
rdma-core's own tools, then with duvm's RDMA transport between memory clients and memservers.

`tools/qemu_guest/rdma_check.py` boots the guest of test_kernel_nbd_qemu.py (Debian 12's kernel
under QEMU/TCG, the host's / read-only over 9p) with the RDMA modules loaded
(`build_initramfs.RDMA_MODULES`), runs `rdma link add rxe0 type rxe netdev eth0`, then
`ibv_rc_pingpong` (server and client on rxe0, with completion events and busy-polling) and
`rping` (rdma-cm) with this host's rdma-core userspace. About 20 s on this 2-core VM. The duvm
guest (`rdma_duvm_guest.py`) takes about 40 s.

Needs root, qemu-system-x86, busybox-static, the verbs userspace (ibverbs-providers,
ibverbs-utils, rdmacm-utils; iproute2's `rdma`) and the cached kernel or apt; anything missing
is a SKIP with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[3]
TOOLS = REPO / "tools" / "qemu_guest"
# the run takes about 20 s here (boot 3 s, the busy-polling pingpong 8 s of it); the deadline
# only catches a hang
DEADLINE_S = 240

# what ibv_rc_pingpong printed on both ends in the guest (rdma_check.py, 2026-12-04)
SERVER_OUT = (
    "  local address:  LID 0x0000, QPN 0x000011, PSN 0x5d21ae, GID ::ffff:10.0.2.15\n"
    "  remote address: LID 0x0000, QPN 0x000012, PSN 0xe225c3, GID ::ffff:10.0.2.15\n"
    "8192000 bytes in 0.39 seconds = 165.93 Mbit/sec\n"
    "1000 iters in 0.39 seconds = 394.96 usec/iter\n"
)
# a client whose queue pair could not reach the other end (rxe across two network namespaces)
FAILED_OUT = (
    "  local address:  LID 0x0000, QPN 0x000011, PSN 0x2bbe96, GID ::ffff:10.77.0.2\n"
    "  remote address: LID 0x0000, QPN 0x000011, PSN 0x52c472, GID ::ffff:10.77.0.1\n"
    "Failed status local QP operation error (2) for wr_id 2\nparse WC failed 2\n"
)

# perftest's result tables on rxe0 in the guest (rdma_check.py with perftest, 2026-12-04)
READ_LAT_OUT = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
    "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n"
    " 4096    1000          48.23          495.14       56.01    \t       65.36       \t25.07  "
    "\t\t202.72  \t\t495.14 \n"
    "---------------------------------------------------------------------------------------\n"
)
WRITE_BW_OUT = (
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
    " 4096       1000             77.10              70.49  \t\t   0.018046\n"
)


@functools.cache
def _load_check() -> ModuleType:
    sys.path.insert(0, str(TOOLS))  # rdma_check.py imports its siblings boot, build_initramfs
    spec = importlib.util.spec_from_file_location("duvm_qemu_rdma_check", TOOLS / "rdma_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(DEADLINE_S + 120)
def test_rxe_verbs_pingpong_and_rping_in_the_guest() -> None:
    check = _load_check()
    if why := check.problems():
        pytest.skip("cannot run the RDMA guest: " + "; ".join(why))
    try:
        run = check.run_check(timeout_s=DEADLINE_S)
    except check.boot.GuestUnavailable as exc:
        pytest.skip(f"cannot run the RDMA guest: {exc}")
    s = check.summary(run)
    why = f"{s}\n{run.events}\n{run.console_tail()}"
    assert not run.timed_out and run.guest_exit == 0, why
    assert s["link_add"]["rc"] == 0, why
    assert "rxe0" in (s["ibv_devices"] or "") and "state ACTIVE" in (s["rdma_link"] or ""), why
    assert {"uverbs0", "rdma_cm"} <= set(s["dev_infiniband"] or ()), why
    for name in check.PINGPONGS:  # both ends ran all iterations and moved every byte
        p = s[name]
        assert p["ok"], why
        assert p["server"]["iters"] == p["client"]["iters"] == 1000, why
        assert p["server"]["bytes"] == p["client"]["bytes"] == 1000 * 4096 * 2, why
    assert s["rping"]["ok"] and s["rping"]["ping_lines"] == 10, why
    assert s["ok"]


# --- the host-side pieces, without booting anything ----------------------------------------


def test_pingpong_figures_are_read_from_its_output() -> None:
    check = _load_check()
    assert check.pingpong_numbers(SERVER_OUT) == {
        "bytes": 8192000,
        "seconds": 0.39,
        "mbit_s": 165.93,
        "iters": 1000,
        "usec_per_iter": 394.96,
    }
    assert check.pingpong_numbers(FAILED_OUT) is None
    mangled = "1 bytes in 1.2.3 seconds = . Mbit/sec\n1 iters in 1 seconds = 2 usec/iter\n"
    assert check.pingpong_numbers(mangled) is None  # no float() of a malformed number
    assert check.pingpong_numbers("") is None


def test_perftest_figures_are_read_from_its_tables() -> None:
    check = _load_check()
    assert check.perftest_numbers(READ_LAT_OUT) == {
        "bytes": 4096,
        "iters": 1000,
        "t_min_usec": 48.23,
        "t_max_usec": 495.14,
        "t_typical_usec": 56.01,
        "t_avg_usec": 65.36,
        "t_stdev_usec": 25.07,
        "p99_usec": 202.72,
        "p99_9_usec": 495.14,
    }
    assert check.perftest_numbers(WRITE_BW_OUT) == {
        "bytes": 4096,
        "iters": 1000,
        "bw_peak_mb_s": 77.1,
        "bw_avg_mb_s": 70.49,
        "msg_rate_mpps": 0.018046,
    }
    assert check.perftest_numbers(READ_LAT_OUT.splitlines()[0]) is None  # header, no row
    assert check.perftest_numbers(" #bytes #iterations t_avg[usec]\n 4096 oops\n") is None
    inf = " #bytes t_avg[usec]\n inf 1 2 3 4 5 6 7 8\n"  # float() reads it, int() cannot
    assert check.perftest_numbers(inf) is None
    assert check.perftest_numbers("") is None


@given(
    st.lists(
        st.one_of(
            st.text(),
            st.sampled_from(
                [*SERVER_OUT.splitlines(), *READ_LAT_OUT.splitlines(), *WRITE_BW_OUT.splitlines()]
            ),
            st.just(" #bytes #iterations t_avg[usec]"),
        )
    )
)
def test_the_output_readers_never_crash(lines: list[str]) -> None:
    check = _load_check()
    text = "\n".join(lines)
    for figures in (check.pingpong_numbers(text), check.perftest_numbers(text)):
        assert figures is None or all(isinstance(v, int | float) for v in figures.values())


def _pingpong(server: str, client: str, server_rc: Any = 0, client_rc: Any = 0) -> dict:
    return {
        "listening": True,
        "server": {"rc": server_rc, "out": server},
        "client": {"rc": client_rc, "out": client},
    }


def test_a_pingpong_passes_only_when_both_ends_did() -> None:
    ok = _load_check().pingpong_ok
    assert ok(_pingpong(SERVER_OUT, SERVER_OUT))
    assert not ok(_pingpong(SERVER_OUT, FAILED_OUT, client_rc=1))
    assert not ok(_pingpong(SERVER_OUT, SERVER_OUT, server_rc=None))  # killed: still running
    assert not ok(_pingpong(SERVER_OUT, SERVER_OUT, client_rc=1))
    assert not ok({**_pingpong(SERVER_OUT, SERVER_OUT), "listening": False})
    assert not ok({**_pingpong(SERVER_OUT, SERVER_OUT), "client": None})  # never started
    assert not ok(None) and not ok({})


def _fake_kernel(folder: Path, names: tuple[str, ...]) -> None:
    (folder / "modules").mkdir(parents=True)
    (folder / "vmlinuz-6.1.0-57-amd64").write_bytes(b"kernel")
    for m in names:
        (folder / "modules" / f"{m}.ko").write_bytes(m.encode())


def test_rdma_modules_only_when_asked(tmp_path: Path) -> None:
    """The other guests' kernel and initramfs stay as they were; the RDMA guest's loads the
    Soft-RoCE modules after them, in their dependency order."""
    b = _load_check().build_initramfs
    _fake_kernel(tmp_path / "linux-image-6.1.0-57-amd64", b.MODULES)
    base = b.find_cached(tmp_path)
    assert base is not None and list(base.modules) == list(b.MODULES)
    assert b.find_cached(tmp_path, b.RDMA_MODULES) is None  # ensure_kernel adds them first
    for m in b.RDMA_MODULES:
        (tmp_path / "linux-image-6.1.0-57-amd64" / "modules" / f"{m}.ko").write_bytes(b"x")
    rdma = b.find_cached(tmp_path, b.RDMA_MODULES)
    assert rdma is not None and list(rdma.modules) == [*b.MODULES, *b.RDMA_MODULES]
    again = b.find_cached(tmp_path)
    assert again is not None and list(again.modules) == list(b.MODULES)
    order = b.RDMA_MODULES
    for before, after in (  # `modinfo -F depends` of the 6.1.0-57 modules
        ("ib_core", "ib_uverbs"),
        ("udp_tunnel", "rdma_rxe"),
        ("ip6_udp_tunnel", "rdma_rxe"),
        ("ib_uverbs", "rdma_rxe"),
        ("crc32_generic", "rdma_rxe"),
        ("configfs", "rdma_cm"),
        ("iw_cm", "rdma_cm"),
        ("ib_cm", "rdma_cm"),
        ("rdma_cm", "rdma_ucm"),
    ):
        assert order.index(before) < order.index(after), (before, after)


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(DEADLINE_S + 120)
def test_duvm_pages_move_by_one_sided_rdma_and_forged_keys_are_refused() -> None:
    """duvm's RDMA transport over rxe0 in the guest (tools/qemu_guest/rdma_duvm_guest.py): two
    memservers with `--rdma on` and a cluster secret, memory clients with transport "rdma".
    Catches pages that do not round-trip, a memserver spending CPU per page (its STORE/LOAD
    counters must stay 0), a region a foreign rkey or an out-of-region address could reach
    (a leak of the other namespace's bytes, or anything but a broken link), a key still
    honoured after RELEASE, a made-up or an expired ticket accepted, a region that reaches
    the page just past the client's own, and `auto` not falling back to TCP.
    Seen failing with each of these planted: one protection domain shared by all clients (the
    foreign rkey read), each client's region over the whole arena (its own rkey reached the
    other's pages), regions kept after RELEASE, and an unknown ticket accepted."""
    check = _load_check()
    if why := check.problems():
        pytest.skip("cannot run the RDMA guest: " + "; ".join(why))
    _require_verbs_build()
    try:
        run = check.run_check(mem_mib=768, timeout_s=DEADLINE_S, script=check.DUVM_SCRIPT)
    except check.boot.GuestUnavailable as exc:
        pytest.skip(f"cannot boot the RDMA guest: {exc}")
    ev = run.events
    tail = run.console_tail()
    assert not run.timed_out, tail
    assert "crash" not in ev, ev["crash"]
    rt = ev["roundtrip"]
    assert (rt["transport"], rt["equal"], rt["tcp_reads_same"]) == ("rdma", True, True), rt
    assert (rt["cb_store"], rt["cb_load"]) == ("None", "None"), rt
    counters = rt["server_counters"]
    assert counters["store_requests"] == counters["load_requests"] == 0, counters
    assert (rt["server_rdma"]["device"], rt["server_rdma"]["sessions"]) == ("rxe0", 1), rt
    assert rt["chunks_mapped"] == [0, 1, 2], rt
    fg = ev["forged"]
    assert fg["distinct_rkeys"] and fg["a_intact"] and not fg["foreign_rkey_leaked"], fg
    for attempt in ("foreign_rkey", "own_rkey_foreign_address"):
        assert fg[attempt].startswith("MemserverUnreachable("), (attempt, fg)
    assert fg["b_reconnected"] and fg["b_reconnected_again"], fg
    assert ev["stale"]["stale_rkey"].startswith("MemserverUnreachable("), ev["stale"]
    assert ev["ticket"]["forged_ticket"].startswith("refused:"), ev["ticket"]
    assert "REJECTED" in ev["ticket"]["forged_ticket"], ev["ticket"]
    ex = ev["expired"]
    assert ex["ticket_issued"] and ex["tcp_still_connected"], ex
    assert ex["expired_ticket"].startswith("refused:"), ex
    pe = ev["past_end"]
    assert pe["transport"] == "rdma" and pe["neighbour_intact"], pe
    assert not pe["past_end_leaked"], pe
    for attempt in ("past_end_read", "past_end_write"):
        assert pe[attempt].startswith("MemserverUnreachable("), (attempt, pe)
    fb = ev["fallback"]
    assert (fb["transport"], fb["equal"]) == ("tcp", True), fb
    assert "does not serve RDMA" in fb["rdma_error"], fb
    cpu = ev["cpu"]
    assert (cpu["rdma_in_use"], cpu["tcp_in_use"]) == ("rdma", "tcp"), cpu
    logs = ev["memserver_logs"]["logs"]
    assert "unknown or used ticket" in logs["7071"], logs
    assert "expired ticket" in logs["7071"], logs
    doc = "\n".join(ev["doctor"]["rdma_lines"])
    assert re.search(r"OK +rdma +verbs device\(s\) with an active port: rxe0", doc), doc
    assert re.search(r"FAIL +rdma-peers", doc), doc
    assert "7070: rdma-cm answers on rxe0" in doc and "7072: no RDMA listener" in doc, doc


def _require_verbs_build() -> None:
    from duvm.rdma import verbs

    if verbs.state() != "compiled":
        if os.environ.get("DUVM_REQUIRE_COMPILED"):
            pytest.fail(f"DUVM_REQUIRE_COMPILED is set but the RDMA transport is {verbs.state()}")
        pytest.skip(f"the RDMA transport is {verbs.state()}: {verbs.BUILD_FIX}")


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(600 + 120)
def test_kernel_nbd_swap_over_rdma_survives_a_killed_daemon_and_a_killed_memserver() -> None:
    """The deployed configuration over rxe0 in the guest: `duvm enable --peers
    rdma://A,rdma://B --size 192M --secret-file F` (two copies, pages encrypted), kernel nbd,
    a 220 MiB workload in a 96 MiB memory cgroup of a 1 GiB guest, verified byte for byte, with
    the daemon SIGKILLed at a quarter of the fill (the standby its supervisor keeps, connected
    over RDMA with its own staging buffers, takes the live device over: the namespaces, their
    chunks and their pages outlive the dead daemon's queue pairs; the workload runs on, see
    guest_check's kill_and_resume) and the second memserver SIGKILLed at 60 %. The workload
    is in a cgroup, so the node keeps free memory; the ``:dkill`` set-ups of
    tools/qemu_guest/stress.py kill the daemon on a node out of memory as a whole. Catches
    pages lost or corrupted on the RDMA path (seen failing with writes planted one page off), a
    replica whose broken RDMA connection is not dropped like a broken TCP one (the workload
    would stall or fail), a daemon that cannot come back over RDMA, and a daemon that silently
    used TCP (the status names the transport)."""
    check = _load_check()
    if why := check.problems():
        pytest.skip("cannot run the RDMA guest: " + "; ".join(why))
    _require_verbs_build()
    try:
        run = check.run_swap(
            workload_mib=220,
            cgroup_mib=96,
            mem_mib=1024,
            kill_daemon_at=25,
            kill_memserver_at=60,
            timeout_s=600,
        )
    except check.boot.GuestUnavailable as exc:
        pytest.skip(f"cannot boot the RDMA guest: {exc}")
    ev = run.events
    res, work = ev.get("resumed") or {}, ev.get("workload") or {}
    tail = (
        f"{run.console_tail()}\nresumed after {res.get('seconds')} s; supervisor log:\n"
        f"{res.get('supervisor_log')}\nworkload rc {work.get('rc')}: {work.get('result')}"
    )
    assert not run.timed_out and "crash" not in ev, tail
    assert ev["rdma_link"]["rc"] == 0, ev["rdma_link"]
    assert ev["enable"]["rc"] == 0, ev["enable"]
    assert "2 copies of each page" in ev["enable"]["stdout"], ev["enable"]
    assert "memserver_killed" in ev, tail
    assert res["new_pid"] is not None and res["new_pid"] != ev["killed"]["pid"], res
    assert f"standby pid {res['new_pid']} took over /dev/nbd0" in res["supervisor_log"], tail
    peers = ev["filled"]["status"]["replication"]["peers"]  # the resumed daemon's
    assert peers[0]["transport_in_use"] == "rdma" and peers[0]["rdma_device"] == "rxe0", peers
    assert peers[1]["connected"] is False, peers  # the killed one, dropped
    assert work["rc"] == 0 and work["result"]["intact"], work
    assert work["result"]["bad_chunks"] == 0, work
    assert work["vmstat"]["pswpout"] > 10_000, work  # it really swapped (pages of 4 KiB)
    assert "pages encrypted" in work["logs"]["daemon.log"], work["logs"]
    assert ev["disable"]["rc"] == 0, ev["disable"]
    assert ev["detached"]["proc_swaps"].count("\n") == 1, ev["detached"]


# A stand-in for QEMU (this test must run without it): boots, starts the workload, moves a few
# pages, then prints the monitor line unchanged, as a guest stalled in reclaim does.
_STALLED_GUEST = """
import sys, time
with open(sys.argv[1], "a") as c:
    c.write("duvm-guest: enable at 1 s\\nduvm-guest: workload fill 0% at 2 s\\n")
    for out in (5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9):
        c.write(f"duvm-guest: monitor 1s out {out} in 0 free 1k\\n")
        c.flush()
        time.sleep(0.5)
time.sleep(60)
"""


def test_a_stalled_rdma_guest_is_ended_with_its_stacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches `run_check` not consulting the stall watchdog (a hung RDMA guest waits out its
    whole timeout, 25 minutes for the 1 GiB set-up, and ends with no stacks) or not pressing
    SysRq w, m, l and t before it stops QEMU. QEMU, the kernel and the initramfs are stand-ins
    here (the real path is the slow RDMA tests and stress.py); the loop, the watchdog and the
    process handling are the tool's own."""
    check = _load_check()
    boot = check.boot
    guest = tmp_path / "guest.py"
    guest.write_text(_STALLED_GUEST)
    pressed: list[tuple[Path, str]] = []
    monkeypatch.setattr(check, "problems", lambda: [])
    monkeypatch.setattr(check.build_initramfs, "ensure_kernel", lambda *a, **k: object())
    monkeypatch.setattr(
        check.build_initramfs, "build_initramfs", lambda kernel, env, out: out.write_bytes(b"")
    )
    monkeypatch.setattr(
        boot,
        "qemu_command",
        lambda kernel, initrd, mem, console, results, monitor=None: [
            sys.executable,
            str(guest),
            str(console),
        ],
    )
    monkeypatch.setattr(boot, "sysrq", lambda monitor, keys: pressed.append((monitor, keys)))
    monkeypatch.setattr(boot, "HUNG_SYSRQ_FLUSH_S", 0.1)
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    run = check.run_check(timeout_s=50, stall_s=3, workdir=work)
    took = time.monotonic() - t0
    assert run.hung and not run.timed_out, run
    assert pressed == [(work / "monitor.sock", boot.HUNG_SYSRQ)] and "w" in boot.HUNG_SYSRQ
    assert took < 20, f"ended after {took:.1f} s, not when the stall was seen"
    assert "monitor 1s out 9" in run.console  # what the guest printed is the run's console
