"""The ``kvbroker`` command: run the broker and look into a running one.

Every command except ``serve`` talks to the broker named by ``--broker``
(default ``$KVBROKER_ADDR`` or 127.0.0.1:50051) and prints an aligned table,
or JSON with ``--json``. Errors print one line naming the gRPC status and
exit non-zero (see ``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from kvbroker.clients import errors
from kvbroker.clients.aio import DEFAULT_ADDRESS
from kvbroker.clients.sync import BrokerClient
from kvbroker.v1 import broker_pb2 as pb

ADDRESS_ENV = "KVBROKER_ADDR"

# Exit status per error class (first match wins, so subclasses come first).
EXIT_CODES: tuple[tuple[type[errors.BrokerError], int], ...] = (
    (errors.Unavailable, 3),
    (errors.DeadlineExceeded, 3),
    (errors.NotFound, 4),
    (errors.FailedPrecondition, 5),
    (errors.InvalidArgument, 6),
    (errors.OutOfRange, 6),
    (errors.BrokerError, 1),
)
EXIT_USAGE = 2

TIER_NAMES: dict[int, str] = {pb.TIER_UNSPECIFIED: "-", pb.TIER_GPU: "GPU", pb.TIER_CPU: "CPU"}


def exit_code_of(err: errors.BrokerError) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(err, cls):
            return code
    return 1


# -- output ----------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    text_rows = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    numeric = [all(_is_number(row[i]) for row in text_rows) and bool(text_rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in text_rows)])


def _is_number(cell: str) -> bool:
    """Numbers, percentages and durations ("12", "25%", "10.0s") line up on the right."""
    try:
        float(cell.removesuffix("%").removesuffix("s"))
    except ValueError:
        return False
    return True


def to_json(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


def _print_json(value: Any, out: TextIO) -> None:
    print(json.dumps(value, indent=2, sort_keys=True), file=out)


def _tier(t: int) -> str:
    return TIER_NAMES.get(t, str(t))


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.1f}s"


def _lease_state(state: int) -> str:
    return pb.LeaseState.Name(state).removeprefix("LEASE_").lower()  # type: ignore[arg-type]


def _cause(cause: int) -> str:
    if cause == pb.REVOKE_CAUSE_UNSPECIFIED:
        return "-"
    return pb.RevokeCause.Name(cause).removeprefix("REVOKE_").lower()  # type: ignore[arg-type]


# -- commands ----------------------------------------------------------------------


def cmd_engines(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.list_engines(layout_id=args.layout_id)
    if args.json:
        _print_json([to_json(e) for e in response.engines], out)
        return 0
    rows = []
    for e in sorted(response.engines, key=lambda e: e.engine_id):
        ranks = ",".join(f"pp{r.pp_rank}/tp{r.tp_rank}" for r in e.ranks) or "-"
        labels = ",".join(f"{k}={v}" for k, v in sorted(e.labels.items())) or "-"
        rows.append(
            [
                e.engine_id,
                "draining" if e.draining else "serving",
                e.layout_id,
                e.layout.model or "-",
                ranks,
                e.blocks_gpu,
                e.blocks_cpu,
                e.active_leases_held,
                e.active_leases_read,
                f"{e.load:g}",
                _seconds(e.session_ttl_ms),
                labels,
            ]
        )
    headers = ["ENGINE", "STATE", "LAYOUT", "MODEL", "RANKS", "GPU_BLOCKS", "CPU_BLOCKS"]
    headers += ["HOLDS", "READS", "LOAD", "TTL", "LABELS"]
    print(format_table(headers, rows), file=out)
    print(f"{len(rows)} engine(s)", file=out)
    return 0


def cmd_leases(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.list_leases(engine_id=args.engine, include_ended=args.all)
    if args.json:
        _print_json([to_json(lease) for lease in response.leases], out)
        return 0
    rows = [
        [
            lease.lease_id,
            _lease_state(lease.state),
            lease.holder_engine_id,
            lease.reader_engine_id or "-",
            _tier(lease.tier),
            len(lease.block_hashes),
            _seconds(lease.ttl_ms)
            if lease.state in (pb.LEASE_PENDING, pb.LEASE_HELD, pb.LEASE_ACTIVE)
            else "-",
            lease.epoch,
            _cause(lease.cause),
            lease.namespace.tenant or "-",
            lease.request_id or "-",
        ]
        for lease in response.leases
    ]
    headers = [
        "LEASE",
        "STATE",
        "HOLDER",
        "READER",
        "TIER",
        "BLOCKS",
        "TTL",
        "EPOCH",
        "CAUSE",
        "TENANT",
        "REQUEST",
    ]
    print(format_table(headers, rows), file=out)
    live = sum(
        1 for lease in response.leases if lease.state in (pb.LEASE_PENDING, pb.LEASE_HELD, pb.LEASE_ACTIVE)
    )
    print(f"{live} live, {len(rows) - live} ended", file=out)
    return 0


def cmd_stats(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.stats()
    if args.json:
        _print_json(to_json(response), out)
        return 0
    rows: list[list[object]] = [
        ["engines", response.engines],
        ["sessions", response.sessions],
        ["namespaces", response.namespaces],
        ["blocks_indexed", response.blocks_indexed],
    ]
    rows += [[f"leases.{k}", v] for k, v in sorted(response.leases_by_state.items())]
    rows += [[f"revocations.{k}", v] for k, v in sorted(response.revocations_by_cause.items())]
    print(format_table(["STAT", "VALUE"], rows), file=out)
    return 0


def cmd_revoke(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.revoke(lease_id=args.lease_id, reason=args.reason)
    if args.json:
        _print_json(to_json(response), out)
    else:
        lease = response.lease
        print(
            f"revoked lease {lease.lease_id} (holder {lease.holder_engine_id}, "
            f"reader {lease.reader_engine_id or '-'}); both sides were told",
            file=out,
        )
    return 0


def cmd_drain(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.drain(engine_id=args.engine_id, reason=args.reason)
    if args.json:
        _print_json(to_json(response), out)
    else:
        print(
            f"engine {args.engine_id} is draining: no new holds or resolves name it; "
            f"{response.leases_revoked} lease(s) revoked",
            file=out,
        )
    return 0


def cmd_watch(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    everything = not (args.index or args.leases or args.engines)
    request = pb.WatchRequest(
        index_events=everything or args.index,
        lease_events=everything or args.leases,
        engine_events=everything or args.engines,
    )
    seen = 0
    try:
        for event in client.watch(request):
            if args.json:
                print(json.dumps(to_json(event), sort_keys=True), file=out, flush=True)
            else:
                print(_event_line(event), file=out, flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    except KeyboardInterrupt:
        pass
    return 0


def _event_line(event: pb.WatchEvent) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.time_unix)) if event.time_unix else "--:--:--"
    parts = [when, f"{event.kind:<18}", event.engine_id or "-"]
    if event.lease.lease_id:
        lease = event.lease
        parts.append(
            f"lease={lease.lease_id} {lease.holder_engine_id}->{lease.reader_engine_id or '?'} "
            f"blocks={len(lease.block_hashes)}"
        )
    if event.blocks:
        parts.append(f"blocks={event.blocks} tier={_tier(event.tier)}")
    if event.detail:
        parts.append(event.detail)
    return "  ".join(parts)


def _int_list(text: str, what: str) -> list[int]:
    """Comma or space separated integers (hashes may be 0x hex)."""
    values = []
    for item in text.replace(",", " ").split():
        try:
            values.append(int(item, 0))
        except ValueError:
            raise errors.InvalidArgument(f"{what}: {item!r} is not an integer") from None
    return values


def cmd_score(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    request = pb.ScoreRequest(
        namespace=pb.Namespace(layout_id=args.layout_id, tenant=args.tenant),
        candidates=args.candidate or [],
    )
    if args.tokens is not None:
        request.token_ids.extend(_int_list(args.tokens, "--tokens"))
    else:
        request.block_hashes.extend(_int_list(args.hashes, "--hashes"))
    response = client.score(request)
    if args.json:
        _print_json(to_json(response), out)
        return 0
    total = response.total_blocks
    rows = [
        [
            s.engine_id,
            s.gpu_blocks,
            s.cpu_blocks,
            f"{max(s.gpu_blocks, s.cpu_blocks) / total:.0%}" if total else "-",
            f"{s.load:g}",
            "yes" if s.draining else "no",
        ]
        for s in response.scores
    ]
    print(format_table(["ENGINE", "GPU_BLOCKS", "CPU_BLOCKS", "PREFIX", "LOAD", "DRAINING"], rows), file=out)
    print(f"{total} full block(s) of {response.block_size} tokens in the prompt", file=out)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbroker.broker import server  # the broker's own dependencies load only for `serve`

    return server.serve_main(args)


# -- parser ------------------------------------------------------------------------

DESCRIPTION = """\
KV cache broker for disaggregated vLLM inference.

  kvbroker serve                 run the broker (flags below `kvbroker serve --help`)
  kvbroker engines               registered engines, their blocks and leases
  kvbroker leases [--all]        live leases (and recently ended ones with --all)
  kvbroker stats                 index and lease counters
  kvbroker revoke LEASE_ID       end a lease now; holder and reader are told
  kvbroker drain ENGINE_ID       stop naming an engine and revoke its leases
  kvbroker watch                 stream index, lease and engine events
  kvbroker score --layout-id L --tokens 1,2,3   who holds the longest prefix
"""

EPILOG = """\
environment:
  KVBROKER_ADDR   broker address for the operator commands (default 127.0.0.1:50051)

exit status:
  0 ok, 1 other broker error, 2 bad usage, 3 broker unreachable or too slow,
  4 not found, 5 failed precondition (e.g. lease already ended),
  6 invalid argument or out of range
"""


def build_parser(
    serve_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbroker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--broker",
        default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        metavar="ADDR",
        help=f"broker host:port (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
    )
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="per-call timeout in seconds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The global options work after the command too (`kvbroker engines --json`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--broker", default=argparse.SUPPRESS, metavar="ADDR", help="broker host:port")
    common.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, metavar="S", help="per-call timeout"
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")

    serve = commands.add_parser(
        "serve",
        help="run the broker",
        description="Run the broker until SIGINT/SIGTERM. Every flag also reads an environment variable.",
    )
    if serve_arguments is not None:
        serve_arguments(serve)
    serve.set_defaults(handler=None)

    engines = commands.add_parser(
        "engines",
        parents=[common],
        help="list registered engines",
        description="Registered engines: state, layout, ranks, indexed blocks per tier, leases held "
        "and read, last load and session TTL.",
    )
    engines.add_argument("--layout-id", default="", help="only engines with this layout id")
    engines.set_defaults(handler=cmd_engines)

    leases = commands.add_parser(
        "leases",
        parents=[common],
        help="list leases",
        description="Live leases: who holds the blocks (HOLDER) and who reads them (READER), "
        "state, blocks, remaining TTL. With --all, recently ended leases too, with the cause "
        "(released, ttl_expired, reader_gone, holder_gone, operator, ...).",
    )
    leases.add_argument(
        "--engine", default="", metavar="ENGINE_ID", help="only leases this engine holds or reads"
    )
    leases.add_argument("--all", action="store_true", help="include recently ended leases")
    leases.set_defaults(handler=cmd_leases)

    stats = commands.add_parser(
        "stats",
        parents=[common],
        help="show index and lease counters",
        description="Engines, sessions, indexed blocks, leases by state and revocations by cause.",
    )
    stats.set_defaults(handler=cmd_stats)

    revoke = commands.add_parser(
        "revoke",
        parents=[common],
        help="revoke a lease",
        description="End a live lease now (cause: operator). The holder is told to free the blocks and "
        "the reader to discard anything it read under the lease.",
    )
    revoke.add_argument("lease_id", metavar="LEASE_ID")
    revoke.add_argument("--reason", default="", help="recorded with the lease and shown to both sides")
    revoke.set_defaults(handler=cmd_revoke)

    drain = commands.add_parser(
        "drain",
        parents=[common],
        help="drain an engine",
        description="Mark an engine as draining: the broker stops naming it as a holder, refuses new "
        "holds by it, revokes the leases it holds (cause: drain) and tells the engine.",
    )
    drain.add_argument("engine_id", metavar="ENGINE_ID")
    drain.add_argument("--reason", default="", help="sent to the engine with the drain command")
    drain.set_defaults(handler=cmd_drain)

    watch = commands.add_parser(
        "watch",
        parents=[common],
        help="stream broker events",
        description="Print index, lease and engine events as they happen (Ctrl-C to stop). "
        "Without a filter flag, all kinds.",
    )
    watch.add_argument("--index", action="store_true", help="index events (blocks stored/removed)")
    watch.add_argument("--leases", action="store_true", help="lease events (held, active, released, revoked)")
    watch.add_argument("--engines", action="store_true", help="engine events (registered, gone, draining)")
    watch.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events")
    watch.set_defaults(handler=cmd_watch)

    score = commands.add_parser(
        "score",
        parents=[common],
        help="score engines for a prompt",
        description="For a prompt (token ids, hashed by the broker with the layout's block size and "
        "hash algorithm) or a chain of block hashes: how many leading blocks each engine holds, "
        "per tier, best first.",
    )
    score.add_argument("--layout-id", required=True, help="layout id (see `kvbroker engines`)")
    score.add_argument("--tenant", default="", help="tenant / cache_salt (default: none)")
    what = score.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", help="token ids, comma or space separated")
    what.add_argument("--hashes", help="wire block hashes (fixed64, decimal or 0x hex), in chain order")
    score.add_argument(
        "--candidate", action="append", metavar="ENGINE_ID", help="score only these engines (repeatable)"
    )
    score.set_defaults(handler=cmd_score)
    return parser


def _serve_arguments() -> Callable[[argparse.ArgumentParser], None] | None:
    try:
        from kvbroker.broker import server
    except ImportError:
        return None
    return server.add_serve_arguments


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only `serve` needs the broker's modules: other commands start fast and work without them.
    wants_serve = _command_of(argv) == "serve"
    parser = build_parser(_serve_arguments() if wants_serve else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(out)
        return EXIT_USAGE
    if args.command == "serve":
        if not wants_serve or _serve_arguments() is None:
            print("kvbroker: error: the broker is not installed (broker.server missing)", file=sys.stderr)
            return 1
        return cmd_serve(args)
    try:
        with BrokerClient(args.broker, timeout=args.timeout) as client:
            return int(args.handler(client, args, out))
    except errors.BrokerError as err:
        print(f"kvbroker {args.command}: {_explain(err, args)}", file=sys.stderr)
        return exit_code_of(err)


def _command_of(argv: Sequence[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--broker")
    pre.add_argument("--timeout")
    pre.add_argument("--json", action="store_true")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    return known.command


def _explain(err: errors.BrokerError, args: argparse.Namespace) -> str:
    if isinstance(err, errors.Unavailable):
        return f"cannot reach the broker at {args.broker} ({err.message}); is `kvbroker serve` running there?"
    if isinstance(err, errors.DeadlineExceeded):
        return f"the broker at {args.broker} did not answer within {args.timeout:g} s"
    return str(err)


if __name__ == "__main__":
    sys.exit(main())
