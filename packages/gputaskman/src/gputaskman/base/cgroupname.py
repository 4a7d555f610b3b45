"""What a process's cgroup path names: a Kubernetes pod and container, a Slurm job and step,
a systemd unit, a login session (sans-io: the text of ``/proc/PID/cgroup`` in, an `Owner`
out; fuzzed in the tests).

Theory of operation
-------------------
``/proc/PID/cgroup`` has one line per hierarchy, ``ID:CONTROLLERS:PATH``: cgroup v2's single
line is ``0::/PATH``; a cgroup v1 machine lists each controller hierarchy (``4:memory:/...``,
``1:name=systemd:/...``), and a hybrid one has both. Each path is read component by component
against the names the software that made the cgroup writes, and nothing else:

* **kubelet**, cgroupfs driver: ``kubepods[/burstable|/besteffort]/pod<UID>/<ID>``; systemd
  driver: ``kubepods[-burstable|-besteffort]-pod<UID with _ for ->.slice`` (under
  ``kubepods.slice``, or a ``--cgroup-root`` prefix such as ``kubelet-kubepods-...``). The
  container is the next component: a runtime's scope under the systemd driver
  (``cri-containerd-<ID>.scope`` containerd, ``crio-<ID>.scope`` CRI-O (``crio-conmon-``:
  its monitor), ``docker-<ID>.scope`` Docker), or the bare 64-hex ID under cgroupfs, whose
  runtime the path does not say (None), or ``crio-<ID>`` (CRI-O under cgroupfs).
* **Docker** and **Podman** on their own: ``/docker/<ID>``, ``docker-<ID>.scope``,
  ``libpod-<ID>.scope``.
* **slurmd**: cgroup v1 ``/slurm[_NODE]/uid_<UID>/job_<ID>/step_<STEP>/task_<N>``; cgroup v2
  ``.../slurmstepd.scope/job_<ID>/step_<STEP>/...``; ``step_batch``, ``step_extern``,
  ``step_interactive`` and numbered steps.
* **systemd**: the deepest ``*.service`` / ``*.scope`` component is the unit; below
  ``user@<UID>.service`` it is a user manager's unit; ``session-<ID>.scope`` under
  ``user-<UID>.slice`` is a login session.

A container ID is 64 hexadecimal digits and a pod UID hexadecimal digits and dashes, as the
runtimes and the API server make them; anything else is not read as one. Pod and job are
taken from any hierarchy; when two hierarchies name different ones, neither is kept and the
detail says so (never a guess between them). The unit and session come from the v2 line (when
it is not ``/``), else ``name=systemd``'s, else the first line that names one: v1 hierarchies
legitimately differ there (slurmd's tasks are in ``slurmd.service`` for systemd and in
``job_N`` for the memory controller).

This module imports only the standard library and `base.readings` (checked by
tests/test_import_graph.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gputaskman.base.readings import Owner

_HEX64 = re.compile(r"[0-9a-f]{64}")
_UID = r"[0-9a-f][0-9a-f_-]{0,63}"
# systemd driver: "[PREFIX-]kubepods[-QOS]-pod<UID>.slice" (UID with "_" for "-")
_POD_SLICE = re.compile(
    rf"(?:[A-Za-z0-9_.-]+-)?kubepods(?:-(burstable|besteffort))?-pod({_UID})\.slice"
)
# cgroupfs driver: "pod<UID>" below "kubepods" (and "burstable" / "besteffort")
_POD_DIR = re.compile(rf"pod({_UID})")
_SCOPES = (
    ("cri-containerd-", "containerd"),
    ("crio-conmon-", "cri-o conmon"),
    ("crio-", "cri-o"),
    ("docker-", "docker"),
    ("libpod-conmon-", "podman conmon"),
    ("libpod-", "podman"),
)
_JOB = re.compile(r"job_([0-9]{1,20})")
_STEP = re.compile(r"step_([A-Za-z0-9+]{1,32})")
_SESSION = re.compile(r"session-([A-Za-z0-9]{1,32})\.scope")
_USER_MANAGER = re.compile(r"user@[0-9]{1,10}\.service")
DELETED = " (deleted)"


@dataclass(frozen=True, slots=True)
class _Facts:
    """What one hierarchy's path names."""

    pod_uid: str | None = None
    qos: str | None = None
    container_id: str | None = None
    runtime: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    unit: str | None = None
    user_unit: bool = False
    session: str | None = None


def _container(part: str, systemd: bool) -> tuple[str | None, str | None]:
    """(container ID, runtime) a component names, or (None, None)."""
    name = part.removesuffix(".scope") if systemd else part
    if systemd and not part.endswith(".scope"):
        return None, None
    for prefix, runtime in _SCOPES:
        if name.startswith(prefix) and _HEX64.fullmatch(name[len(prefix) :]):
            return name[len(prefix) :], runtime
    if not systemd and _HEX64.fullmatch(name):
        return name, None  # cgroupfs: the bare ID does not say which runtime made it
    return None, None


def _kube(parts: list[str]) -> tuple[str | None, str | None, str | None, str | None]:
    """(pod UID, QoS class, container ID, runtime) a path names under kubelet's cgroups."""
    for i, part in enumerate(parts):
        m = _POD_SLICE.fullmatch(part)
        if m is not None and any("kubepods" in p for p in parts[:i]):
            qos = m.group(1) or "guaranteed"
            cid, runtime = _container(parts[i + 1], True) if i + 1 < len(parts) else (None, None)
            return m.group(2).replace("_", "-"), qos, cid, runtime
        m = _POD_DIR.fullmatch(part)
        if m is None or i == 0:
            continue
        above = parts[i - 1]
        if above == "kubepods" or (
            above in ("burstable", "besteffort") and parts[i - 2 : i - 1] == ["kubepods"]
        ):
            qos = above if above != "kubepods" else "guaranteed"
            cid, runtime = _container(parts[i + 1], False) if i + 1 < len(parts) else (None, None)
            if cid is None and i + 1 < len(parts):
                cid, runtime = _container(parts[i + 1], True)  # a scope under cgroupfs names
            return m.group(1), qos, cid, runtime
    return None, None, None, None


def _slurm(parts: list[str]) -> tuple[str | None, str | None]:
    """(job ID, step) under slurmd's cgroups: a ``job_N`` below ``slurm[_NODE]/uid_N`` (v1)
    or below ``slurmstepd.scope`` (v2)."""
    for i, part in enumerate(parts):
        m = _JOB.fullmatch(part)
        if m is None or i == 0:
            continue
        above = parts[i - 1]
        v2 = above == "slurmstepd.scope"
        v1 = (
            above.startswith("uid_")
            and above[4:].isdigit()
            and i >= 2
            and (parts[i - 2] == "slurm" or parts[i - 2].startswith("slurm_"))
        )
        if not (v1 or v2):
            continue
        step = None
        if i + 1 < len(parts):
            s = _STEP.fullmatch(parts[i + 1])
            step = None if s is None else s.group(1)
        return m.group(1), step
    return None, None


def _systemd(parts: list[str]) -> tuple[str | None, bool, str | None]:
    """(deepest unit, whether a user manager's, login session ID)."""
    unit, user_unit, session = None, False, None
    below_manager = False
    for i, part in enumerate(parts):
        if part.endswith((".service", ".scope")) and len(part) > 8:
            unit, user_unit = part, below_manager
        if _USER_MANAGER.fullmatch(part):
            below_manager = True
        m = _SESSION.fullmatch(part)
        if m is not None and i > 0 and parts[i - 1].startswith("user-"):
            session = m.group(1)
    return unit, user_unit, session


def facts_of(path: str) -> _Facts:
    """What one cgroup path names (see the module docstring)."""
    parts = [p for p in path.split("/") if p]
    pod, qos, cid, runtime = _kube(parts)
    if pod is None:  # a container outside Kubernetes: Docker's or Podman's own cgroups
        for i, part in enumerate(parts):
            if part == "docker" and i + 1 < len(parts) and _HEX64.fullmatch(parts[i + 1]):
                cid, runtime = parts[i + 1], "docker"
            else:
                got = _container(part, True)
                if got[0] is not None:
                    cid, runtime = got
    job, step = _slurm(parts)
    unit, user_unit, session = _systemd(parts)
    return _Facts(pod, qos, cid, runtime, job, step, unit, user_unit, session)


def parse_lines(text: str) -> list[tuple[str, str]]:
    """``/proc/PID/cgroup`` as [(controllers, path)]; a line that is not ``ID:CTRL:PATH`` is
    skipped. ``name=systemd`` is a controller list of its own; v2's is empty."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            continue
        out.append((parts[1], parts[2]))
    return out


def _preferred(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The lines in the order the unit and session are taken from."""
    v2 = [ln for ln in lines if ln[0] == "" and ln[1] != "/"]
    named = [ln for ln in lines if ln[0] == "name=systemd"]
    return v2 + named + [ln for ln in lines if ln not in v2 and ln not in named]


def parse_cgroup(text: str) -> Owner:
    """The `Owner` the text of ``/proc/PID/cgroup`` names (`Owner.user` is not in it)."""
    lines = parse_lines(text)
    if not lines:
        return Owner(None, detail="no cgroup line in /proc/PID/cgroup")
    notes: list[str] = []
    facts: list[tuple[str, str, _Facts]] = []
    seen: dict[str, _Facts] = {}  # v1 hierarchies often share a path: each read once
    for ctrl, path in lines:
        if path.endswith(DELETED):
            path = path[: -len(DELETED)]
            notes.append(f"{path} was removed while the process was in it")
        got = seen.get(path)
        if got is None:
            got = seen[path] = facts_of(path)
        facts.append((ctrl, path, got))

    def agreed(attr: str) -> tuple[str | None, str | None]:
        """The one value `attr` has wherever a line names it, and the path naming it."""
        seen = {getattr(f, attr): path for _c, path, f in facts if getattr(f, attr) is not None}
        if len(seen) > 1:
            notes.append(f"hierarchies disagree on {attr}: {', '.join(sorted(seen))}")
            return None, None
        return next(iter(seen.items()), (None, None))

    pod, pod_path = agreed("pod_uid")
    job, job_path = agreed("slurm_job")
    cid, cid_path = agreed("container_id")
    source = {p: f for _c, p, f in facts}
    kube = source.get(pod_path or cid_path or "") if (pod or cid) else None
    slurm = source.get(job_path or "") if job else None
    by_pref = _preferred([(c, p) for c, p, _f in facts])
    unit_p = next((p for _c, p in by_pref if source[p].unit is not None), None)
    sess_p = next((p for _c, p in by_pref if source[p].session is not None), None)
    unit_f = None if unit_p is None else source[unit_p]
    sess_f = None if sess_p is None else source[sess_p]
    # the path shown: the one that named the most (pod, container, job, unit), else the first
    cgroup = pod_path or cid_path or job_path or unit_p or sess_p or by_pref[0][1]
    return Owner(
        cgroup,
        pod_uid=pod,
        container_id=cid,
        container_runtime=None if kube is None else kube.runtime,
        qos=None if kube is None or pod is None else kube.qos,
        slurm_job=job,
        slurm_step=None if slurm is None else slurm.slurm_step,
        unit=None if unit_f is None else unit_f.unit,
        user_unit=False if unit_f is None else unit_f.user_unit,
        session=None if sess_f is None else sess_f.session,
        detail="; ".join(notes) or None,
    )
