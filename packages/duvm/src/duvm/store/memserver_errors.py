"""What a failed memserver request raises: the memserver refused it (`PageServerError`, with
the protocol's error code and its errno), or it could not be reached (`MemserverUnreachable`)."""

from __future__ import annotations

from duvm.wire import pageproto as pp


class PageServerError(Exception):
    """The memserver refused a request (full, absent page, bad version ...)."""

    def __init__(self, code: pp.ErrorCode, message: str, peer: str = "") -> None:
        super().__init__(f"memserver {peer}: {code.name}: {message}" if peer else message)
        self.code = code
        self.errno = code.to_errno()
        self.message = message


class MemserverUnreachable(ConnectionError):
    """The memserver cannot be reached or the connection broke and could not be restored."""
