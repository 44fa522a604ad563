"""The ``kvbroker`` operator commands: each asks the broker once (``watch``: a stream)
and prints what it answered, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from kvbroker.clients import errors
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.model import EVENT_FED, is_event_fed
from kvbroker.tools.cli_render import (
    cause_name,
    event_line,
    format_table,
    lease_state,
    print_json,
    seconds,
    tier_name,
    to_json,
)
from kvbroker.v1 import broker_pb2 as pb


def exactness_name(value: int) -> str:
    """exact, lagging or degraded ("-": a broker that does not say)."""
    return pb.IndexExactness.Name(value).removeprefix("INDEX_").lower() if value else "-"  # type: ignore[arg-type]


def cmd_engines(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.list_engines(layout_id=args.layout_id)
    if args.json:
        print_json([to_json(e) for e in response.engines], out)
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
                exactness_name(e.exactness),
                e.active_leases_held,
                e.active_leases_read,
                f"{e.load:g}",
                "-" if is_event_fed(e.labels) else seconds(e.session_ttl_ms),
                EVENT_FED if is_event_fed(e.labels) else "connector",
                labels,
            ]
        )
    headers = ["ENGINE", "STATE", "LAYOUT", "MODEL", "RANKS", "GPU_BLOCKS", "CPU_BLOCKS", "INDEX"]
    headers += ["HOLDS", "READS", "LOAD", "TTL", "SOURCE", "LABELS"]
    print(format_table(headers, rows), file=out)
    print(f"{len(rows)} engine(s)", file=out)
    return 0


def cmd_leases(client: BrokerClient, args: argparse.Namespace, out: TextIO) -> int:
    response = client.list_leases(engine_id=args.engine, include_ended=args.all)
    if args.json:
        print_json([to_json(lease) for lease in response.leases], out)
        return 0
    rows = [
        [
            lease.lease_id,
            lease_state(lease.state),
            lease.holder_engine_id,
            lease.reader_engine_id or "-",
            tier_name(lease.tier),
            len(lease.block_hashes),
            seconds(lease.ttl_ms)
            if lease.state in (pb.LEASE_PENDING, pb.LEASE_HELD, pb.LEASE_ACTIVE)
            else "-",
            lease.epoch,
            cause_name(lease.cause),
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
        print_json(to_json(response), out)
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
        print_json(to_json(response), out)
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
        print_json(to_json(response), out)
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
                print(event_line(event), file=out, flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    except KeyboardInterrupt:
        pass
    return 0


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
        require_exact=args.require_exact,
        order=pb.SCORE_ORDER_PLACEMENT if args.placement else pb.SCORE_ORDER_PREFIX,
    )
    if args.tokens is not None:
        request.token_ids.extend(_int_list(args.tokens, "--tokens"))
    else:
        request.block_hashes.extend(_int_list(args.hashes, "--hashes"))
    response = client.score(request)
    if args.json:
        print_json(to_json(response), out)
        return 0
    total = response.total_blocks
    # Event-fed engines (known from vLLM's KV events) are routed to, never pulled from: say which.
    event_fed = {e.engine_id for e in client.list_engines().engines if is_event_fed(e.labels)}
    rows = [
        [
            s.engine_id,
            s.gpu_blocks,
            s.cpu_blocks,
            f"{max(s.gpu_blocks, s.cpu_blocks) / total:.0%}" if total else "-",
            f"{s.load:g}",
            "yes" if s.draining else "no",
            EVENT_FED if s.engine_id in event_fed else "connector",
            exactness_name(s.exactness),
            *([f"{s.predicted_cost:.0f}"] if args.placement else []),
        ]
        for s in response.scores
    ]
    headers = ["ENGINE", "GPU_BLOCKS", "CPU_BLOCKS", "PREFIX", "LOAD", "DRAINING", "SOURCE", "INDEX"]
    print(format_table(headers + (["COST"] if args.placement else []), rows), file=out)
    print(f"{total} full block(s) of {response.block_size} tokens in the prompt", file=out)
    if args.placement:
        print(f"placement: {response.placement_reason}: {response.placement_detail}", file=out)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbroker.broker import server  # the broker's own dependencies load only for `serve`

    return server.serve_main(args)
