"""A process's own command line rewritten in place, as `ps` and /proc/PID/cmdline show it.

A process forked without exec (the supervisor's warm start of a daemon) keeps its parent's
command line, yet what it runs is another program: `ps` would show two supervisors, and the
checks that name a duvm process by its command line (`attach.processes.duvm_runs`) would not
find the daemon. The kernel reads /proc/PID/cmdline from the process's own memory, the argument
area the kernel laid out at exec (/proc/PID/stat fields 48 and 49), so writing new
NUL-separated words there changes what everyone reads. Only that area is used: the words that
do not fit are left off from the end, and the rest is NUL, so the kernel reads separate words
(a last byte that is not NUL would make it read one string running into the environment).
"""

from __future__ import annotations

import os

from duvm.base.procstat import stat_fields

_ARG_START, _ARG_END = 45, 46  # /proc/PID/stat fields 48 and 49, counted after the name


def argument_area() -> tuple[int, int] | None:
    """Where this process's command line lies in its memory (start, end); None where the
    kernel does not say (before Linux 3.5)."""
    fields = stat_fields(os.getpid())
    if fields is None or len(fields) <= _ARG_END:
        return None
    start, end = int(fields[_ARG_START]), int(fields[_ARG_END])
    return (start, end) if 0 < start < end else None


def fitting(words: list[str], room: int, keep: int = 1) -> bytes:
    """`words` NUL-separated and NUL-padded to `room` bytes, leaving off the words that do not
    fit, and an option past the first `keep` words whose value does not (a flag among the
    first `keep` stays); ValueError when not even the first fits."""
    out = b""
    for i, word in enumerate(words):
        encoded = word.encode() + b"\0"
        if len(out) + len(encoded) > room:
            if i - 1 >= keep and words[i - 1].startswith("-"):  # its value is left off
                out = out[: -len(words[i - 1].encode()) - 1]
            break
        out += encoded
    if not out:
        raise ValueError(f"{words[:1]} does not fit in a command line of {room} bytes")
    return out.ljust(room, b"\0")


def set_command_line(words: list[str], keep: int) -> list[str]:
    """Make this process's command line read `words`, as many as fit; the first `keep` must
    (ValueError otherwise, nothing written). Returns the words now shown. OSError where the
    kernel refuses the write."""
    area = argument_area()
    if area is None:
        raise OSError("this kernel does not say where the command line lies")
    start, end = area
    payload = fitting(words, end - start, keep)
    shown = [w.decode() for w in payload.rstrip(b"\0").split(b"\0")]
    if len(shown) < keep:
        raise ValueError(
            f"only {len(shown)} of the {keep} words that must show fit in {end - start} bytes"
        )
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(payload)
    return shown
