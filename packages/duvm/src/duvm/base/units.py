"""Parsing of sizes and addresses given on the command line or in config files."""

from __future__ import annotations

import ipaddress
import re

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512M', '1G', '4096', '1.5GiB' -> bytes (binary units). Raises ValueError with the input."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 2G)")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"size is not a whole number of bytes: {text!r}")
    return int(value)


def parse_hostport(
    text: str, default_port: int | None = None, *, allow_zero: bool = False
) -> tuple[str, int]:
    """'host:port', '[::1]:port' or 'host' (with a default port) -> (host, port).

    Port 0 is refused unless `allow_zero` (an address to listen on, where 0 lets the kernel
    pick a free port)."""
    text = text.strip()
    host, port_text = text, None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"bad address {text!r}: unclosed '['")
        host, rest = text[1:end], text[end + 1 :]
        if rest.startswith(":"):
            port_text = rest[1:]
        elif rest:
            raise ValueError(f"bad address {text!r}")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if port_text is None:
        if default_port is None:
            raise ValueError(f"address {text!r} needs a port (HOST:PORT)")
        return host, default_port
    if not port_text.isdigit() or not (0 if allow_zero else 1) <= int(port_text) < 65536:
        raise ValueError(f"bad port in {text!r}")
    if not host:
        raise ValueError(f"address {text!r} has no host")
    return host, int(port_text)


TRANSPORTS = ("tcp", "rdma", "auto")


def parse_peer(text: str, default_port: int | None = None) -> tuple[str, int, str]:
    """A memserver address, '[tcp|rdma|auto://]HOST:PORT' -> (host, port, transport).

    No scheme is TCP. "rdma" moves pages by RDMA or not at all; "auto" by RDMA when both ends
    can, else by TCP (saying why)."""
    transport, sep, rest = text.strip().partition("://")
    if not sep:
        transport, rest = "tcp", text
    elif transport.lower() not in TRANSPORTS:
        raise ValueError(
            f"bad peer {text!r}: unknown transport {transport!r} (use {', '.join(TRANSPORTS)})"
        )
    host, port = parse_hostport(rest, default_port)
    return host, port, transport.lower()


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT to listen on; unlike a peer address, port 0 (pick a free one) is allowed."""
    return parse_hostport(text, allow_zero=True)


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (only local processes can connect there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
