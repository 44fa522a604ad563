"""A stand-alone engine process for the process-level tests.

It opens an EngineSession to the broker and prints one JSON object per line
on stdout for everything that happens, so a test can kill it (kill -9 or
SIGSTOP) at a known point:

  --role reader   register, then read lease ids from stdin and acquire each
  --role holder   register, announce --blocks hashes, hold them (no reader yet)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def engine_info(engine_id: str) -> pb.EngineInfo:
    return builders.engine_info(engine_id, ranks=1, agent_name="{engine_id}-agent")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--role", choices=["reader", "holder"], required=True)
    parser.add_argument("--ttl-ms", type=int, default=2_000)
    parser.add_argument("--blocks", default="1,2,3")
    args = parser.parse_args()

    session = EngineSession(
        args.broker,
        engine_info(args.engine_id),
        ttl_ms=args.ttl_ms,
        on_revoked=lambda m: say("revoked", lease_id=m.lease.lease_id, cause=pb.RevokeCause.Name(m.cause)),
        on_lease_ended=lambda m: say("lease_ended", lease_id=m.lease.lease_id),
    )
    await session.start(wait_connected_s=10.0)
    say("registered", layout_id=session.layout_id, ttl_ms=session.registered.session_ttl_ms)
    if args.role == "holder":
        hashes = [int(h) for h in args.blocks.split(",")]
        session.announce_stored((session.layout_id, ""), pb.TIER_GPU, hashes)
        session.flush()
        lease = await session.hold(
            (session.layout_id, ""), pb.TIER_GPU, hashes, list(range(len(hashes))), 60_000
        )
        say("held", lease_id=lease.lease_id)
        await asyncio.Event().wait()
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        lease_id = line.strip()
        response = await session.acquire(lease_id, ttl_ms=60_000)
        say("acquired", lease_id=lease_id, state=pb.LeaseState.Name(response.lease.state))
    await session.close()


if __name__ == "__main__":
    asyncio.run(main())
