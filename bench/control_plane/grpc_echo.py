"""The two grpc.aio floors: a minimal unary echo and a bidi ping-pong stream (a separate server process).

Both echo a kvbroker.v1 ResolveRequest carrying 64 fixed64 hashes, so the bytes on
the wire match a resolve call and the figure is the cost of gRPC itself in Python:
no lookup happens. Run as ``python -m bench.control_plane.grpc_echo --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc

from kvbroker.v1 import broker_pb2 as pb


async def _unary(request: pb.ResolveRequest, context: grpc.aio.ServicerContext) -> pb.ResolveRequest:
    return request


async def _stream(
    requests: AsyncIterator[pb.ResolveRequest], context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.ResolveRequest]:
    async for r in requests:
        yield r


def _handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(
                _unary,
                request_deserializer=pb.ResolveRequest.FromString,
                response_serializer=pb.ResolveRequest.SerializeToString,
            ),
            "Stream": grpc.stream_stream_rpc_method_handler(
                _stream,
                request_deserializer=pb.ResolveRequest.FromString,
                response_serializer=pb.ResolveRequest.SerializeToString,
            ),
        },
    )


async def serve(port: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop  # the broker runs on uvloop, so the floor does too

        uvloop.run(serve(args.port))
    except ImportError:
        asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
