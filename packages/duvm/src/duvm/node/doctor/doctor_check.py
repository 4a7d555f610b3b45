"""What a `duvm doctor` check returns (`Check`, with one of the statuses below) and what the
checks are asked about (`Options`: the config's peers, method and daemon flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PEER_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    required: bool
    detail: str
    fix: str | None = None


@dataclass
class Options:
    peers: list[str] = field(default_factory=list)
    method: str = "auto"
    secret_file: Path | None = None
    config_error: str | None = None
    config_path: Path | None = None
    peer_timeout: float = PEER_TIMEOUT_S
    # the config's daemon_args: security flags (--secret-file, --tls-*, --insecure), --no-realtime
    daemon_args: list[str] = field(default_factory=list)


def verdict(name: str, problem: bool, required: bool, detail: str, fix: str | None = None) -> Check:
    """OK when there is no problem; else FAIL for a required check, WARN for another."""
    if not problem:
        return Check(name, OK, required, detail)
    return Check(name, FAIL if required else WARN, required, detail, fix)
