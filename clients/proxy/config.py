"""ProxyConfig and its command line: every flag also reads an environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine the proxy may send requests to."""

    url: str  # base URL of the engine's OpenAI server, no trailing slash
    role: str  # prefill, decode or both
    engine_id: str = ""  # the engine's id in the broker; "" until learned from the broker

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "both"

    @property
    def label(self) -> str:
        """How logs and response headers name the engine."""
        return self.engine_id or self.url


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def parse_engine_flag(value: str, role: str) -> EngineSpec:
    """`URL` or `ENGINE_ID=URL` (the id names the engine in the broker's Score answers)."""
    engine_id, sep, url = value.partition("=")
    if not sep:
        engine_id, url = "", value
    if not url.strip():
        raise argparse.ArgumentTypeError(f"empty engine URL in {value!r}")
    return EngineSpec(url=normalize_url(url), role=role, engine_id=engine_id.strip())


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    engines: tuple[EngineSpec, ...] = ()
    # Broker address (host:port); "" = no broker: no scoring, engines from flags only.
    broker: str = ""
    # How often to re-read the broker's engine list (engine ids, labels, layouts).
    refresh_interval_s: float = 2.0
    # Deadline of one Score call; a late broker must not delay requests.
    score_timeout_s: float = 0.5
    # Tenant prefix used by the engines' adapters (namespace = tenant/cache_salt).
    tenant: str = ""
    # Time to connect to an engine before trying the next one.
    connect_timeout_s: float = 5.0
    # Longest a prefill may take (P computes the whole prompt and one token).
    prefill_timeout_s: float = 300.0
    # Longest silence while reading an engine's answer.
    read_timeout_s: float = 300.0
    # How long an engine that failed is tried only after all others.
    cooldown_s: float = 5.0
    # Engines tried per role before falling back to a single engine.
    max_attempts: int = 2
    # Prefill on P, decode on D; off = every request goes whole to one engine.
    disaggregate: bool = True
    otlp_endpoint: str = ""
    log_level: str = "INFO"

    def engines_for(self, role: str) -> list[EngineSpec]:
        return [e for e in self.engines if e.serves(role)]


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def build_parser() -> argparse.ArgumentParser:
    d = ProxyConfig()
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.clients.proxy",
        description=(
            "OpenAI-compatible P/D proxy. Each request is prefilled on a prefill engine "
            "(kv_transfer_params do_remote_decode, max_tokens=1) and then decoded on a decode "
            "engine that pulls the KV blocks through the broker; D's answer is streamed back. "
            "Engines are chosen with the broker's Score API (longest cached prefix on GPU, then "
            "CPU tier, then load), so a conversation's next turn lands where its history is. "
            "If an engine fails, the next one is tried; if no P/D pair works, one engine serves "
            "the whole request. Every flag also reads the environment variable shown."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--host", default=_env("KVBROKER_PROXY_HOST", d.host), help="listen address [env KVBROKER_PROXY_HOST]"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(_env("KVBROKER_PROXY_PORT", str(d.port))),
        help="listen port [env KVBROKER_PROXY_PORT]",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=None,
        metavar="[ID=]URL",
        help="a prefill engine's base URL, optionally with its broker engine id; repeatable "
        "[env KVBROKER_PROXY_PREFILL, comma-separated]",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=None,
        metavar="[ID=]URL",
        help="a decode engine's base URL, optionally with its broker engine id; repeatable "
        "[env KVBROKER_PROXY_DECODE, comma-separated]",
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="[ID=]URL",
        help="an engine that can do both roles; repeatable [env KVBROKER_PROXY_ENGINES, comma-separated]",
    )
    parser.add_argument(
        "--broker",
        default=_env("KVBROKER_ADDR", d.broker),
        metavar="HOST:PORT",
        help="broker gRPC address; used to score engines and, when no engine flag is given, to "
        "discover engines (labels role=prefill|decode|both and url=...). Empty: no broker [env KVBROKER_ADDR]",
    )
    parser.add_argument(
        "--refresh-interval-s",
        type=float,
        default=float(_env("KVBROKER_PROXY_REFRESH_INTERVAL_S", str(d.refresh_interval_s))),
        help="how often the broker's engine list is re-read [env KVBROKER_PROXY_REFRESH_INTERVAL_S]",
    )
    parser.add_argument(
        "--score-timeout-s",
        type=float,
        default=float(_env("KVBROKER_PROXY_SCORE_TIMEOUT_S", str(d.score_timeout_s))),
        help="deadline of one Score call; when it passes, engines are picked round-robin [env KVBROKER_PROXY_SCORE_TIMEOUT_S]",
    )
    parser.add_argument(
        "--tenant",
        default=_env("KVBROKER_PROXY_TENANT", d.tenant),
        help="tenant configured in the engines' adapters; the namespace tenant is TENANT/cache_salt [env KVBROKER_PROXY_TENANT]",
    )
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=float(_env("KVBROKER_PROXY_CONNECT_TIMEOUT_S", str(d.connect_timeout_s))),
        help="time to connect to an engine before trying the next [env KVBROKER_PROXY_CONNECT_TIMEOUT_S]",
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=float(_env("KVBROKER_PROXY_PREFILL_TIMEOUT_S", str(d.prefill_timeout_s))),
        help="longest a prefill request may take [env KVBROKER_PROXY_PREFILL_TIMEOUT_S]",
    )
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=float(_env("KVBROKER_PROXY_READ_TIMEOUT_S", str(d.read_timeout_s))),
        help="longest silence while reading an engine's answer [env KVBROKER_PROXY_READ_TIMEOUT_S]",
    )
    parser.add_argument(
        "--cooldown-s",
        type=float,
        default=float(_env("KVBROKER_PROXY_COOLDOWN_S", str(d.cooldown_s))),
        help="an engine that failed is tried only after the others for this long [env KVBROKER_PROXY_COOLDOWN_S]",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=int(_env("KVBROKER_PROXY_MAX_ATTEMPTS", str(d.max_attempts))),
        help="engines tried per role before falling back to a single engine [env KVBROKER_PROXY_MAX_ATTEMPTS]",
    )
    parser.add_argument(
        "--no-disaggregate",
        dest="disaggregate",
        action="store_false",
        default=_env("KVBROKER_PROXY_DISAGGREGATE", "1") not in ("0", "false", "no"),
        help="send every request whole to one engine (still picked by prefix score) [env KVBROKER_PROXY_DISAGGREGATE=0]",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=_env("OTEL_EXPORTER_OTLP_ENDPOINT", d.otlp_endpoint),
        help="OTLP gRPC endpoint for traces, e.g. http://collector:4317; empty = no export [env OTEL_EXPORTER_OTLP_ENDPOINT]",
    )
    parser.add_argument(
        "--log-level",
        default=_env("KVBROKER_PROXY_LOG_LEVEL", d.log_level),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level [env KVBROKER_PROXY_LOG_LEVEL]",
    )
    return parser


def _split_env(name: str) -> list[str]:
    return [v for v in (s.strip() for s in os.environ.get(name, "").split(",")) if v]


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    def specs(values: Sequence[str] | None, env: str, role: str) -> list[EngineSpec]:
        raw = values if values is not None else _split_env(env)
        try:
            return [parse_engine_flag(v, role) for v in raw]
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"error: --{role}: {e}") from None

    engines = (
        specs(args.prefill, "KVBROKER_PROXY_PREFILL", "prefill")
        + specs(args.decode, "KVBROKER_PROXY_DECODE", "decode")
        + specs(args.engine, "KVBROKER_PROXY_ENGINES", "both")
    )
    if not engines and not args.broker:
        raise SystemExit("error: give engines (--prefill/--decode/--engine) or --broker to discover them")
    if args.max_attempts < 1:
        raise SystemExit("error: --max-attempts must be at least 1")
    return ProxyConfig(
        host=args.host,
        port=args.port,
        engines=tuple(engines),
        broker=args.broker,
        refresh_interval_s=args.refresh_interval_s,
        score_timeout_s=args.score_timeout_s,
        tenant=args.tenant,
        connect_timeout_s=args.connect_timeout_s,
        prefill_timeout_s=args.prefill_timeout_s,
        read_timeout_s=args.read_timeout_s,
        cooldown_s=args.cooldown_s,
        max_attempts=args.max_attempts,
        disaggregate=args.disaggregate,
        otlp_endpoint=args.otlp_endpoint,
        log_level=args.log_level,
    )
