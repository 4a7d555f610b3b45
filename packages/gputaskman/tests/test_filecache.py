"""filecache.ParsedFiles: a file is parsed again only when its size or mtime changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gputaskman.base.filecache import ParsedFiles, read_tail


def test_parsed_once_until_the_file_changes(tmp_path: Path) -> None:
    """Catches a cache keyed by path alone (a log that grew would keep its old answer) or no
    cache at all (every model look would re-read the log)."""
    log = tmp_path / "srv.log"
    log.write_text("one\n")
    calls: list[int] = []

    def parse(f, size: int) -> str:
        calls.append(size)
        return read_tail(f, size, 3)

    cache: ParsedFiles[str] = ParsedFiles()
    assert cache.get(str(log), parse) == "ne\n"
    assert cache.get(str(log), parse) == "ne\n" and calls == [4]
    with open(log, "a") as f:
        f.write("two\n")
    assert cache.get(str(log), parse) == "wo\n" and calls == [4, 8]
    st = log.stat()
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, touched
    cache.get(str(log), parse)
    assert calls == [4, 8, 8]


def test_bounded_and_unreadable_files_raise(tmp_path: Path) -> None:
    cache: ParsedFiles[int] = ParsedFiles(limit=2)
    for i in range(3):
        p = tmp_path / f"{i}.log"
        p.write_text("x")
        cache.get(str(p), lambda f, size: size)
    assert len(cache._got) == 1  # the third path cleared the two before it
    with pytest.raises(OSError):
        cache.get(str(tmp_path / "missing.log"), lambda f, size: size)
