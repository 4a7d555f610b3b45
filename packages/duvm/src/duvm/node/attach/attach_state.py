"""The attachment record: what `duvm.node.attach.attach` has done, step by step, saved as a small
JSON file (written atomically after each step) so that detach, also after a crash half-way through
attach, knows exactly what to undo; and the errors attaching and detaching raise."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_PRIORITY = 100  # above distribution swap (negative priorities): the pool is tried first

METHOD_KERNEL = "kernel-nbd"
METHOD_FUSE = "nbdfuse-loop"

Saver = Callable[[], None]


class AttachError(Exception):
    """Attaching or detaching cannot proceed; the message says why and what to do."""


class SwapoffFailed(AttachError):
    """swapoff refused; the device stays attached."""


@dataclass
class Attachment:
    """What is attached, step by step; persisted so detach can undo exactly that."""

    socket: str
    method: str
    priority: int = DEFAULT_PRIORITY
    size_bytes: int | None = None
    device: str | None = None  # the block device that is (or will be) the swap device
    swap_active: bool = False
    nbd_device: str | None = None
    holder_pid: int | None = None
    holder_start: int | None = None  # its start time: tells it from a recycled pid
    nbd_netlink: bool = False  # connected over netlink (no holder; can be reconfigured)
    dead_conn_timeout_s: int | None = None
    connections: int = 1  # kernel nbd sockets to the daemon: one per worker (DECISIONS.md D49)
    mountdir: str | None = None
    fuse_file: str | None = None
    nbdfuse_pid: int | None = None
    nbdfuse_start: int | None = None
    nbdfuse_cgroup: str | None = None  # the unswappable cgroup nbdfuse runs in (cgroup v2)
    loop_device: str | None = None
    direct_io: bool | None = None
    min_free_before: int | None = None
    min_free_set: int | None = None
    watermark_boost_before: int | None = None  # vm.watermark_boost_factor (kernel_swap)
    watermark_boost_set: int | None = None
    extra: dict[str, object] = field(default_factory=dict)  # for the control layer (daemon pid)


def save_state(path: Path, att: Attachment) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(att), indent=2) + "\n")
    os.replace(tmp, path)


def load_state(path: Path) -> Attachment | None:
    """The recorded attachment, or None when there is none. A corrupt file is an error."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AttachError(f"state file {path} is unreadable ({exc}); inspect it by hand") from exc
    if not isinstance(raw, dict) or "socket" not in raw or "method" not in raw:
        raise AttachError(f"state file {path} is not a duvm attachment; inspect it by hand")
    known = {f.name for f in fields(Attachment)}
    return Attachment(**{k: v for k, v in raw.items() if k in known})
