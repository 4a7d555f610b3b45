"""Which addresses are this machine's own: `serve` refuses to listen off loopback without
authentication, and the fleet refuses to read a Prometheus off loopback without it."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for a loopback address or "localhost"; a name that is not an address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
