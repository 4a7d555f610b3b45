"""The C library, loaded once for the few calls Python does not wrap (mlockall, prctl, mount,
umount2, mlock). `errno` is kept per call (`use_errno`), read with `ctypes.get_errno()`."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def libc() -> ctypes.CDLL:
    """OSError where no C library can be loaded."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
