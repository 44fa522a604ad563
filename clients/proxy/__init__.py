"""OpenAI-compatible P/D proxy that routes with the broker's prefix scores.

`python -m clients.proxy --help` lists the flags. In code::

    from clients.proxy import ProxyConfig, EngineSpec, build_app
    app = build_app(ProxyConfig(engines=(EngineSpec(url, "prefill"), EngineSpec(url2, "decode")),
                                broker="127.0.0.1:50051"))

Modules: config (flags, ProxyConfig), engines (the engine pool), routing
(tokenize, hash, Score, order), forward (P then D, retries, fallback),
server (the aiohttp app), tracing (OpenTelemetry).
"""

from clients.proxy.config import EngineSpec, ProxyConfig
from clients.proxy.server import build_app

__all__ = ["EngineSpec", "ProxyConfig", "build_app"]
