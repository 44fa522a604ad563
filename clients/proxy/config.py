"""ProxyConfig and its command line: every flag also reads an environment variable (KVBROKER_PROXY_*).

The fields follow kvbroker.common.settings, the idiom every configuration uses."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.clients.credentials import ENV_PREFIX as SECURITY_ENV_PREFIX
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.common import settings
from kvbroker.common.settings import setting
from kvbroker.common.version import version_text

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


ENV_PREFIX = "KVBROKER_PROXY_"


@dataclass(frozen=True)
class ProxyConfig:
    host: str = setting("0.0.0.0", "listen address")
    port: int = setting(8000, "listen port")
    backlog: int = setting(
        2048,
        "connections the kernel queues before the proxy accepts them (capped by net.core.somaxconn); "
        "a burst beyond it waits a second for the client's SYN retry",
    )
    engines: tuple[EngineSpec, ...] = setting((), "engines from --prefill/--decode/--engine", flag=False)
    broker: str = setting(
        "",
        "broker gRPC address HOST:PORT; used to score engines and, when no engine flag is given, to "
        "discover engines (labels role=prefill|decode|both and url=...). Empty: no broker",
        env="KVBROKER_ADDR",
        metavar="HOST:PORT",
    )
    refresh_interval_s: float = setting(2.0, "how often the broker's engine list is re-read")
    score_timeout_s: float = setting(
        0.5, "deadline of one Score call; when it passes, engines are picked round-robin"
    )
    tenant: str = setting(
        "", "tenant configured in the engines' adapters; the namespace tenant is TENANT/cache_salt"
    )
    require_exact_index: bool = setting(
        False,
        "count only prefixes of engines whose index entries the broker says are exact (a lagging or "
        "degraded engine, e.g. one gone silent, scores 0 blocks; docs/broker.md, Exactness)",
    )
    connect_timeout_s: float = setting(5.0, "time to connect to an engine before trying the next")
    prefill_timeout_s: float = setting(300.0, "longest a prefill request may take")
    read_timeout_s: float = setting(300.0, "longest silence while reading an engine's answer")
    first_byte_timeout_s: float = setting(
        5.0,
        "first-byte budget of each step: an engine silent this long is checked (broker session, its /health) "
        "and, when not live, abandoned and the step retried on another engine; a live but busy engine keeps "
        "the request; 0 = off",
    )
    probe_timeout_s: float = setting(2.0, "how long the liveness check waits for an engine's /health")
    cooldown_s: float = setting(5.0, "an engine that failed is tried only after the others for this long")
    engine_keepalive_s: float = setting(
        4.0,
        "an idle connection to an engine is closed after this long; keep it under the engines' own "
        "keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), or a request sent on a connection the "
        "engine is closing fails and puts that engine in cooldown",
    )
    max_attempts: int = setting(2, "engines tried per role before falling back to a single engine")
    disaggregate: bool = setting(
        True,
        "prefill on P, decode on D; off: every request goes whole to one engine (still picked by prefix score)",
    )
    placement: str = setting(
        "load",
        "without disaggregation (a data-parallel fleet): load = the engine with the lowest predicted time "
        "to first token, weighing its load against the prefix it holds and a pull from the holder "
        "(common/placement.py); prefix = the engine holding the longest prefix first, whatever its load; "
        "round_robin = each engine in turn (a baseline)",
        choices=("load", "prefix", "round_robin"),
    )
    dp_busy_tokens: float = setting(
        256.0, "placement load: prompt tokens of waiting that one request in flight on an engine costs"
    )
    dp_pull_token_cost: float = setting(
        0.1, "placement load: a pulled prompt token's cost, as a fraction of computing it"
    )
    dp_pull_fixed_tokens: float = setting(
        160.0,
        "placement load: a pull's own wait (the reader's lease, read and notice, each at one of its "
        "scheduler steps), in prompt tokens; a shorter missing part is computed, not pulled",
    )
    dp_neighbour_cost: float = setting(
        1.0,
        "placement load: what a request costs the requests already running on an engine, per request "
        "there and per prompt token it computes (they wait while it computes); 0 = each request for itself",
    )
    dp_min_prefix_tokens: int = setting(
        64,
        "placement load: a longest held prefix under this many tokens is ignored; requests balance by load",
    )
    dp_pull: bool = setting(
        True,
        "placement load: engines pull prefixes from each other (our connector, kv_both); off: an engine "
        "without the prefix recomputes it (engines without the connector)",
    )
    dp_pull_as_placed: bool = setting(
        True,
        "placement load: a request placed to pull its prefix tells its engine which holder to pull from "
        "and to pull (kv_transfer_params kvbroker.holder_engine_id, kv_recompute_threshold 0), so the "
        "engine does what the placement priced; off: the engine's own pull policy decides, and may "
        "recompute a turn the placement moved to pull",
    )
    placement_learn: bool = setting(
        True,
        "placement load: fit busy_tokens, pull_token_cost and pull_fixed_tokens to the first-token "
        "times of streamed answers (each kept within 8x of its setting; placement_learner.py); off: the "
        "settings as given",
    )
    admit_per_engine: int = setting(
        0,
        "admission: at most this many requests per healthy engine run at once, in all (the placement "
        "picks each one's engine); more wait at the proxy, and one "
        "that can still meet --admit-ttft-goal-ms goes before one already past it (admission.py); "
        "0 = off, every request goes at once",
    )
    admit_ttft_goal_ms: float = setting(
        0.0,
        "admission: the time-to-first-token goal that orders waiting requests (a request past it waits "
        "behind those that can still meet it; none is refused); 0 = first come, first served",
    )
    admit_tpot_goal_ms: float = setting(
        0.0,
        "admission: the time-per-output-token goal of streamed answers; the proxy runs fewer requests at "
        "once while their pace is slower than this and more (up to --admit-per-engine) while it is under "
        "0.8 of it; 0 = always --admit-per-engine per engine",
    )
    admit_early_token: bool = setting(
        True,
        "admission: a streamed /v1/completions request still waiting when it can no longer meet "
        "--admit-ttft-goal-ms gets its first token now from a one-token request, and the rest of the "
        "answer when a place frees (early_token.py); off: it waits whole",
    )
    admit_max_wait_s: float = setting(
        60.0, "admission: a request that has waited this long goes next, whatever the goal"
    )
    local_prefill_tokens: int = setting(
        256,
        "a request whose first-choice decode engine already holds its prompt but for at most this many "
        "tokens goes to that engine alone (it computes them; no prefill hop); 0 = always prefill on P",
    )
    otlp_endpoint: str = setting(
        "",
        "OTLP endpoint for traces, e.g. http://collector:4317; empty = no OTLP export; protocol, "
        "exporter and service name follow OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_TRACES_EXPORTER and "
        "OTEL_SERVICE_NAME",
        env="OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    api_keys_file: str = setting(
        "",
        "file of API keys, one 'KEY TENANT' a line: requests need 'Authorization: Bearer KEY' and the proxy "
        "sets their cache_salt to TENANT[/SALT] (a salt naming another tenant is refused); empty = off",
    )
    log_level: str = setting("INFO", "how much the proxy logs", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    metrics: bool = setting(True, "serve Prometheus /metrics on the proxy's own port")
    access_log: bool = setting(
        True, "log one line per request (method, path, status, duration, engines) as kvbroker.proxy.access"
    )
    security: ClientSecurity | None = setting(  # noqa: RUF009 (frozen; flag=False: set by config_from_args)
        None,
        "TLS, client certificate or token for the broker (None: the KVBROKER_TLS_* variables)",
        flag=False,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbroker-proxy",
        description=(
            "OpenAI-compatible P/D proxy. Each request is prefilled on a prefill engine "
            "(kv_transfer_params do_remote_decode, max_tokens=1) and then decoded on a decode "
            "engine that pulls the KV blocks through the broker; D's answer is streamed back. "
            "Engines are chosen with the broker's Score API (longest cached prefix on GPU, then "
            "CPU tier, then load), so a conversation's next turn lands where its history is. "
            "If an engine fails, the next one is tried; if no P/D pair works, one engine serves "
            "the whole request. Every flag also reads the environment variable shown. "
            "Also run as `python -m kvbroker.clients.proxy`."
        ),
    )
    for role, flag, env, what in (
        ("prefill", "--prefill", "KVBROKER_PROXY_PREFILL", "a prefill engine's base URL"),
        ("decode", "--decode", "KVBROKER_PROXY_DECODE", "a decode engine's base URL"),
        ("both", "--engine", "KVBROKER_PROXY_ENGINES", "an engine that can do both roles"),
    ):
        parser.add_argument(
            flag,
            dest=role,
            action="append",
            default=None,
            metavar="[ID=]URL",
            help=f"{what}, optionally with its broker engine id; repeatable [env {env}, comma-separated]",
        )
    parser.add_argument("--version", action="version", version=version_text("kvbroker-proxy"))
    settings.add_arguments(parser, ProxyConfig, ENV_PREFIX, error=parser.error)
    secure = parser.add_argument_group(
        "broker security", "TLS, mutual TLS or a bearer token (docs/security.md)"
    )
    settings.add_arguments(secure, ClientSecurity, SECURITY_ENV_PREFIX, error=parser.error)
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
        + specs(args.both, "KVBROKER_PROXY_ENGINES", "both")
    )
    if not engines and not args.broker:
        raise SystemExit("error: give engines (--prefill/--decode/--engine) or --broker to discover them")
    if args.max_attempts < 1:
        raise SystemExit("error: --max-attempts must be at least 1")
    if args.local_prefill_tokens < 0:
        raise SystemExit("error: --local-prefill-tokens must be >= 0")
    weights = (
        args.dp_busy_tokens,
        args.dp_pull_token_cost,
        args.dp_pull_fixed_tokens,
        args.dp_neighbour_cost,
    )
    if min(weights) < 0 or args.dp_min_prefix_tokens < 0:
        raise SystemExit(
            "error: --dp-busy-tokens, --dp-pull-token-cost, --dp-pull-fixed-tokens, --dp-neighbour-cost "
            "and --dp-min-prefix-tokens must be >= 0"
        )
    if min(args.admit_per_engine, args.admit_ttft_goal_ms, args.admit_tpot_goal_ms) < 0:
        raise SystemExit(
            "error: --admit-per-engine, --admit-ttft-goal-ms and --admit-tpot-goal-ms must be >= 0"
        )
    if args.admit_max_wait_s <= 0:
        raise SystemExit("error: --admit-max-wait-s must be > 0")
    if args.backlog < 1:
        raise SystemExit("error: --backlog must be at least 1")
    if args.engine_keepalive_s <= 0:
        raise SystemExit("error: --engine-keepalive-s must be > 0")
    if args.first_byte_timeout_s < 0 or args.probe_timeout_s <= 0:
        raise SystemExit("error: --first-byte-timeout-s must be >= 0 and --probe-timeout-s > 0")
    security = settings.from_args(ClientSecurity, args)
    config: ProxyConfig = settings.from_args(ProxyConfig, args, engines=tuple(engines), security=security)
    return config
