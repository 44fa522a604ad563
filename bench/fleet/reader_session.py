"""A reader process for the lease-reclamation benchmark: one broker engine session, nothing else.

    python -m bench.fleet.reader_session --broker ADDR --engine-id R --like P --ttl-ms 1000

It registers engine R with the broker under the same layout and topology as
engine P (copied from the broker's engine list, so P may hold blocks for R),
keeps its session alive with the real client library (heartbeats at TTL/3),
prints `ready` and then waits to be killed. The broker cannot tell it from a
vLLM reader's scheduler: both are one session stream. It lets the benchmark
repeat "kill -9 the reader" many times without paying a vLLM start-up (a
minute or more on a shared 2-core machine) per repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb


async def run(broker: str, engine_id: str, like: str, ttl_ms: int) -> None:
    async with AsyncBrokerClient(broker) as client:
        engines = (await client.list_engines()).engines
    model = next((e for e in engines if e.engine_id == like), None)
    if model is None:
        raise SystemExit(f"engine {like!r} is not registered with the broker at {broker}")
    info = pb.EngineInfo(engine_id=engine_id, labels={"role": "decode", "bench": "reader_session"})
    info.layout.CopyFrom(model.layout)
    session = EngineSession(broker, info, ttl_ms=ttl_ms)
    await session.start(wait_connected_s=30)
    print("ready", flush=True)
    await asyncio.Event().wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--like", required=True, help="engine whose layout this reader copies")
    ap.add_argument("--ttl-ms", type=int, required=True)
    args = ap.parse_args()
    asyncio.run(run(args.broker, args.engine_id, args.like, args.ttl_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
