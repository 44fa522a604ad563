"""`python -m kvbroker.clients.proxy`: run the P/D proxy until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from kvbroker.clients.proxy.config import ProxyConfig, build_parser, config_from_args
from kvbroker.clients.proxy.server import RUNNER_OPTIONS, build_app
from kvbroker.clients.proxy.tracing import setup_tracing
from kvbroker.common.open_files import raise_open_files_limit
from kvbroker.common.telemetry import TelemetryError


async def run(config: ProxyConfig) -> None:
    provider = setup_tracing(config.otlp_endpoint)
    app = build_app(config)
    runner = web.AppRunner(app, **RUNNER_OPTIONS)
    await runner.setup()
    # aiohttp's default queue of 128 made 2,000 clients connecting at once (a load generator's
    # start) wait a second each for 6-8% of them; vLLM's own server queues 2,048.
    site = web.TCPSite(runner, config.host, config.port, backlog=config.backlog)
    await site.start()
    engines = ", ".join(f"{e.role}={e.url}" for e in config.engines) or "from the broker"
    print(
        f"kvbroker proxy listening on http://{config.host}:{config.port} "
        f"(engines: {engines}; broker: {config.broker or 'none'})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if provider is not None:
        provider.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    raise_open_files_limit()  # one descriptor per client connection and per engine connection
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(run(config))
    except TelemetryError as err:
        print(f"kvbroker-proxy: invalid configuration: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
