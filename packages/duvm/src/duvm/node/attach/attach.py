"""Turn the local daemon's NBD export into an active swap device, and back. Root only.

Theory of operation
-------------------
The daemon is an NBD server on a Unix socket. The kernel needs a block device:

* **kernel nbd** (production, :mod:`duvm.node.attach.attach_kernel`): ``/dev/nbdN``, tried first,
  after ``modprobe nbd`` when the module is not loaded. Connected over generic netlink
  (:mod:`duvm.wire.nbdnetlink`: ``NBD_CMD_CONNECT`` with a dead-connection timeout, so a
  restarted daemon can take the live device back with ``NBD_CMD_RECONFIGURE``, see
  :func:`duvm.node.attach.attach_kernel.reattach`); on a kernel whose nbd has no netlink family, by
  the ioctl holder process of :mod:`duvm.node.attach.kernelnbd` instead.
* **nbdfuse + loop** (fallback where the kernel has no nbd, :mod:`duvm.node.attach.attach_fuse`;
  taken only when asked for by name, ``method = "nbdfuse-loop"``: it can hang under
  whole-node memory pressure, so ``auto`` refuses it and says why):
  ``nbdfuse`` (libnbd) shows the export as one file on a FUSE mount; ``losetup --direct-io=on``
  puts a loop device on that file, so swap I/O goes straight to nbdfuse without a second copy
  in the page cache.

Then ``mkswap`` and ``swapon -p PRIORITY --discard=pages``: discard makes the kernel trim swap
slots as it frees them, which reaches the daemon as NBD_CMD_TRIM and frees remote pages. After
``swapoff``, ``blkdiscard`` trims the whole device (the swap header and anything left), so the
pool holds 0 pages of ours once detached.

Swapping over a network block device needs memory on the I/O path (socket buffers, FUSE
requests), so ``vm.min_free_kbytes`` is raised (never lowered) on attach and
``vm.watermark_boost_factor`` set to 0, both restored on detach if nobody changed them meanwhile
(:mod:`duvm.node.attach.kernel_swap`).

Every step is recorded in a small JSON state file (written atomically after each step,
:mod:`duvm.node.attach.attach_state`), so ``detach`` — also after a crash half-way through
``attach`` — knows exactly what to undo.
Detach order is the reverse of attach, and ``swapoff`` comes first: if the kernel cannot bring
the swapped pages home (not enough free RAM), nothing else is torn down and the error says so.

System tools are called by absolute path (found in the standard sbin/bin directories, never via
$PATH), and each missing tool is reported with the Debian package that provides it
(:mod:`duvm.node.attach.systools`).
"""

from __future__ import annotations

import os
from pathlib import Path

from duvm.node.attach import attach_fuse, attach_kernel, attach_state, kernel_swap, systools
from duvm.node.attach.attach_state import (
    DEFAULT_PRIORITY,
    METHOD_FUSE,
    METHOD_KERNEL,
    AttachError,
    Attachment,
    SwapoffFailed,
)
from duvm.node.attach.systools import SYSTEM_TOOLS, Tools

DEFAULT_RUN_DIR = Path("/run/duvm")
DEFAULT_NBD_TIMEOUT_S = 60


def resolve_method(method: str, tools: Tools = SYSTEM_TOOLS, kernel_nbd: bool | None = None) -> str:
    """The path `method` takes here (METHOD_KERNEL or METHOD_FUSE), or AttachError saying why
    none. "auto" takes kernel nbd only: the nbdfuse + loop fallback is taken when asked for by
    name, never by default (AUTO_REFUSES_FALLBACK says why). `kernel_nbd` is whether the
    kernel has nbd (None: ask it, attach_kernel.available)."""

    def has_nbd() -> bool:
        return attach_kernel.available(tools) if kernel_nbd is None else kernel_nbd

    if method == "auto":
        if has_nbd():
            return METHOD_KERNEL
        raise AttachError(attach_fuse.AUTO_REFUSES_FALLBACK)
    if method == METHOD_KERNEL and not has_nbd():
        raise AttachError("the kernel has no nbd driver (modprobe nbd failed or kmod missing)")
    if method == METHOD_FUSE and (problems := attach_fuse.problems(tools)):
        raise AttachError("nbdfuse fallback cannot run: " + "; ".join(problems))
    if method not in (METHOD_KERNEL, METHOD_FUSE):
        raise AttachError(f"unknown attach method {method!r}")
    return method


def attach(
    socket_path: str,
    state_path: Path,
    *,
    run_dir: Path = DEFAULT_RUN_DIR,
    method: str = "auto",
    priority: int = DEFAULT_PRIORITY,
    nbd_timeout_s: int = DEFAULT_NBD_TIMEOUT_S,
    extra: dict[str, object] | None = None,
    realtime: bool = True,
    tools: Tools = SYSTEM_TOOLS,
    connections: int = 1,
) -> Attachment:
    """Attach the NBD export at `socket_path` and activate it as swap. Root only.

    `method` is "auto" (kernel nbd; refused without it), METHOD_KERNEL or METHOD_FUSE.
    `realtime` runs nbdfuse at SCHED_RR like the daemon (duvm.base.pressure); `tools` is
    where the system tools are found; `connections`: kernel nbd sockets to the daemon (one per
    worker of a daemon with several; netlink only). On failure everything done so far is undone and
    AttachError raised.
    """
    systools.require_root()
    for tool in ("mkswap", "swapon", "swapoff", "blkdiscard"):
        tools.require(tool)
    existing = attach_state.load_state(state_path)
    if existing is not None:
        raise AttachError(
            f"already attached ({existing.device or existing.method}, state in "
            f"{state_path}); detach first"
        )
    method = resolve_method(method, tools)
    if not os.path.exists(socket_path):
        raise AttachError(f"no NBD server socket at {socket_path} (is the daemon running?)")

    run_dir.mkdir(parents=True, exist_ok=True)
    if connections != 1 and method != METHOD_KERNEL:
        raise AttachError(f"{connections} connections need kernel nbd; {method} has one")
    att = Attachment(
        socket=socket_path,
        method=method,
        priority=priority,
        extra=extra or {},
        connections=connections,
    )

    def save() -> None:
        attach_state.save_state(state_path, att)

    save()
    try:
        att.min_free_before, att.min_free_set = kernel_swap.raise_min_free()
        save()
        att.watermark_boost_before, att.watermark_boost_set = kernel_swap.stop_watermark_boost()
        save()
        if method == METHOD_KERNEL:
            attach_kernel.attach(att, run_dir, nbd_timeout_s, save)
        else:
            attach_fuse.attach(att, run_dir, save, realtime, tools)
        save()
        assert att.device is not None
        tools.run("mkswap", att.device)
        tools.run("swapon", "-p", str(priority), "--discard=pages", att.device)
        att.swap_active = True
        save()
    except BaseException as exc:
        try:
            detach(state_path, force=True, tools=tools)  # only just activated: nothing to protect
        except AttachError as undo:
            raise AttachError(f"{exc}; undoing the partial attach also failed: {undo}") from exc
        raise
    return att


def detach(
    state_path: Path, *, force: bool = False, tools: Tools = SYSTEM_TOOLS
) -> Attachment | None:
    """Undo what the state file records: swapoff first, then the device, then the sysctl.

    Returns the attachment that was removed, or None when nothing was attached. Raises
    SwapoffFailed (device still attached, state kept) when the kernel cannot take the pages
    back, or — unless `force` — when a check shows it could not without killing processes.
    """
    systools.require_root()
    att = attach_state.load_state(state_path)
    if att is None:
        return None
    entry = kernel_swap.swap_entry(att.device) if att.device else None
    problem = device_problem(att)
    if problem is not None:
        # Someone detached it behind our back and the number was reused: swapoff or discard
        # would hit their device. Leave it alone; what is still ours is cleaned up below.
        entry = None
        att.extra["device_problem"] = problem
    if entry is not None:
        problems = [] if force else kernel_swap.swapoff_problems(entry)
        if problems:
            raise SwapoffFailed(
                f"not turning off swap on {att.device}: the kernel would have to bring every "
                f"swapped page back into RAM, and there is no room: "
                + "; ".join(problems)
                + ". It stays attached and nothing was lost. Free memory (stop or resize those "
                "workloads) and run disable again (--force skips this check; swapoff itself "
                "still refuses when RAM is short, and the kernel may OOM-kill such a group)."
            )
        try:
            tools.run("swapoff", att.device, timeout=3600)
        except AttachError as exc:
            raise SwapoffFailed(kernel_swap.swapoff_failure(att.device, str(exc))) from exc
    att.swap_active = False
    attach_state.save_state(state_path, att)
    errors: list[str] = []
    if entry is not None and att.device:
        # swapoff leaves the swap header and stale slots on the device; discard them all so the
        # pool's RAM is given back even before the daemon releases its reservation
        # (not fatal: stopping the daemon releases the reservation anyway)
        try:
            tools.run("blkdiscard", "-f", att.device, timeout=600)
        except AttachError as exc:
            att.extra["discard_error"] = str(exc)
    if att.method == METHOD_KERNEL:
        attach_kernel.detach(att, errors)
    else:
        attach_fuse.detach(att, errors, tools)
    try:
        kernel_swap.restore_min_free(att.min_free_before, att.min_free_set)
    except (OSError, ValueError) as exc:
        errors.append(f"could not restore vm.min_free_kbytes={att.min_free_before}: {exc}")
    try:
        kernel_swap.restore_sysctl(
            att.watermark_boost_before, att.watermark_boost_set, kernel_swap.WATERMARK_BOOST_SYSCTL
        )
    except (OSError, ValueError) as exc:
        errors.append(
            f"could not restore vm.watermark_boost_factor={att.watermark_boost_before}: {exc}"
        )
    if errors:
        attach_state.save_state(state_path, att)
        raise AttachError("detach incomplete: " + "; ".join(errors))
    state_path.unlink(missing_ok=True)
    return att


def device_problem(att: Attachment, sys_root: Path = Path("/sys")) -> str | None:
    """Why `att.device` is no longer the device this attachment made, or None. Device numbers
    are reused as soon as they are free: a loop device must still be backed by our FUSE file,
    and a connected nbd device must still carry the connection pid seen at attach (both read
    from sysfs, mounted at `sys_root`)."""
    if not att.device:
        return None
    if att.method == METHOD_KERNEL:
        return attach_kernel.device_problem(att, sys_root)
    return attach_fuse.device_problem(att, sys_root)
