"""``gputaskman fleet HOST[:PORT]... | --hosts FILE``: every host's ``gputaskman serve`` in one
view: the TUI (`tui.fleet_app`), ``--once`` (text), ``--json`` (one fleet document), or
``fleet record FILE HOST...`` (one fleet document per round, JSON Lines).

The hosts are polled by `fleet.poller` (concurrently, per-host timeout and backoff); the
token (``--token-file``, the same 0600 file `serve` reads) is sent to every host, and
``https://`` hosts are reached over TLS, verified against ``--tls-ca`` and presenting
``--tls-cert``/``--tls-key`` when their serve asks for a client certificate. Nothing is
ever sent to a host but ``GET /snapshot.json``.

``--once`` and ``--json`` wait until every host has answered or failed once (at most the
poll timeout), print, and exit 0 whatever the hosts' states: the output says each one.
Without a terminal on stdout, the default is ``--once``. With ``--prometheus``, a server that
does not answer, or a ``--job`` it scrapes no target of (the message names its jobs), is one
line on stderr and exit 1. Polled directly, only the TUI reads
the table's part of each host's document (and the open host's whole); the others read every
document whole, so ``--once`` and ``--json`` agree on which hosts are up.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from pathlib import Path

from gputaskman.base.argtypes import positive_count, positive_seconds
from gputaskman.fleet.output import FleetRecorder, fleet_document
from gputaskman.fleet.poller import DEFAULT_BACKOFF_MAX, DEFAULT_TIMEOUT, Poller
from gputaskman.fleet.promapi import PromClient, PromError, exposure_refusal
from gputaskman.fleet.promfleet import DEFAULT_JOB, PromFleet
from gputaskman.fleet.source import FleetSource
from gputaskman.fleet.targets import Target, TargetError, parse_targets, read_hosts_file
from gputaskman.fleet.view import render_text
from gputaskman.offline.record import (
    FLEET_LINE_PREFIX,
    RecordError,
    RecordResult,
    open_record,
    stop_signals,
)
from gputaskman.serve.httpauth import TokenError, read_token

DEFAULT_INTERVAL = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "targets",
        nargs="*",
        metavar="HOST[:PORT]",
        help="hosts running gputaskman serve (port 9835 unless given; https://HOST:PORT for "
        "TLS); 'record FILE HOST...' appends one fleet document per round to FILE",
    )
    p.add_argument("--hosts", type=Path, metavar="FILE", help="hosts, one per line (# comments)")
    p.add_argument(
        "--token-file", type=Path, metavar="FILE", help="bearer token for every host (mode 0600)"
    )
    p.add_argument(
        "--interval",
        dest="fleet_interval",
        type=positive_seconds,
        default=None,
        metavar="S",
        help=f"seconds between polls of a host (default {DEFAULT_INTERVAL:g})",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds one poll may take, connect included (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument(
        "--backoff-max",
        type=positive_seconds,
        default=DEFAULT_BACKOFF_MAX,
        metavar="S",
        help="longest wait between tries of a failing host (default "
        f"{DEFAULT_BACKOFF_MAX:g}; the wait doubles from the interval)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print the fleet as text and exit")
    mode.add_argument(
        "--json", dest="fleet_json", action="store_true", help="print one fleet document"
    )
    p.add_argument("--count", type=positive_count, metavar="N", help="record: stop after N rounds")
    p.add_argument(
        "--duration", type=positive_seconds, metavar="S", help="record: stop after S seconds"
    )
    p.add_argument("--tls-ca", type=Path, metavar="FILE", help="CA that signed the hosts' certs")
    p.add_argument("--tls-cert", type=Path, metavar="FILE", help="client certificate (TLS)")
    p.add_argument("--tls-key", type=Path, metavar="FILE", help="the client certificate's key")
    prom = p.add_argument_group(
        "reading the fleet from Prometheus",
        "every host Prometheus scrapes for the job, from its HTTP API (instant queries), "
        "instead of polling each host; --token-file and --tls-* still reach a host's own "
        "serve when you open it in the TUI",
    )
    prom.add_argument(
        "--prometheus",
        metavar="URL",
        help="Prometheus's URL, e.g. http://prometheus:9090 (off loopback it needs "
        "--prometheus-token-file or https:// with a client certificate)",
    )
    prom.add_argument(
        "--job",
        default=DEFAULT_JOB,
        help=f"the scrape job of the gputaskman serve hosts (default {DEFAULT_JOB}; one "
        "Prometheus scrapes no target of is an error naming the jobs it has)",
    )
    prom.add_argument(
        "--prometheus-token-file",
        type=Path,
        metavar="FILE",
        help="bearer token for Prometheus (mode 0600)",
    )
    prom.add_argument("--prometheus-ca", type=Path, metavar="FILE", help="CA of Prometheus's cert")
    prom.add_argument(
        "--prometheus-cert", type=Path, metavar="FILE", help="client certificate for Prometheus"
    )
    prom.add_argument("--prometheus-key", type=Path, metavar="FILE", help="its key")


class UsageError(Exception):
    pass


def targets_of(texts: list[str], hosts_file: Path | None) -> list[Target]:
    entries = [(f"argument {i + 1}", t) for i, t in enumerate(texts)]
    if hosts_file is not None:
        entries += read_hosts_file(hosts_file)
    if not entries:
        raise UsageError("name at least one HOST[:PORT], or --hosts FILE")
    return parse_targets(entries)


def client_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    return _tls(args.tls_ca, args.tls_cert, args.tls_key, "--tls")


def _tls(ca: Path | None, cert: Path | None, key: Path | None, flag: str) -> ssl.SSLContext | None:
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise UsageError(f"{flag}-cert and {flag}-key go together")
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert is not None:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot use the TLS files: {exc}") from None
    return ctx


def make_prometheus(args: argparse.Namespace, table_only: bool) -> PromFleet:
    """The fleet from Prometheus (``--prometheus URL``), or `UsageError` / `PromError`;
    `table_only`: read only the series the fleet table shows (the TUI and ``--once``)."""
    tls = _tls(args.prometheus_ca, args.prometheus_cert, args.prometheus_key, "--prometheus")
    token = None
    if args.prometheus_token_file is not None:
        token = read_token(args.prometheus_token_file)
    client = PromClient(args.prometheus, token=token, tls=tls, timeout=args.timeout)
    refusal = exposure_refusal(client.endpoint, token is not None, args.prometheus_cert is not None)
    if refusal is not None:
        raise UsageError(refusal)
    if not args.job:
        raise UsageError("--job names the scrape job of the hosts: give one (default gputaskman)")
    return PromFleet(
        client,
        job=args.job,
        interval=args.fleet_interval or DEFAULT_INTERVAL,
        token=None if args.token_file is None else read_token(args.token_file),
        tls=client_tls(args),
        table_only=table_only,
    )


def make_poller(
    args: argparse.Namespace, targets: list[Target], table_only: bool = False
) -> Poller:
    token = None if args.token_file is None else read_token(args.token_file)
    return Poller(
        targets,
        interval=args.fleet_interval or DEFAULT_INTERVAL,
        timeout=args.timeout,
        token=token,
        tls=client_tls(args),
        backoff_max=args.backoff_max,
        table_only=table_only,
    )


def run(args: argparse.Namespace) -> int:
    texts = list(args.targets)
    record_to = None
    if texts and texts[0] == "record":
        if len(texts) < 2:
            print("gputaskman fleet record: name the FILE to append to", file=sys.stderr)
            return 2
        record_to, texts = Path(texts[1]), texts[2:]
    whole = args.fleet_json or record_to is not None  # they write every document out
    try:
        if args.prometheus is not None:
            if texts or args.hosts is not None:
                raise UsageError("--prometheus reads the hosts from Prometheus: name no HOST")
            poller: FleetSource = make_prometheus(args, table_only=not whole)
        else:
            # each host's document read whole but in the TUI (one round costs little): a host
            # whose whole document is refused is not "up" in --once where --json refuses it
            tui = not (whole or args.once or not sys.stdout.isatty())
            poller = make_poller(args, targets_of(texts, args.hosts), table_only=tui)
    except (UsageError, TargetError, TokenError, PromError) as exc:
        print(f"gputaskman fleet: {exc}", file=sys.stderr)
        return 2
    if record_to is not None:
        return _record(args, poller, record_to)
    if args.fleet_json or args.once or not sys.stdout.isatty():
        return _once(args, poller)
    return _tui(args, poller)


def _once(args: argparse.Namespace, poller: FleetSource) -> int:
    poller.start()
    try:
        poller.wait_polled(poller.timeout * 4 + 1.0)  # Prometheus: a few queries in a round
        states = poller.states()
        error = poller.error
    finally:
        poller.stop()
    if error is not None:
        print(f"gputaskman fleet: {error}", file=sys.stderr)
        return 1
    if args.fleet_json:
        doc = fleet_document(states, interval=poller.interval, timeout=poller.timeout)
        sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    else:
        sys.stdout.write(render_text(states))
    return 0


def _tui(args: argparse.Namespace, poller: FleetSource) -> int:
    from gputaskman.tui.fleet_app import FleetApp

    app = FleetApp(poller)
    poller.start()
    try:
        app.run()
    finally:
        poller.stop()
    return int(app.return_code or 0)


def _record(args: argparse.Namespace, poller: FleetSource, path: Path) -> int:
    err = sys.stderr
    try:
        fd = open_record(path, FLEET_LINE_PREFIX)
    except RecordError as exc:
        print(f"gputaskman fleet record: {exc}", file=err)
        return 2
    err.write(
        f"recording {poller.origin or f'{len(poller.targets)} hosts'} to {path} every "
        f"{poller.interval:g}s "
        "(Ctrl+C stops)\n"
    )
    err.flush()
    result = RecordResult(stopped_by="interrupt")
    with stop_signals():
        try:
            poller.start()
            recorder = FleetRecorder(
                fd, poller, interval=poller.interval, count=args.count, duration=args.duration
            )
            result = recorder.run()
        except KeyboardInterrupt:
            pass
        finally:
            poller.stop()
            try:
                os.fsync(fd)
            except OSError:
                pass  # the lines are written; a failed flush to disk is not worth a traceback
            finally:
                os.close(fd)
    err.write(f"recorded {result.samples} rounds to {path}\n")
    if result.stopped_by == "error":
        print(f"gputaskman fleet record: {result.errors[-1]}", file=err)
        return 1
    return 0
