"""Runs inside the QEMU test guest: a real verbs stack on Soft-RoCE (rdma_rxe). Reports facts,
judges nothing (``rdma_check.py`` on the host does).

Theory of operation
-------------------
``init.sh`` has loaded :data:`build_initramfs.RDMA_MODULES` after the usual ones, brought up
eth0 (virtio-net) and started this with the host's Python in ``chroot /host`` (the host's / over
9p): the host's rdma-core userspace (``ibv_*`` from ibverbs-utils, ``rping`` from
rdmacm-utils, the ``rxe`` provider from ibverbs-providers with its ``/etc/libibverbs.d`` entry)
and iproute2's ``rdma`` run here unchanged. ``/dev`` in the chroot is a devtmpfs, so
``/dev/infiniband/uverbs0`` and ``rdma_cm`` appear when the device does.

Steps: ``rdma link add rxe0 type rxe netdev eth0``; ``rdma link``, ``ibv_devices``,
``ibv_devinfo``; the GID table (the RoCE v2 GID of eth0's IPv4 address is chosen);
``ibv_rc_pingpong`` server and client both on rxe0 (the client reaches the server's TCP
exchange port on the guest's own address; the RC traffic is rxe0 to itself), once with
completion events (``-e``, the processes sleep) and once busy-polling; then ``rping`` (rdma-cm)
client against server (it moves its data with one-sided RDMA READ and WRITE). When this host has
perftest, ``ib_read_lat``, ``ib_read_bw`` and ``ib_write_bw`` (the one-sided operations a verbs
transport would use; only the client polls, the target side is rxe in the kernel) follow.
Each step's command, exit status, output and seconds go out as one JSON object per line,
prefixed ``DUVM-RESULT``, on /dev/ttyS1.

With ``DUVM_RDMA_VETH=1`` two experiments follow (reported, not judged): rxe on both ends of a
veth pair in two network namespaces (the set-up issue 31 proposes), and rxe on both ends of a
veth pair left in the initial namespace, each with an ``ibv_rc_pingpong`` between the ends.

Parameters (``duvm.env``): ``DUVM_RDMA_NETDEV`` (eth0), ``DUVM_GUEST_IP``, ``DUVM_RDMA_ITERS``
and ``DUVM_RDMA_SIZE`` (the pingpong's ``-n`` and ``-s``), ``DUVM_RDMA_VETH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT_PORT = "/dev/ttyS1"
DEVICE = "rxe0"
NETDEV = os.environ.get("DUVM_RDMA_NETDEV", "eth0")
IP = os.environ.get("DUVM_GUEST_IP", "10.0.2.15")
ITERS = os.environ.get("DUVM_RDMA_ITERS", "1000")
SIZE = os.environ.get("DUVM_RDMA_SIZE", "4096")
T0 = time.monotonic()


def emit(event: str, **data: Any) -> None:
    data = {"event": event, "t": round(time.monotonic() - T0, 2), "uptime": _uptime(), **data}
    with open(RESULT_PORT, "w") as port:
        port.write("DUVM-RESULT " + json.dumps(data) + "\n")
    print(f"duvm-guest: {event} at {data['uptime']} s", flush=True)


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def run(*cmd: str, timeout: float = 60) -> dict[str, Any]:
    t = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        rc, out = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"{exc.stdout or ''}{exc.stderr or ''} [timed out after {timeout} s]"
    except OSError as exc:
        rc, out = None, f"cannot run: {exc}"
    return {"cmd": " ".join(cmd), "rc": rc, "out": out[-4000:], "s": round(time.monotonic() - t, 2)}


def pair(
    server: list[str],
    client: list[str],
    ready: Callable[[], bool],
    timeout: float = 90,
    server_after: float = 30,
) -> dict[str, Any]:
    """Start `server`, wait until `ready()` says it listens, run `client`, give the server
    `server_after` seconds more to end; both results."""
    t = time.monotonic()
    srv = subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        listening = _wait(ready, srv, 30)
        cli = run(*client, timeout=timeout) if listening else None
        try:
            out, _ = srv.communicate(timeout=server_after if listening else 1)
            rc: int | None = srv.returncode
        except subprocess.TimeoutExpired:
            srv.kill()
            out, _ = srv.communicate()
            rc, out = None, out + " [killed: still running]"
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    return {
        "listening": listening,
        "server": {"cmd": " ".join(server), "rc": rc, "out": out[-4000:]},
        "client": cli,
        "s": round(time.monotonic() - t, 2),
    }


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return True
        time.sleep(0.1)
    return False


def tcp_listening(port: int, netns: str | None = None) -> Callable[[], bool]:
    """A TCP socket in LISTEN (state 0A) on `port` (/proc/net/tcp{,6}, as seen from `netns`):
    ibv_rc_pingpong's server exchanges queue pair addresses over TCP before any verbs traffic."""

    def ready() -> bool:
        tables = ("/proc/net/tcp", "/proc/net/tcp6")
        if netns is None:
            text = "".join(Path(t).read_text() for t in tables)
        else:  # /proc/net is the reader's own namespace's
            text = run("ip", "netns", "exec", netns, "cat", *tables, timeout=10)["out"]
        for line in text.splitlines():
            f = line.split()
            if len(f) > 3 and f[1].endswith(f":{port:04X}") and f[3] == "0A":
                return True
        return False

    return ready


def cm_listening(port: int) -> Callable[[], bool]:
    """An rdma-cm id in LISTEN on `port` (`rdma resource show cm_id`): rping's server."""

    def ready() -> bool:
        out = run("rdma", "resource", "show", "cm_id", timeout=10)["out"]
        return any("LISTEN" in line and f":{port}" in line for line in out.splitlines())

    return ready


def gids(device: str = DEVICE) -> list[dict[str, str]]:
    """The device's port 1's non-empty GIDs with their RoCE type."""
    base = Path(f"/sys/class/infiniband/{device}/ports/1")
    out = []
    for g in sorted((base / "gids").iterdir(), key=lambda p: int(p.name)) if base.exists() else []:
        try:
            value = g.read_text().strip()
            kind = (base / "gid_attrs" / "types" / g.name).read_text().strip()
        except OSError:  # an unset entry reads as EINVAL for its type
            continue
        if value.strip("0:"):
            out.append({"index": g.name, "gid": value, "type": kind})
    return out


def v4_gid_index(table: list[dict[str, str]], ip: str = IP) -> str | None:
    """The RoCE v2 GID that maps the IPv4 address `ip` (::ffff:a.b.c.d)."""
    a, b, c, d = (int(x) for x in ip.split("."))
    want = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
    for g in table:
        if g["gid"] == want and "v2" in g["type"]:
            return g["index"]
    return None


def main() -> int:
    emit(
        "start",
        kernel=os.uname().release,
        modules=sorted(line.split()[0] for line in Path("/proc/modules").read_text().splitlines()),
    )
    link = run("rdma", "link", "add", DEVICE, "type", "rxe", "netdev", NETDEV)
    emit("link_add", **link)
    table = gids()
    dev_infiniband = (
        sorted(os.listdir("/dev/infiniband")) if Path("/dev/infiniband").is_dir() else []
    )
    emit(
        "devices",
        rdma_link=run("rdma", "link", "show"),
        ibv_devices=run("ibv_devices"),
        ibv_devinfo=run("ibv_devinfo", "-d", DEVICE),
        dev_infiniband=dev_infiniband,
        gids=table,
    )
    gid = v4_gid_index(table)
    common = ["-d", DEVICE, "-g", gid or "0", "-n", ITERS, "-s", SIZE]
    for name, extra, port in (("pingpong_events", ["-e"], 18515), ("pingpong_poll", [], 18516)):
        emit(
            name,
            gid_index=gid,
            **pair(
                ["ibv_rc_pingpong", *common, *extra, "-p", str(port)],
                ["ibv_rc_pingpong", *common, *extra, "-p", str(port), IP],
                tcp_listening(port),
            ),
        )
    emit(
        "rping",
        **pair(
            ["rping", "-s", "-a", IP, "-p", "7174", "-C", "10", "-v"],
            ["rping", "-c", "-a", IP, "-p", "7174", "-C", "10", "-v"],
            cm_listening(7174),
        ),
    )
    if shutil.which("ib_read_lat"):  # perftest, optional
        for i, tool in enumerate(("ib_read_lat", "ib_read_bw", "ib_write_bw")):
            port = 18530 + i
            args = [tool, "-d", DEVICE, "-x", gid or "0", "-s", SIZE, "-n", ITERS, "-F"]
            emit(
                tool,
                **pair(
                    [*args, "-p", str(port)],
                    [*args, "-p", str(port), IP],
                    tcp_listening(port),
                    server_after=20,
                ),
            )
    if os.environ.get("DUVM_RDMA_VETH") == "1":
        veth_pingpong("veth_netns", "n", ("duvm-a", "duvm-b"), "10.77.0", 18520)
        veth_pingpong("veth_init_ns", "i", (None, None), "10.78.0", 18521)
    emit("dmesg", out=run("dmesg")["out"][-3000:])
    return 0


def veth_pingpong(
    name: str, tag: str, namespaces: tuple[str | None, str | None], subnet: str, port: int
) -> None:
    """An experiment: a veth pair (each end in its namespace, or both in the initial one),
    rxe on each end, ibv_rc_pingpong from the second end to the first."""
    ends = []
    steps = []
    for i, ns in enumerate(namespaces):
        dev, ip, rxe = f"veth{tag}{i}", f"{subnet}.{i + 1}", f"rxe{tag}{i}"
        pre = ["ip", "netns", "exec", ns] if ns else []
        if ns:
            steps.append(run("ip", "netns", "add", ns))
        ends.append({"ns": ns, "dev": dev, "ip": ip, "rxe": rxe, "pre": pre})
    a, b = ends
    steps.append(
        run(
            "ip", "link", "add", a["dev"], *(["netns", a["ns"]] if a["ns"] else []),
            "type", "veth", "peer", "name", b["dev"], *(["netns", b["ns"]] if b["ns"] else []),
        )
    )  # fmt: skip
    for e in ends:
        steps.append(run(*e["pre"], "ip", "addr", "add", f"{e['ip']}/24", "dev", e["dev"]))
        steps.append(run(*e["pre"], "ip", "link", "set", e["dev"], "up"))
        steps.append(run(*e["pre"], "ip", "link", "set", "lo", "up"))
        steps.append(
            run(*e["pre"], "rdma", "link", "add", e["rxe"], "type", "rxe", "netdev", e["dev"])
        )
    time.sleep(1)  # the GID table follows the addresses
    for e in ends:
        e["gids"] = gids(e["rxe"])
        e["gid_index"] = v4_gid_index(e["gids"], e["ip"])
    args = ["-n", "100", "-s", SIZE, "-e", "-p", str(port)]
    result = pair(
        [*a["pre"], "ibv_rc_pingpong", "-d", a["rxe"], "-g", a["gid_index"] or "0", *args],
        [*b["pre"], "ibv_rc_pingpong", "-d", b["rxe"], "-g", b["gid_index"] or "0", *args, a["ip"]],
        tcp_listening(port, a["ns"]),
        timeout=40,
        server_after=10,
    )
    emit(
        name,
        steps=[st for st in steps if st["rc"] != 0] or "all ok",
        ends=[{k: v for k, v in e.items() if k != "pre"} for e in ends],
        rdma_system=run("rdma", "system", "show"),
        rdma_link=run("rdma", "link", "show"),
        **result,
    )


if __name__ == "__main__":
    raise SystemExit(main())
