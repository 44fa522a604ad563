"""CPU of one lease-end notice between replicas, both ends, in process: the format replicas send
now (the session's message encoded once, protobuf in base64) against the one they sent before
(the ended lease as JSON fields, rebuilt into a Lease and encoded by the replica serving the
session; still read from older replicas). An 8-block lease, as in `bench.scale.lease_cpu`.

    python -m bench.scale.notice_codec          # writes bench/results/notice_codec.json
"""

from __future__ import annotations

import argparse
import json
import time
from base64 import b64decode, b64encode
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.output import load_note, log, write_json
from kvbroker.broker import codec
from kvbroker.broker.channels import ended_down
from kvbroker.broker.fleet.notify import _ended_lease
from kvbroker.broker.leases import Lease, packed_block_ids, packed_hashes
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from kvbroker.v1 import broker_pb2 as pb


def _lease() -> Lease:
    lease = Lease(
        "3f9a0c1d2e4b-1a2b", "prefill-0", "decode-0", Namespace("a" * 16, ""), Tier.GPU,
        packed_hashes(range(2**60, 2**60 + 8)), packed_block_ids(range(100, 108)),
        LeaseState.RELEASED, 30.0, 0.0,
    )  # fmt: skip
    lease.epoch, lease.cause = 3, RevokeCause.NONE
    return lease


def _fields(lease: Lease) -> dict[str, Any]:
    """The JSON fields replicas sent before (the baseline)."""
    ns = lease.namespace
    return {
        "h": lease.holder, "r": lease.reader, "ns": [ns.layout_id, ns.tenant], "t": int(lease.tier),
        "bh": list(lease.block_hashes), "bi": list(lease.block_ids), "st": int(lease.state),
        "ep": lease.epoch, "c": int(lease.cause), "d": lease.detail, "q": lease.request_id,
    }  # fmt: skip


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    started = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - started) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5, help="the median of these is printed")
    ap.add_argument("--out-dir", default="", help="write notice_codec.json here instead of bench/results")
    args = ap.parse_args()
    lease, now = _lease(), time.time()
    head = {
        "k": "ended",
        "s": "9648ba90a87c5ff8669a1244e8e3cc30",
        "rep": "3f9a0c1d2e4b",
        "lease": lease.lease_id,
    }
    old_body = json.dumps({**head, "ended": _fields(lease)})
    new_body = json.dumps({**head, "down": b64encode(ended_down(lease, now).SerializeToString()).decode()})

    def old_send() -> object:
        return json.dumps({**head, "ended": _fields(lease)})

    def old_receive() -> object:
        msg = json.loads(old_body)
        ended = _ended_lease(msg["lease"], msg["ended"])
        return pb.SessionDown(lease_ended=pb.LeaseEnded(lease=codec.lease_pb(ended, now)))

    def new_send() -> object:
        return json.dumps({**head, "down": b64encode(ended_down(lease, now).SerializeToString()).decode()})

    def new_receive() -> object:
        return pb.SessionDown.FromString(b64decode(json.loads(new_body)["down"], validate=True))

    cases = {
        "json fields (before)": (old_send, old_receive),
        "encoded message (now)": (new_send, new_receive),
    }
    result: dict[str, Any] = {"settings": vars(args), "bytes": {}, "us": {}}
    for (name, (send, receive)), body in zip(cases.items(), (old_body, new_body), strict=True):
        sends = sorted(_per_call_us(send, args.calls) for _ in range(args.rounds))
        receives = sorted(_per_call_us(receive, args.calls) for _ in range(args.rounds))
        s, r = sends[len(sends) // 2], receives[len(receives) // 2]
        result["us"][name] = {"send": s, "receive": r, "both": s + r}
        result["bytes"][name] = len(body)
        print(f"{name}: send {s:.1f} us, receive {r:.1f} us, both {s + r:.1f} us, {len(body)} bytes")
    result["load"] = load_note()
    print(f"(median of {args.rounds} rounds of {args.calls:,} calls; load average: {result['load']})")
    log(f"wrote {write_json('notice_codec', result, Path(args.out_dir) if args.out_dir else None)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
