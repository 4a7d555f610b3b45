"""``gputaskman serve --listen ADDR:PORT``: the command line of `serve.server` (Prometheus
metrics of this machine's GPUs, and its snapshot document for `gputaskman fleet`): its flags,
their checks, and the source they name (this machine, or ``--demo`` / ``--replay``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gputaskman.serve import server, sources
from gputaskman.serve.httpauth import MAKE_TOKEN, TokenError

DEFAULT_LISTEN = "127.0.0.1:9835"


def parse_listen(text: str) -> tuple[str, int]:
    """ADDR:PORT (IPv6 as [ADDR]:PORT; port 0 picks a free one) -> (addr, port)."""
    host, sep, port_s = text.strip().rpartition(":")
    if not sep or not port_s.isdigit():
        raise argparse.ArgumentTypeError(f"not ADDR:PORT: {text!r}")
    port = int(port_s)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=parse_listen,
        default=parse_listen(DEFAULT_LISTEN),
        metavar="ADDR:PORT",
        help=f"where to serve /metrics and /snapshot.json (default {DEFAULT_LISTEN}; port 0 "
        "picks a free one; off loopback a token or TLS client certificates are required)",
    )
    parser.add_argument(
        "--sample-interval",
        dest="serve_interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between samples (default: --interval, the TUI's refresh)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="require 'Authorization: Bearer TOKEN' with the token in FILE (mode 0600; make "
        f"one with: {MAKE_TOKEN})",
    )
    parser.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="serve HTTPS with this certificate"
    )
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="the certificate's key")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="require a client certificate signed by this CA (with --tls-cert)",
    )
    # The hidden source flags (demos and tests; the default samples this machine). Not a
    # mutually exclusive group: Python 3.11's argparse fails an assertion formatting the usage
    # of a group of hidden options (`serve --listen nope` crashed); `run` refuses both at once.
    parser.add_argument("--demo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replay", metavar="FILE", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from gputaskman.cli import _collector
    from gputaskman.document.reader import SnapshotError
    from gputaskman.sampling.collector import SCAN_BUDGET

    logging.basicConfig(level=logging.WARNING, format="gputaskman serve: %(message)s")
    interval = args.serve_interval if args.serve_interval is not None else args.interval or 1.0
    if not interval > 0:
        print("gputaskman serve: --sample-interval must be positive", file=sys.stderr)
        return 2
    host, port = args.listen
    try:
        token, tls = server.security(
            args.token_file, args.tls_cert, args.tls_key, args.tls_client_ca
        )
    except TokenError as e:
        print(f"gputaskman serve: {e}", file=sys.stderr)
        return 2
    refusal = server.exposure_refusal(host, token is not None, args.tls_client_ca is not None)
    if refusal:
        print(f"gputaskman serve: {refusal}", file=sys.stderr)
        return 2
    if args.demo and args.replay:
        print("gputaskman serve: --demo and --replay name two sources: give one", file=sys.stderr)
        return 2
    try:
        factory = sources.source_factory(
            lambda: _collector(args, SCAN_BUDGET), args.gpu, args.demo, args.replay
        )
    except (OSError, SnapshotError) as e:
        print(f"gputaskman serve: --replay: {e}", file=sys.stderr)
        return 2
    try:
        running = server.start(
            factory, interval, host, port, selected_gpu=args.gpu, token=token, tls=tls
        )
    except OSError as e:
        print(
            f"gputaskman serve: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr
        )
        return 1
    running.stop_on_signals()
    bound_host, bound_port = running.address()
    scheme = "https" if tls is not None else "http"
    guard = ", bearer token required" if token else ""
    if args.tls_client_ca is not None:
        guard += ", client certificate required"
    print(
        f"gputaskman serving {scheme}://{server.url_host(bound_host)}:{bound_port}/metrics and "
        f"/snapshot.json (sampling every {interval:g} s, scan budget "
        f"{SCAN_BUDGET * 1000:.0f} ms{guard})",
        flush=True,
    )
    running.wait()
    return 0
