"""`duvm doctor` on this machine, passing and failing, with real parts.

Passing: root, the nbdfuse+loop fallback (this kernel has no nbd), the swap tools, a real
memserver on loopback as the peer, a 0600 root-owned secret file: exit 0. Failing: a peer port
nobody listens on, a listener that is not a memserver, a world-readable or non-root secret,
tool directories without nbdfuse (doctor finds tools where `duvm enable` does, in fixed sbin/bin
directories, never via $PATH, so the gap is planted as a tool directory), /dev without
fuse/loop, a config that does not parse, and a real drop to `nobody` in a subprocess.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from duvm.node.attach import attach_fuse, attach_kernel, attach_state, kernel_swap, systools
from duvm.node.doctor import doctor, doctor_check, doctor_cluster, doctor_host

NOBODY = 65534
PY = sys.executable


def duvm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "duvm.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def by_name(checks: list[doctor_check.Check] | list[dict]) -> dict:
    return {(c["name"] if isinstance(c, dict) else c.name): c for c in checks}


def fuse_path_here() -> bool:
    return not attach_fuse.problems()


@pytest.fixture
def start_memserver():
    """Start real memservers on loopback (extra flags allowed); returns HOST:PORT."""
    procs: list[subprocess.Popen[str]] = []

    def start(*extra: str) -> str:
        p = subprocess.Popen(
            [
                PY,
                "-m",
                "duvm.cli",
                "memserver",
                "--listen",
                "127.0.0.1:0",
                "--capacity",
                "8M",
                "--no-mlock",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None else "")
        return line.split("listening on ")[1].split()[0]

    try:
        yield start
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def memserver(start_memserver) -> str:
    return start_memserver()


@pytest.fixture
def not_a_memserver():
    """A TCP listener that answers with HTTP, like a web server on the wrong port."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        srv.close()
        t.join(5)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A cluster secret file as operators make one (`duvm secret generate`)."""
    f = tmp_path / "cluster.key"
    res = duvm("secret", "generate", str(f))
    assert res.returncode == 0, res.stderr
    return f


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (doctor's root check, chown of the secret file)"
)


# --- the passing form ---------------------------------------------------------------------------


@needs_root
def test_doctor_passes_on_this_machine_with_a_live_memserver(
    start_memserver, secret: Path, tmp_path: Path
) -> None:
    if not fuse_path_here() and not attach_kernel.available():
        pytest.skip("neither kernel nbd nor nbdfuse+loop on this machine")
    memserver = start_memserver("--secret-file", str(secret))
    method = attach_state.METHOD_KERNEL if attach_kernel.available() else attach_state.METHOD_FUSE
    cfg = tmp_path / "duvm.toml"
    cfg.write_text(
        f'peers = ["{memserver}"]\nsize = "16M"\nmethod = "{method}"\n'
        f'daemon_args = ["--secret-file", "{secret}"]\n'
    )
    res = duvm("doctor", "--config", str(cfg), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True
    checks = by_name(doc["checks"])
    for name in (
        "config",
        "root",
        "block-device",
        "swap-tools",
        "peers",
        "secret-file",
        "peer-auth",
    ):
        assert checks[name]["status"] == "ok", checks[name]
    # the peer answered the page protocol: its capacity is the 8 MiB it was started with
    assert f"{memserver} (capacity 8 MiB" in checks["peers"]["detail"]
    assert "mode 0600" in checks["secret-file"]["detail"]
    # nothing required failed; every non-ok check still says what to do
    for c in doc["checks"]:
        assert c["status"] in ("ok", "warn", "skip")
        assert c["status"] != "warn" or c["fix"]


def test_text_output_lists_every_check_with_fixes(dead_port: int) -> None:
    res = duvm("doctor", "--peers", f"127.0.0.1:{dead_port}", "--timeout", "2")
    assert res.returncode == 1
    first, *rest = res.stdout.splitlines()
    assert first.startswith("duvm doctor: NOT ready")
    assert any(line.split()[:2] == ["FAIL", "peers"] for line in rest)
    assert any("fix: on each failing peer run `duvm memserver" in line for line in rest)
    assert "Traceback" not in res.stderr


# --- failing forms ------------------------------------------------------------------------------


def test_peer_not_listening_fails_with_the_reason(dead_port: int) -> None:
    c = doctor_cluster.check_peers([f"127.0.0.1:{dead_port}"], timeout=2)
    assert (c.status, c.required) == (doctor_check.FAIL, True)
    assert f"127.0.0.1:{dead_port}: Connection refused" in c.detail
    assert "duvm memserver --listen" in (c.fix or "")


def test_memserver_that_wants_a_secret_we_lack_fails_and_says_so(
    start_memserver, secret: Path
) -> None:
    memserver = start_memserver("--secret-file", str(secret))
    c = doctor_cluster.check_peers([memserver], timeout=3)
    assert c.status == doctor_check.FAIL
    assert "authentication required" in c.detail
    assert (c.fix or "").startswith("the peers require authentication: duvm secret generate")


def test_memserver_without_secret_is_refused_when_we_have_one(memserver: str, secret: Path) -> None:
    opts = doctor_check.Options(peers=[memserver], secret_file=secret)
    security, auth_check = doctor_cluster.check_peer_auth(opts)
    assert auth_check.status == doctor_check.OK and security is not None
    c = doctor_cluster.check_peers([memserver], timeout=3, security=security)
    # the daemon would refuse it too: a memserver that cannot prove the secret
    assert c.status == doctor_check.FAIL and "has no cluster secret" in c.detail
    # it is running: the fix is its secret, not starting it
    assert f"the memserver at {memserver} runs without the cluster secret" in (c.fix or "")
    assert "--secret-file" in (c.fix or "") and "duvm memserver --listen" not in (c.fix or "")


def test_off_loopback_peers_need_a_secret_like_the_daemon_says() -> None:
    security, c = doctor_cluster.check_peer_auth(doctor_check.Options(peers=["10.0.0.2:7070"]))
    assert security is None and (c.status, c.required) == (doctor_check.FAIL, True)
    assert "--secret-file or --tls-ca" in c.detail and "duvm secret generate" in (c.fix or "")
    opts = doctor_check.Options(peers=["10.0.0.2:7070"], daemon_args=["--insecure"])
    _, c = doctor_cluster.check_peer_auth(opts)
    assert c.status == doctor_check.WARN and "unauthenticated" in c.detail


def test_listener_that_is_not_a_memserver_fails(not_a_memserver: str) -> None:
    c = doctor_cluster.check_peers([not_a_memserver], timeout=2)
    assert c.status == doctor_check.FAIL
    assert "port open but no duvm memserver STATUS" in c.detail


def test_one_dead_peer_among_good_ones_fails_and_names_it(memserver: str, dead_port: int) -> None:
    c = doctor_cluster.check_peers([memserver, f"127.0.0.1:{dead_port}", "bad:port:x"], timeout=2)
    assert c.status == doctor_check.FAIL
    assert f"127.0.0.1:{dead_port}: Connection refused" in c.detail
    assert "bad:port:x:" in c.detail  # an unparseable address is a problem, not a crash
    assert f"ok: {memserver}" in c.detail


@needs_root
def test_world_readable_secret_fails(secret: Path) -> None:
    secret.chmod(0o644)
    c = doctor_cluster.check_secret(secret)
    assert c.status == doctor_check.FAIL
    assert "mode 0644 lets others read or write it" in c.detail
    assert c.fix == f"chown root:root {secret} && chmod 0600 {secret}"
    secret.chmod(0o400)
    assert doctor_cluster.check_secret(secret).status == doctor_check.OK


@needs_root
def test_secret_not_owned_by_root_fails(secret: Path) -> None:
    os.chown(secret, NOBODY, NOBODY)
    c = doctor_cluster.check_secret(secret)
    assert c.status == doctor_check.FAIL and f"owned by uid {NOBODY}, not root" in c.detail


def test_missing_empty_garbled_and_symlinked_secrets_fail(tmp_path: Path, secret: Path) -> None:
    missing = doctor_cluster.check_secret(tmp_path / "nope.key")
    assert missing.status == doctor_check.FAIL and "No such file" in missing.detail
    assert (
        missing.fix == f"duvm secret generate {tmp_path / 'nope.key'} (on one node; copy it "
        "to the others)"
    )
    empty = tmp_path / "empty.key"
    empty.touch(mode=0o600)
    assert "holds no secret" in doctor_cluster.check_secret(empty).detail
    garbled = tmp_path / "garbled.key"
    garbled.write_text("not hex at all\n")
    garbled.chmod(0o600)
    c = doctor_cluster.check_secret(garbled)
    assert c.status == doctor_check.FAIL and "line 1: not hexadecimal" in c.detail
    link = tmp_path / "link.key"
    link.symlink_to(secret)
    assert "a symlink" in doctor_cluster.check_secret(link).detail


def test_secret_file_from_daemon_args_is_checked(
    tmp_path: Path, secret: Path, dead_port: int
) -> None:
    secret.chmod(0o640)
    cfg = tmp_path / "duvm.toml"
    cfg.write_text(
        f'peers = ["127.0.0.1:{dead_port}"]\nsize = "16M"\n'
        f'daemon_args = ["--secret-file", "{secret}"]\n'
    )
    res = duvm("doctor", "--config", str(cfg), "--json", "--timeout", "2")
    checks = by_name(json.loads(res.stdout)["checks"])
    assert res.returncode == 1
    assert checks["config"]["status"] == "ok"
    assert checks["secret-file"]["status"] == "fail"
    assert "mode 0640" in checks["secret-file"]["detail"]
    # the daemon would refuse that file too, and doctor says so by the daemon's own rule
    assert checks["peer-auth"]["status"] == "fail" and "chmod 600" in checks["peer-auth"]["detail"]
    assert checks["peers"]["status"] == "fail"  # the peers were still read from the file


def test_config_enable_refuses_still_has_peers_and_secret_checked(
    tmp_path: Path, dead_port: int
) -> None:
    cfg = tmp_path / "duvm.toml"
    cfg.write_text(
        f'peers = ["127.0.0.1:{dead_port}"]\nsize = "16M"\nbogus = 1\n'
        f'daemon_args = ["--secret-file", "{tmp_path / "none.key"}"]\n'
    )
    res = duvm("doctor", "--config", str(cfg), "--json", "--timeout", "2")
    checks = by_name(json.loads(res.stdout)["checks"])
    assert checks["config"]["status"] == "fail" and "bogus" in checks["config"]["detail"]
    assert checks["secret-file"]["status"] == "fail"
    assert "duvm secret generate" in checks["secret-file"]["fix"]
    assert f"127.0.0.1:{dead_port}: Connection refused" in checks["peers"]["detail"]


def test_unreadable_config_fails_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("peers = [\n")
    res = duvm("doctor", "--config", str(bad), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    c = by_name(json.loads(res.stdout)["checks"])["config"]
    assert c["status"] == "fail" and "not valid TOML" in c["detail"]
    bad.write_bytes(b'peers = ["\xff\xfe"]\n')  # not UTF-8
    res = duvm("doctor", "--config", str(bad), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    c = by_name(json.loads(res.stdout)["checks"])["config"]
    assert c["status"] == "fail" and "cannot be read as text" in c["detail"]


def tool_dir_without(tmp_path: Path, *absent: str) -> Path:
    """A tool directory holding links to the real tools, minus `absent`."""
    d = tmp_path / "sbin"
    d.mkdir()
    wanted = {*doctor_host.SWAP_TOOLS, *doctor_host.FUSE_TOOLS, "modprobe"} - set(absent)
    for name in wanted:
        real = systools.find_tool(name)
        if real:
            (d / name).symlink_to(real)
    return d


def test_tools_without_nbdfuse_fail_the_fallback_and_name_the_package(tmp_path: Path) -> None:
    if systools.find_tool("nbdfuse") is None:
        pytest.skip("nbdfuse not installed here, nothing to take away")
    probe = doctor_host.Probe(tool_dirs=(str(tool_dir_without(tmp_path, "nbdfuse")),))
    usable, c = doctor_host.fuse_loop(probe)
    assert not usable and c.status == doctor_check.WARN
    assert c.detail == "missing: nbdfuse"
    assert c.fix == f"apt-get install {systools.TOOL_PACKAGES['nbdfuse']}"
    nbd = doctor_host.kernel_nbd(probe)
    block = doctor_host.check_block_device("nbdfuse-loop", nbd, (usable, c))
    assert (block.status, block.required) == (doctor_check.FAIL, True)
    assert systools.TOOL_PACKAGES["nbdfuse"] in (block.fix or "")
    if not nbd[0]:  # this VM: no kernel nbd either, so auto has no way left
        auto = doctor_host.check_block_device("auto", nbd, (usable, c))
        assert auto.status == doctor_check.FAIL
    bogus = doctor_host.check_block_device("ublk", nbd, (usable, c))
    assert bogus.status == doctor_check.FAIL and "unknown method 'ublk'" in bogus.detail
    checks = by_name(doctor.run_checks(doctor_check.Options(method="nbdfuse-loop"), probe))
    assert checks["block-device"].status == doctor_check.FAIL
    assert not doctor.passed(list(checks.values()))


def test_missing_swap_tools_fail(tmp_path: Path) -> None:
    probe = doctor_host.Probe(tool_dirs=(str(tool_dir_without(tmp_path, "mkswap", "swapon")),))
    c = doctor_host.check_swap_tools(probe)
    assert c.status == doctor_check.FAIL and c.detail == "missing: mkswap, swapon"
    assert c.fix == "apt-get install util-linux"


def test_dev_without_fuse_and_loop(tmp_path: Path) -> None:
    probe = doctor_host.Probe(dev=tmp_path)
    usable, c = doctor_host.fuse_loop(probe)
    assert not usable
    assert "/dev/fuse" in c.detail and "/dev/loop-control" in c.detail
    assert "modprobe fuse" in (c.fix or "") and "modprobe loop" in (c.fix or "")


def test_kernel_nbd_seen_from_dev_nodes(tmp_path: Path) -> None:
    (tmp_path / "nbd0").touch()
    (tmp_path / "nbd1").touch()
    usable, c = doctor_host.kernel_nbd(doctor_host.Probe(dev=tmp_path, sys_module=tmp_path))
    assert usable and c.detail == "nbd loaded, 2 device(s) /dev/nbd*"


def test_no_cgroup_and_low_min_free_are_warnings_not_failures(tmp_path: Path) -> None:
    sysctl = tmp_path / "min_free_kbytes"
    sysctl.write_text("1024\n")
    probe = doctor_host.Probe(cgroup_root=tmp_path, min_free=sysctl)
    cg, mf = doctor_host.check_cgroup(probe), doctor_host.check_min_free(probe)
    assert (cg.status, cg.required) == (doctor_check.WARN, False)
    assert (mf.status, mf.required) == (doctor_check.WARN, False)
    want = kernel_swap.safe_min_free_kbytes(kernel_swap.mem_total_kb())
    assert f"vm.min_free_kbytes = 1024 (swap over the network wants >= {want})" == mf.detail
    assert f"vm.min_free_kbytes = {want}" in (mf.fix or "")
    sysctl.write_text(f"{want}\n")
    assert doctor_host.check_min_free(probe).status == doctor_check.OK
    sysctl.write_text("garbage\n")
    assert doctor_host.check_min_free(probe).status == doctor_check.WARN  # unreadable, not a crash
    assert doctor.passed([cg, mf])


def test_uvloop_absent_is_a_warning() -> None:
    # sys.modules[name] = None makes `import name` raise ImportError: uvloop as if uninstalled
    code = (
        "import sys; sys.modules['uvloop'] = None\n"
        "from duvm.node.doctor import doctor_host\n"
        "c = doctor_host.check_uvloop(); print(c.status, c.required, c.fix)"
    )
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("warn False reinstall duvm")


@needs_root
def test_not_root_fails_after_a_real_drop_to_nobody(tmp_path: Path) -> None:
    # The interpreter and every module are loaded as root (nobody may not read root's home,
    # where this venv's Python lives; building the parser imports the subcommands and what
    # argparse loads lazily), then the process really drops to nobody and runs the doctor.
    code = (
        "import os, shutil, sys, uvloop\n"
        "from duvm import cli\nfrom duvm.node.doctor import doctor\n"
        "from duvm.store import memclient\n"
        "cli.build_parser().format_help()\n"
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "sys.exit(cli.main(['doctor', '--json']))\n"
    )
    res = subprocess.run(
        [PY, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    root = by_name(doc["checks"])["root"]
    assert root == {
        "name": "root",
        "status": "fail",
        "required": True,
        "detail": f"running as uid {NOBODY}, not root",
        "fix": "enable/disable attach devices and call swapon: run as root (sudo duvm ...)",
    }
    assert doc["ok"] is False


def test_bad_timeout_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from duvm import cli

    for bad in ("0", "-1", "nan", "inf"):
        assert cli.main(["doctor", "--timeout", bad]) == 2
        out, err = capsys.readouterr()
        assert "--timeout must be positive" in err and out == ""


def test_doctor_finds_tools_where_enable_does_not_on_path(tmp_path: Path) -> None:
    """A PATH without nbdfuse changes nothing: enable calls tools by absolute path from the
    sbin/bin directories, so doctor must judge those, not $PATH (which differs under sudo,
    cron and systemd)."""
    if not fuse_path_here():
        pytest.skip("the nbdfuse+loop path is not complete on this machine")
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    env["PATH"] = str(tmp_path)  # empty: no nbdfuse, no losetup, nothing
    res = subprocess.run(
        [PY, "-m", "duvm.cli", "doctor", "--json", "--method", "nbdfuse-loop"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    checks = by_name(json.loads(res.stdout)["checks"])
    assert checks["fuse-loop"]["status"] == "ok"
    assert checks["block-device"]["status"] == "ok"
    assert checks["swap-tools"]["status"] == "ok"


def test_rt_throttling_off_is_a_warning_and_the_kernel_default_is_ok(tmp_path: Path) -> None:
    runtime, period = tmp_path / "sched_rt_runtime_us", tmp_path / "sched_rt_period_us"
    period.write_text("1000000\n")
    runtime.write_text("950000\n")
    probe = doctor_host.Probe(rt_runtime=runtime, rt_period=period)
    c = doctor_host.check_rt_throttle(probe)
    assert c.status == doctor_check.OK and "at most 95 % of each CPU" in c.detail
    runtime.write_text("-1\n")
    c = doctor_host.check_rt_throttle(probe)
    assert (c.status, c.required) == (doctor_check.WARN, False)
    assert "sched_rt_runtime_us=950000" in (c.fix or "")
    runtime.unlink()  # unreadable: a skip, not a crash
    assert doctor_host.check_rt_throttle(probe).status == doctor_check.SKIP


@needs_root
def test_swap_path_protection_reports_what_the_daemon_would_be_refused() -> None:
    """Catches a doctor that says ready while the daemon would run without its memory-pressure
    protections (the node can then hang on its own swap device)."""
    probe = subprocess.run(
        [
            PY,
            "-c",
            "import json; from duvm.base import pressure; print(json.dumps(pressure.probe()))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    refused = {k for k, v in json.loads(probe.stdout).items() if v}
    c = doctor_host.check_swap_path([])
    assert c.required is False
    if not refused:
        assert c.status == doctor_check.OK and "run realtime (SCHED_RR)" in c.detail
    else:  # a sandbox may refuse even root some of them: each is named, with a fix
        assert c.status == doctor_check.WARN and c.fix
        for name, word in (
            ("io-flusher", "PR_SET_IO_FLUSHER"),
            ("oom-score", "oom_score_adj"),
            ("realtime", "SCHED_RR"),
            ("mlock", "mlockall"),
        ):
            assert (word in c.detail) == (name in refused), (name, c.detail)
    off = doctor_host.check_swap_path(["--verbose", "--no-realtime", "--no-mlock"])
    assert off.status == doctor_check.WARN and "turned off by --no-realtime" in off.detail
    assert "remove --no-realtime from daemon_args" in (off.fix or "")
    assert "remove --no-mlock from daemon_args" in (off.fix or "")


def test_refused_protections_name_each_capability_once_and_how_to_grant_it() -> None:
    """Catches the advice a sandboxed root got: "run duvm enable as root (...); run duvm
    enable as root (...)", repeated per protection and telling root to be root."""
    refused = ["io-flusher", "oom-score", "realtime"]
    root = doctor_host.protection_fix(refused, as_root=True)
    assert "run duvm enable as root" not in root
    assert root.count("CAP_SYS_RESOURCE") == 2  # granted once: the list and AmbientCapabilities
    assert "AmbientCapabilities=CAP_SYS_RESOURCE CAP_SYS_NICE" in root
    assert "--cap-add SYS_RESOURCE --cap-add SYS_NICE" in root
    assert "PR_SET_IO_FLUSHER needs Linux 5.6" in root and "RestrictRealtime" in root
    user = doctor_host.protection_fix(refused, as_root=False)
    assert user.startswith("run duvm enable as root (CAP_SYS_RESOURCE, CAP_SYS_NICE)")
    assert user.count("run duvm enable as root") == 1 and "--cap-add" not in user


def test_the_fallback_path_needs_cgroup_v2_to_keep_nbdfuse_out_of_swap(tmp_path):
    """Catches doctor staying quiet where nbdfuse would be swappable: where the fallback is
    chosen and only cgroup v1 exists, it can hang under whole-machine pressure."""
    ok, bad = (True, None), (False, None)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("1\n")
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory\n")

    def check(method, fuse, root):
        c = doctor_host.check_nbdfuse_unswappable(method, fuse, doctor_host.Probe(cgroup_root=root))
        return c.status

    assert check("nbdfuse-loop", ok, v1) == doctor_check.WARN
    assert check("nbdfuse-loop", ok, v2) == doctor_check.OK
    assert check("nbdfuse-loop", bad, v1) == doctor_check.SKIP  # the fallback cannot run
    assert check("auto", ok, v1) == doctor_check.SKIP  # auto never takes the fallback
