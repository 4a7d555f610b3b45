"""What was parsed out of a file, kept per path while the file's size and mtime stay the same:
the runtime logs (llm.py) and app logs (apps.py) re-read on every model look only when they
changed, and only the bounded part a parser asks for (`read_tail`); model file headers (GGUF,
safetensors) parsed once per file version."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import BinaryIO, Generic, TypeVar

T = TypeVar("T")


def read_tail(f: BinaryIO, size: int, limit: int) -> str:
    """The last `limit` bytes of an open file of `size` bytes, as text."""
    f.seek(max(0, size - limit))
    return f.read(limit).decode("utf-8", "replace")


class ParsedFiles(Generic[T]):
    """Per path, the result of `parse(file, size)` for the file as it was when parsed. At most
    `limit` paths are kept (all are dropped when more arrive); thread-safe."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._got: dict[str, tuple[tuple[int, int], T]] = {}

    def get(self, path: str, parse: Callable[[BinaryIO, int], T]) -> T:
        """OSError when the file cannot be read."""
        st = os.stat(path)
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._got.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        with open(path, "rb") as f:
            res = parse(f, st.st_size)
        with self._lock:
            if len(self._got) >= self.limit:
                self._got.clear()
            self._got[path] = (key, res)
        return res

    def clear(self) -> None:
        with self._lock:
            self._got.clear()
