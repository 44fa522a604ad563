"""OpenAI-compatible P/D proxy that routes with the broker's prefix scores.

`python -m kvbroker.clients.proxy --help` lists the flags. In code::

    from kvbroker.clients.proxy import RUNNER_OPTIONS, ProxyConfig, EngineSpec, build_app
    app = build_app(ProxyConfig(engines=(EngineSpec(url, "prefill"), EngineSpec(url2, "decode")),
                                broker="127.0.0.1:50051"))
    runner = aiohttp.web.AppRunner(app, **RUNNER_OPTIONS)  # as `python -m` runs it

Modules: config (flags, ProxyConfig), engines (the engine pool), routing
(tokenize, hash, Score, order), forward (P then D, retries, fallback),
server (the aiohttp app), tracing (OpenTelemetry).
"""

try:
    import aiohttp  # noqa: F401
except ImportError as exc:  # the proxy is an extra: the broker's clients do not need aiohttp
    raise ImportError("the P/D proxy needs aiohttp: pip install 'kvbroker[proxy]'") from exc

from kvbroker.clients.proxy.config import EngineSpec, ProxyConfig
from kvbroker.clients.proxy.server import RUNNER_OPTIONS, build_app

__all__ = ["RUNNER_OPTIONS", "EngineSpec", "ProxyConfig", "build_app"]
