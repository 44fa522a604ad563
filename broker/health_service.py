"""The standard grpc.health.v1 service, bounded like every other stream the broker serves.

grpc's own asyncio servicer answers List with UNIMPLEMENTED (and a traceback in
the log), and keeps every Watch stream, with its service name, as long as the
client leaves it open: a client opening many Watch streams with megabyte names
grew the broker by gigabytes. Here a name is an id (at most --max-id-bytes),
concurrent Watch streams are capped (--max-health-watchers), and List answers.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

from kvbroker.broker.errors import shown
from kvbroker.broker.status import abort
from kvbroker.common.causes import Cause


class HealthService(health.aio.HealthServicer):
    def __init__(self, max_watchers: int, max_name_bytes: int) -> None:
        super().__init__()
        self.max_watchers = max_watchers
        self.max_name_bytes = max_name_bytes
        self.watching = 0

    async def _known_size(self, name: str, context: grpc.aio.ServicerContext) -> None:
        size = len(name.encode())
        if size > self.max_name_bytes:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"service {shown(name)} is {size} bytes; the limit is {self.max_name_bytes} "
                f"(--max-id-bytes); the services here are {self._names()}",
                Cause.BAD_REQUEST,
                {"limit": str(self.max_name_bytes)},
            )

    def _names(self) -> str:
        return ", ".join(repr(name) for name in sorted(self._server_status))

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self._known_size(request.service, context)
        return await super().Check(request, context)  # NOT_FOUND for a service not here, as the spec says

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        await self._known_size(request.service, context)
        if self.watching >= self.max_watchers:
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watching} health Watch streams are open, the limit (--max-health-watchers); "
                "retry later, or poll with Check",
                Cause.LIMIT_REACHED,
                {"limit": str(self.max_watchers)},
            )
        self.watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watching -= 1

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._server_status.items()
            }
        )
