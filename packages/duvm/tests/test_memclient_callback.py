"""The callback fast path's stand-in for a Future (`memclient_replies.Callback`) and its
compiled twin (`duvm.store._replies.Callback`): the same behaviour, held to one list of
checks. Without the compiled module its runs skip, except where DUVM_REQUIRE_COMPILED=1 (CI)
makes that a failure."""

from __future__ import annotations

import importlib
import logging
import os

import pytest
from duvm.base import accel
from duvm.store import memclient_replies
from duvm.store.memserver_errors import MemserverUnreachable

BUILT = accel.state("duvm.store._replies")
if BUILT != "compiled" and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")


@pytest.fixture(
    params=[
        "pure",
        pytest.param(
            "compiled",
            marks=pytest.mark.skipif(BUILT != "compiled", reason=f"compiled: {BUILT}"),
        ),
    ]
)
def callback(request) -> type:
    if request.param == "pure":
        return memclient_replies.Callback
    return importlib.import_module("duvm.store._replies").Callback


def test_completion_calls_the_function_once_with_the_outcome(callback) -> None:
    """Catches a callback that reports done before it ran, or passes the reply object
    instead of None (the callers treat anything but None as a failure)."""
    seen: list[object] = []
    ok = callback(seen.append)
    assert ok.done() is False and seen == []
    ok.set_result("the reply")
    assert ok.done() is True and seen == [None]
    err = MemserverUnreachable("gone")
    bad = callback(seen.append)
    bad.set_exception(err)
    assert bad.done() is True and seen == [None, err]


def test_a_failing_function_is_logged_not_raised(callback, caplog) -> None:
    """Catches an exception escaping into the receive path, where it would stop the other
    replies of the same read from being delivered."""

    def broken(_: object) -> None:
        raise ValueError("caller bug")

    cb = callback(broken)
    with caplog.at_level(logging.ERROR, logger="duvm.store.memclient_replies"):
        cb.set_result(None)
    assert cb.done() is True
    assert "memserver request callback failed" in caplog.text and "caller bug" in caplog.text


def test_the_client_takes_the_chosen_type(monkeypatch) -> None:
    monkeypatch.setenv(accel.ENV, "1")
    assert memclient_replies.callback_type() is memclient_replies.Callback
    monkeypatch.delenv(accel.ENV)
    if BUILT == "compiled":
        assert memclient_replies.callback_type().__module__ == "duvm.store._replies"
