"""Who owns each process (`base.cgroupname`, `sampling.procfacts`) and measured VRAM summed by
owner (`base.owners`).

Real parts: cgroups this test makes (root), named exactly as kubelet makes them under both
of its cgroup drivers, as containerd, CRI-O and Docker name their containers, as slurmd
(cgroup v1 and v2 plugins) and systemd name theirs, on cgroup v2 (and on a v1 hierarchy where
the machine mounts one), each with a real process moved into it and read back through
``/proc/PID/cgroup``; every cgroup is removed in ``finally``. cgroup v1 machines' whole
``/proc/PID/cgroup`` files (several hierarchies) come from fixture files. The parser is fuzzed:
it never fails, gives back what a generated kubelet or slurmd path holds, and names no pod,
job or container that the text does not. The totals add measured bytes only and keep rows
whose owner is unknown apart; they reach ``--json``, ``--once``, serve's metrics and the fleet.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from gputaskman.base.cgroupname import parse_cgroup
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.owners import owner_totals
from gputaskman.base.readings import (
    Adapter,
    Owner,
    Problem,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.fleet.promapi import Sample
from gputaskman.fleet.promseries import host_sample
from gputaskman.render import report, text_report
from gputaskman.render.exporter import Cached, snapshot_families
from gputaskman.sampling import procfacts
from gputaskman.sampling.collector import Collector
from hypothesis import example, given
from hypothesis import strategies as st

GIB = 1 << 30
BUS = "00000000:01:00.0"
ROOT = os.geteuid() == 0
HERE = Path(__file__).parent
UID = "0d7bd4c5-1e8f-4c3d-9d5e-5f0c8e3a4b21"
UID2 = "a1b2c3d4-0000-4a4a-8b8b-123456789abc"
STATIC_UID = "6e1b1f2c9d5a4e0f8a7b3c2d1e0f9a8b"  # a static pod's: the hash of its manifest
CID = "6a9f2c1e" * 8
CID2 = "0123456789abcdef" * 4


def us(uid: str) -> str:
    """A pod UID as kubelet's systemd driver writes it in a slice name."""
    return uid.replace("-", "_")


# path below the test's root -> the Owner fields it must give (the rest None / False)
KUBELET_SYSTEMD = "kubepods.slice"
CASES: dict[str, tuple[str, dict]] = {
    "kubelet systemd, containerd, burstable": (
        f"{KUBELET_SYSTEMD}/kubepods-burstable.slice/kubepods-burstable-pod{us(UID)}.slice/"
        f"cri-containerd-{CID}.scope",
        {
            "pod_uid": UID,
            "qos": "burstable",
            "container_id": CID,
            "container_runtime": "containerd",
            "unit": f"cri-containerd-{CID}.scope",
        },
    ),
    "kubelet systemd, cri-o, guaranteed": (
        f"{KUBELET_SYSTEMD}/kubepods-pod{us(UID)}.slice/crio-{CID}.scope",
        {
            "pod_uid": UID,
            "qos": "guaranteed",
            "container_id": CID,
            "container_runtime": "cri-o",
            "unit": f"crio-{CID}.scope",
        },
    ),
    "kubelet systemd, cri-o conmon": (
        f"{KUBELET_SYSTEMD}/kubepods-besteffort.slice/kubepods-besteffort-pod{us(UID)}.slice/"
        f"crio-conmon-{CID}.scope",
        {
            "pod_uid": UID,
            "qos": "besteffort",
            "container_id": CID,
            "container_runtime": "cri-o conmon",
            "unit": f"crio-conmon-{CID}.scope",
        },
    ),
    "kubelet systemd, docker, besteffort": (
        f"{KUBELET_SYSTEMD}/kubepods-besteffort.slice/kubepods-besteffort-pod{us(UID)}.slice/"
        f"docker-{CID}.scope",
        {
            "pod_uid": UID,
            "qos": "besteffort",
            "container_id": CID,
            "container_runtime": "docker",
            "unit": f"docker-{CID}.scope",
        },
    ),
    "kubelet cgroupfs, containerd, burstable": (
        f"kubepods/burstable/pod{UID}/{CID}",
        {"pod_uid": UID, "qos": "burstable", "container_id": CID},
    ),
    "kubelet cgroupfs, cri-o, besteffort": (
        f"kubepods/besteffort/pod{UID}/crio-{CID}",
        {"pod_uid": UID, "qos": "besteffort", "container_id": CID, "container_runtime": "cri-o"},
    ),
    "kubelet cgroupfs, guaranteed, static pod": (
        f"kubepods/pod{STATIC_UID}/{CID}",
        {"pod_uid": STATIC_UID, "qos": "guaranteed", "container_id": CID},
    ),
    "docker, cgroupfs": (f"docker/{CID}", {"container_id": CID, "container_runtime": "docker"}),
    "docker, systemd": (
        f"system.slice/docker-{CID}.scope",
        {"container_id": CID, "container_runtime": "docker", "unit": f"docker-{CID}.scope"},
    ),
    "podman": (
        f"machine.slice/libpod-{CID}.scope",
        {"container_id": CID, "container_runtime": "podman", "unit": f"libpod-{CID}.scope"},
    ),
    "slurmd, cgroup v1 plugin": (
        "slurm/uid_0/job_4242/step_0/task_0",
        {"slurm_job": "4242", "slurm_step": "0"},
    ),
    "slurmd, cgroup v2 plugin": (
        "system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0",
        {"slurm_job": "4242", "slurm_step": "batch", "unit": "slurmstepd.scope"},
    ),
    "slurmd, extern step": (
        "system.slice/slurmstepd.scope/job_77/step_extern/user",
        {"slurm_job": "77", "slurm_step": "extern", "unit": "slurmstepd.scope"},
    ),
    "systemd service": ("system.slice/nginx.service", {"unit": "nginx.service"}),
    "login session": (
        "user.slice/user-1000.slice/session-7.scope",
        {"session": "7", "unit": "session-7.scope"},
    ),
    "user manager's unit": (
        "user.slice/user-1000.slice/user@1000.service/app.slice/app-firefox-1.scope",
        {"unit": "app-firefox-1.scope", "user_unit": True},
    ),
    # names that look alike but are not what the software writes: nothing is guessed
    "a pod word outside kubepods": (f"mypods/pod{UID}/{CID}", {}),
    "a job word outside slurm": ("batch/uid_0/job_12/step_0", {}),
    "a short id under docker": ("docker/abc123", {}),
    "a pod's own cgroup, no container": (
        f"kubepods/burstable/pod{UID}/abc123",
        {"pod_uid": UID, "qos": "burstable"},
    ),
}
FIELDS = (
    "pod_uid",
    "qos",
    "container_id",
    "container_runtime",
    "slurm_job",
    "slurm_step",
    "unit",
    "user_unit",
    "session",
)


def facts(o: Owner) -> dict:
    """The fields an Owner names (unset ones left out)."""
    return {k: getattr(o, k) for k in FIELDS if getattr(o, k) not in (None, False)}


# ---------------------------------------------------------------------------- the parser


@pytest.mark.parametrize("name", list(CASES))
def test_a_cgroup_v2_path_names_what_its_maker_wrote(name):
    path, want = CASES[name]
    o = parse_cgroup(f"0::/gtm/{path}\n")
    assert facts(o) == want
    assert o.cgroup == f"/gtm/{path}" and o.reason is None


FIXTURES = HERE / "cgroups"
# fixture file -> what it names (whole /proc/PID/cgroup files of cgroup v1 machines)
V1_FIXTURES = {
    "k8s-v1-cgroupfs-docker.txt": {
        "pod_uid": UID,
        "qos": "burstable",
        "container_id": CID,
    },
    "k8s-v1-systemd-containerd.txt": {
        "pod_uid": UID,
        "qos": "besteffort",
        "container_id": CID,
        "container_runtime": "containerd",
        "unit": f"cri-containerd-{CID}.scope",
    },
    "slurm-v1-task-cgroup.txt": {
        "slurm_job": "123456",
        "slurm_step": "0",
        "unit": "slurmd.service",
    },
    "docker-v1.txt": {"container_id": CID, "container_runtime": "docker"},
    "session-v1.txt": {"session": "4", "unit": "session-4.scope"},
    # two pods named: neither kept (the one container both name is)
    "hierarchies-disagree-v1.txt": {"container_id": CID, "unit": "kubelet.service"},
}


@pytest.mark.parametrize("fixture", list(V1_FIXTURES))
def test_a_cgroup_v1_file_names_what_its_hierarchies_agree_on(fixture, tmp_path):
    """Read as a process's /proc/PID/cgroup of a fixture /proc tree (the reader's own path);
    hierarchies that name different pods name none (the detail says so)."""
    proc = tmp_path / "proc"
    d = proc / "4321"
    d.mkdir(parents=True)
    (proc / "stat").write_text("cpu  1 2 3 4\nbtime 1700000000\n")
    fields = " ".join(["S", "1"] + ["0"] * 17 + ["100"] + ["0"] * 30)
    (d / "stat").write_text(f"4321 (trainer) {fields}\n")
    (d / "status").write_text("Name:\ttrainer\nUid:\t0\t0\t0\t0\nVmSwap:\t0 kB\n")
    (d / "cgroup").write_text((FIXTURES / fixture).read_text())
    r = ProcGpu(4321, None, "trainer", BUS, (), Reading.measured(GIB, "nvml:mock"))
    (got,) = procfacts.RowFacts(str(proc)).annotate([r], None, None)
    assert got.owner is not None
    # no start time on the row: its owner is unknown, not read from another process
    assert got.owner.cgroup is None and got.owner.reason is Reason.UNAVAILABLE
    r = ProcGpu(4321, 1700000001.0, "trainer", BUS, (), Reading.measured(GIB, "nvml:mock"))
    (got,) = procfacts.RowFacts(str(proc)).annotate([r], None, None)
    o = got.owner
    assert o is not None and facts(o) == V1_FIXTURES[fixture]
    assert o.user == "root"
    if "disagree" in fixture:
        assert "disagree on pod_uid" in (o.detail or "")


def test_a_removed_cgroup_is_read_and_said():
    o = parse_cgroup(f"0::/kubepods/burstable/pod{UID}/{CID} (deleted)\n")
    assert o.pod_uid == UID and o.container_id == CID and "removed" in (o.detail or "")


def test_text_that_is_no_cgroup_file_names_nothing():
    o = parse_cgroup("garbage\n")
    assert o.cgroup is None and facts(o) == {}


HEX = "0123456789abcdef"
uids = st.uuids().map(str) | st.text(HEX, min_size=32, max_size=32)
cids = st.text(HEX, min_size=64, max_size=64)


@given(
    uid=uids,
    cid=cids,
    qos=st.sampled_from(["burstable", "besteffort", "guaranteed"]),
    driver=st.sampled_from(["systemd", "cgroupfs"]),
    runtime=st.sampled_from(["containerd", "cri-o", "docker"]),
    prefix=st.sampled_from(["", "kubelet", "nested"]),
    v1=st.booleans(),
)
def test_any_kubelet_path_gives_back_its_pod_and_container(
    uid, cid, qos, driver, runtime, prefix, v1
):
    if driver == "systemd":  # kubelet's --cgroup-root: none, /kubelet.slice, /nested
        scope = {"containerd": "cri-containerd", "cri-o": "crio", "docker": "docker"}[runtime]
        base = "kubelet-" if prefix == "kubelet" else ""
        top = {"": "", "kubelet": "/kubelet.slice", "nested": "/nested"}[prefix]
        top += f"/{base}kubepods.slice"
        if qos == "guaranteed":
            pod = f"{base}kubepods-pod{us(uid)}.slice"
        else:
            top += f"/{base}kubepods-{qos}.slice"
            pod = f"{base}kubepods-{qos}-pod{us(uid)}.slice"
        path = f"{top}/{pod}/{scope}-{cid}.scope"
        want_runtime: str | None = runtime
    else:
        top = {"": "", "kubelet": "/kubelet", "nested": "/nested"}[prefix] + "/kubepods"
        top += "" if qos == "guaranteed" else f"/{qos}"
        path = f"{top}/pod{uid}/{cid}"
        want_runtime = None  # the bare ID does not say which runtime made it
    text = (
        f"12:memory:{path}\n4:pids:{path}\n1:name=systemd:{path}\n0::/\n" if v1 else f"0::{path}\n"
    )
    o = parse_cgroup(text)
    assert (o.pod_uid, o.qos, o.container_id, o.container_runtime) == (
        uid,
        qos,
        cid,
        want_runtime,
    ), path


@given(
    job=st.integers(1, 2**32),
    step=st.sampled_from(["batch", "extern", "interactive"]) | st.integers(0, 999).map(str),
    v2=st.booleans(),
)
def test_any_slurmd_path_gives_back_its_job_and_step(job, step, v2):
    if v2:
        text = f"0::/system.slice/slurmstepd.scope/job_{job}/step_{step}/user/task_0\n"
    else:
        path = f"/slurm/uid_1000/job_{job}/step_{step}/task_1"
        text = f"9:memory:{path}\n4:freezer:{path}\n1:name=systemd:/system.slice/slurmd.service\n"
    o = parse_cgroup(text)
    assert (o.slurm_job, o.slurm_step) == (str(job), step)


components = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.@", min_size=1, max_size=70)


@given(st.lists(components, max_size=8), st.booleans())
@example(["kubepodsX", f"pod{UID}", CID], False)
@example(["slurmX", "uid_1", "job_5"], True)
@example(["kubepods", "burstable", f"pod{UID}", "abcd"], True)
def test_the_parser_never_names_what_the_path_does_not_hold(parts, v1):
    path = "/" + "/".join(parts)
    text = f"4:memory:{path}\n1:name=systemd:/\n" if v1 else f"0::{path}\n"
    o = parse_cgroup(text)
    if "kubepods" not in path:
        assert o.pod_uid is None and o.qos is None
    if "slurm" not in path:
        assert o.slurm_job is None and o.slurm_step is None
    if o.pod_uid is not None:
        assert o.pod_uid.replace("-", "_") in path or o.pod_uid in path
    if o.container_id is not None:
        assert len(o.container_id) == 64 and o.container_id in path
    if o.unit is not None:
        assert o.unit in parts


@given(st.text(max_size=300))
def test_the_parser_never_fails(text):
    o = parse_cgroup(text)
    assert o.cgroup is None or o.cgroup.startswith("/")


# ---------------------------------------------------------------------------- real cgroups, root


def _mounts() -> dict[str, Path]:
    """'v2' -> where cgroup2 is mounted, 'v1' -> a v1 hierarchy (pids) where there is one."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split(" ", 2)
        mnt = Path(left.split()[4])
        if fstype == "cgroup2":
            out.setdefault("v2", mnt)
        elif fstype == "cgroup" and "pids" in options.split(",") and "v1" not in out:
            out["v1"] = mnt
    return out


@contextlib.contextmanager
def in_cgroup(mount: Path, path: str) -> Iterator[subprocess.Popen]:
    """A `sleep` process moved into the cgroup `path` made below `mount` (every directory it
    needed removed again in ``finally``)."""
    made: list[Path] = []
    d = mount
    proc = None
    try:
        for part in path.split("/"):
            d = d / part
            if not d.exists():
                d.mkdir()
                made.append(d)
        proc = subprocess.Popen(["sleep", "300"])
        (d / "cgroup.procs").write_text(str(proc.pid))
        yield proc
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        for m in reversed(made):
            with contextlib.suppress(OSError):
                m.rmdir()


def _where(kind: str) -> Path:
    if not ROOT:
        pytest.skip("needs root (makes cgroups)")
    mount = _mounts().get(kind)
    if mount is None:
        pytest.skip(f"no cgroup {kind} hierarchy mounted here")
    return mount


def _row(pid: int, vram: int | None = GIB) -> ProcGpu:
    from gputaskman.base import procfs

    ct = procfs.create_time(procfs.read_stat(pid).start_ticks, procfs.boot_time() or 0)
    dedicated = (
        Reading.measured(vram, "nvml:mock")
        if vram is not None
        else Reading.missing(Reason.HIDDEN, "nvml:mock")
    )
    return ProcGpu(pid, ct, "sleep", BUS, ("compute",), dedicated)


@pytest.mark.parametrize("kind", ["v2", "v1"])
@pytest.mark.parametrize("name", [n for n in CASES if "outside" not in n and "short" not in n])
def test_a_real_process_in_a_cgroup_made_as_its_maker_makes_it_is_owned_by_it(kind, name):
    """Catches a parser that reads a layout other than the kernel shows it (the process's own
    /proc/PID/cgroup, on cgroup v2 and on a v1 hierarchy), or a reader that reads another
    process's file."""
    mount = _where(kind)
    root = f"gtm-owners-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path, want = CASES[name]
    with in_cgroup(mount, f"{root}/{path}") as proc:
        line = next(
            ln
            for ln in Path(f"/proc/{proc.pid}/cgroup").read_text().splitlines()
            if ln.endswith(path)
        )
        assert line.split(":", 2)[2] == f"/{root}/{path}"  # the kernel's own words
        (got,) = procfacts.RowFacts().annotate([_row(proc.pid)], None, None)
    o = got.owner
    assert o is not None and facts(o) == want
    assert o.cgroup == f"/{root}/{path}" and o.user == "root"


@pytest.mark.skipif(not ROOT, reason="needs root (makes cgroups)")
def test_totals_by_pod_and_job_from_real_cgroups_reach_every_output(tmp_path):
    """Catches a total that adds hidden or another owner's bytes, a row of unknown owner
    folded into a named one or into "no pod", a pod named from anything but kubelet's pod
    log directories, and totals lost on their way through --json, --once, serve's metrics
    and the fleet's reading of them. NVML is mocked (no GPU here): it lists real processes
    in real cgroups."""
    mount = _where("v2")
    root = f"gtm-owners-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    pods = tmp_path / "pods"
    (pods / f"ml_trainer-0_{UID}").mkdir(parents=True)  # kubelet's pod log directory
    pod = f"{KUBELET_SYSTEMD}/kubepods-burstable.slice/kubepods-burstable-pod{us(UID)}.slice"
    pod2 = f"kubepods/besteffort/pod{UID2}"
    job = "system.slice/slurmstepd.scope/job_4242/step_0/user/task_0"
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(in_cgroup(mount, f"{root}/{pod}/cri-containerd-{CID}.scope"))
        b = stack.enter_context(in_cgroup(mount, f"{root}/{pod}/cri-containerd-{CID2}.scope"))
        c = stack.enter_context(in_cgroup(mount, f"{root}/{job}"))
        d = stack.enter_context(in_cgroup(mount, f"{root}/{pod2}/{CID}"))
        gone = subprocess.Popen(["true"])
        gone.wait()
        listed = {a.pid: 1 * GIB, b.pid: 2 * GIB, c.pid: 4 * GIB, d.pid: None, gone.pid: 8 * GIB}

        class Nvml(GpuSource):  # NVML mocked: these processes hold these bytes
            def sample(self) -> GpuSample:
                ad = Adapter(0, "nvidia", "NVIDIA Mock GPU", "GPU-mock", BUS, "nvml")
                ps = tuple(
                    GpuProcess(
                        pid,
                        BUS,
                        ("compute",),
                        Reading.measured(v, "nvml:mock")
                        if v is not None
                        else Reading.missing(Reason.HIDDEN, "nvml:mock"),
                    )
                    for pid, v in listed.items()
                )
                return GpuSample("nvml", adapters=(ad,), processes=ps, driver_version="mock")

            def close(self) -> None:
                pass

        col = Collector(
            scan_budget=None,
            source=Nvml(),
            models=None,
            facts=procfacts.RowFacts(pods_dir=str(pods)),
        )
        try:
            snap, system = col.sample_with_system()
        finally:
            col.close()
    totals = {(t.by, t.state, t.owner): t for t in owner_totals(snap)}
    mine = {k: t for k, t in totals.items() if set(t.pids) & set(listed)}
    p1 = mine[("pod", "named", UID)]
    both = tuple(sorted([a.pid, b.pid]))
    assert (p1.attributed_bytes, p1.complete, p1.pids) == (3 * GIB, True, both)
    assert (p1.pod_namespace, p1.pod_name) == ("ml", "trainer-0")
    p2 = mine[("pod", "named", UID2)]
    assert (p2.attributed_bytes, p2.complete, p2.pod_name) == (None, False, None)
    j = mine[("job", "named", "4242")]
    assert (j.attributed_bytes, j.complete, j.pids) == (4 * GIB, True, (c.pid,))
    # the gone process: owner unknown, counted apart in every dimension, never in a pod's
    for by in ("user", "pod", "job"):
        assert totals[(by, "unknown", None)].pids == (gone.pid,)
        assert totals[(by, "unknown", None)].attributed_bytes == 8 * GIB
    assert c.pid in totals[("pod", "none", None)].pids
    assert a.pid not in totals[("pod", "none", None)].pids
    # --json
    doc = json.loads(json.dumps(report.to_json_dict(snap, system)))
    assert report.null_rule_violations(doc) == []
    by_doc = {(t["by"], t["owner"]): t for t in doc["owner_totals"]}
    assert by_doc[("pod", UID)]["attributed_bytes"] == 3 * GIB
    assert by_doc[("pod", UID)]["pod_name"] == "trainer-0"
    (ra,) = [p for p in doc["processes"] if p["pid"] == a.pid]
    assert ra["owner"]["pod_uid"] == UID and ra["owner"]["container_id"] == CID
    assert ra["owner"]["pod_source"] == str(pods)
    # --once
    text = text_report.render_text(snap, system)
    owners = text.split("OWNERS", 1)[1]
    assert "ml/trainer-0 3.0 GiB (2 procs)" in owners and "4242 4.0 GiB (1 proc)" in owners
    assert "pod unknown 8.0 GiB (1 proc)" in owners
    # serve's metrics, and the fleet's snapshot rebuilt from them
    labels = {"instance": "h:1", "job": "gputaskman"}
    series = [
        Sample({**s.labels, "__name__": s.name, **labels}, (0.0, float(s.value)))
        for fam in snapshot_families(Cached(snap, system, snap.taken, 0.0))
        for s in fam.samples
    ]
    vram = {
        (s.metric["by"], s.metric["owner"], s.metric["state"]): s.value[1]
        for s in series
        if s.metric["__name__"] == "gputaskman_owner_vram_bytes"
    }
    assert vram[("pod", UID, "named")] == 3 * GIB and ("pod", UID2, "named") not in vram
    assert vram[("job", "", "unknown")] == 8 * GIB
    info = [s.metric for s in series if s.metric["__name__"] == "gputaskman_process_owner_info"]
    (ia,) = [m for m in info if m["pid"] == str(a.pid)]
    assert (ia["pod_uid"], ia["pod_name"]) == (UID, "trainer-0")
    assert ia["container_runtime"] == "containerd"
    assert not [m for m in info if m["pid"] == str(gone.pid)]  # unknown: no series
    fleet_snap, fleet_system = host_sample(series, note="t")
    fleet = json.loads(json.dumps(report.to_json_dict(fleet_snap, fleet_system)))
    assert fleet["owner_totals"] == doc["owner_totals"]


# ---------------------------------------------------------------------------- the totals


def _proc(pid, vram, owner=None, **kw):
    r = Reading.measured(vram, "nvml") if isinstance(vram, int) else vram
    return ProcGpu(pid, 1.0, "p", kw.pop("adapter", BUS), ("compute",), r, owner=owner, **kw)


def _pod(uid, user="alice"):
    return Owner(f"/kubepods/pod{uid}", user=user, pod_uid=uid)


def test_only_measured_bytes_are_summed_and_unknown_owners_are_apart():
    """Catches an inferred, hidden or parent-counted row added to an owner's sum, a GPU whose
    process list failed shown complete, and an unknown owner folded into a named one."""
    inferred = Reading.inferred(5 * GIB, "wsl")
    hidden = Reading.missing(Reason.HIDDEN, "nvml")
    procs = (
        _proc(1, GIB, _pod(UID)),
        _proc(2, inferred, _pod(UID)),  # inferred: shown, never summed
        _proc(3, hidden, _pod(UID2)),
        _proc(4, 2 * GIB, _pod(UID2), parent_pid=9),  # inside its parent's total already
        _proc(5, 3 * GIB, None),  # owner not read
        _proc(6, 4 * GIB, Owner(None, reason=Reason.DENIED)),
        _proc(7, 8 * GIB, _pod(UID), host="windows"),  # another OS's PID: unknown here
        _proc(8, 16 * GIB, _pod(UID), adapter=None),  # no GPU context: not a GPU row
    )
    snap = Snapshot(1.0, "nvml", processes=procs)
    t = {(x.by, x.state, x.owner): x for x in owner_totals(snap)}
    assert (t[("pod", "named", UID)].attributed_bytes, t[("pod", "named", UID)].complete) == (
        GIB,
        False,
    )
    assert (t[("pod", "named", UID2)].attributed_bytes, t[("pod", "named", UID2)].complete) == (
        None,
        False,
    )
    unknown = t[("pod", "unknown", None)]
    assert (unknown.attributed_bytes, unknown.pids) == (3 * GIB + 4 * GIB + 8 * GIB, (5, 6, 7))
    assert t[("user", "named", "alice")].pids == (1, 2, 3, 4)
    assert t[("job", "none", None)].pids == (1, 2, 3, 4)
    failed = Problem("processes.compute", Reason.QUERY_FAILED, None, BUS)
    snap = Snapshot(1.0, "nvml", processes=procs[:1], problems=(failed,))
    (pod,) = [x for x in owner_totals(snap) if x.by == "pod"]
    assert (pod.attributed_bytes, pod.complete) == (GIB, False)


def test_a_document_without_owners_says_nothing_of_them_in_once():
    procs = (_proc(1, GIB, None),)
    assert text_report.render_text(Snapshot(1.0, "nvml", processes=procs)).count("OWNERS") == 0


# ---------------------------------------------------------------------------- the TUI


async def test_keys_m_and_o_turn_the_memory_and_owner_columns_on_and_keep_them(tmp_path):
    """Catches columns a user cannot turn on, a choice the settings forget, and cells that are
    not the row's readings: the DRM fixture tree's llama-server (a kubelet pod's containerd
    container, 12 MiB swapped out; its /proc/swaps not read, so the bytes are swap) through
    the real collector, its header's totals by owner included."""
    from gputaskman.tui.app import create_app
    from gputaskman.tui.widgets.gpu_header import GpuHeader
    from gputaskman.tui.widgets.process_table import ProcessTable
    from test_tui_layouts import drm_snapshot
    from tui_support import Fixed, settle

    snap = drm_snapshot(tmp_path / "tree")
    path = tmp_path / "tui.json"
    app = create_app(collector_factory=lambda: Fixed(snap), interval=60.0, settings_path=path)
    async with app.run_test(size=(240, 60)) as pilot:
        await settle(pilot, app)
        table = app.query_one(ProcessTable)
        assert not {"SWAPPED", "OWNER"} & set(table.columns_shown)  # off until turned on
        await pilot.press("m", "o")
        await settle(pilot, app)
        shown = table.columns_shown
        assert {"SWAPPED", "LOCKED", "PINNED", "OWNER"} <= set(shown)
        key = next(k for k, p in table.rows_shown.items() if p.pid == 4100)
        cells = dict(zip(shown, table.get_row(key), strict=True))
        assert cells["SWAPPED"] == "12.0 MiB swap" and cells["LOCKED"] == "0 B"
        assert cells["OWNER"] == "pod 6f1c2a4e"
        header = str(app.query_one(GpuHeader).text)
        assert "by pod  6f1c2a4e 4.0 GiB (1 proc)" in header
    assert json.loads(path.read_text())["shown_columns"] == ["SWAPPED", "LOCKED", "PINNED", "OWNER"]
    again = create_app(collector_factory=lambda: Fixed(snap), interval=60.0, settings_path=path)
    async with again.run_test(size=(240, 60)) as pilot:
        await settle(pilot, again)
        assert "OWNER" in again.query_one(ProcessTable).columns_shown
        await pilot.press("o")
        await settle(pilot, again)
        assert "OWNER" not in again.query_one(ProcessTable).columns_shown
