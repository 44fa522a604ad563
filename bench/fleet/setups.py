"""The fleet benchmark's setups: each starts its engines and router and gives one URL for OpenAI requests.

    rr        N stock vLLM engines (no connector) behind bench.fleet.router's round robin
    prefix    the same engines publishing KV events to our broker (`--kv-events`), behind
              bench.fleet.router's prefix policy (the broker's Score: longest cached prefix)
    ours-pd   our P/D: a broker, N/2 prefill and N/2 decode engines with our connector
              (decode `multi_turn`), our proxy (clients/proxy, every turn prefilled on P)
    nixl-pd   vLLM's NixlConnector P/D (bench/harness/baselines.py), P + D (N = 2 only),
              behind bench.fleet.router's nixl-pd policy
    ours-dp   our proxy in data-parallel mode (--no-disaggregate --placement load) over N
              engines in kv_both with our connector, each pulling a prefix from whichever
              engine holds it, with the placement's weights as set (--no-placement-learn)
    ours-dp-learn  the same with the proxy's default, learning (it fits the placement's
              weights to the first-token times it sees)
    ours-dp-own-pull  ours-dp-learn with --no-dp-pull-as-placed: a turn placed to pull does not
              tell its engine to pull, the engine's own pull policy decides (the proxy's way
              before --dp-pull-as-placed)
    ours-dp-linear the same with the placement and the engines' pull policy counting neither
              a pull's fixed wait nor what a prefill costs the requests running beside it
              (the rule before those terms: --dp-pull-fixed-tokens 0 --dp-neighbour-cost 0,
              recompute_neighbour_cost 0)
    ours-dp-gpu-only  ours-dp-learn without the CPU offload tier: a pull from a busy holder
              then waits for that holder's scheduler step to pin its GPU copy
    ours-dp-stock  our proxy's load placement without pulls (--no-dp-pull, learning) over the
              stock engines of rr and prefix, scored from their KV events: our routing
              without our connector, to tell the routing's share of a result from the
              connector's and the pulls'
    ours-dp-admit  ours-dp-learn with the proxy's admission (clients/proxy/admission.py,
              Context.admit_args): requests past a limit per engine wait at the proxy; one
              that can no longer meet the TTFT goal gets its first token early (early_token.py)
    ours-dp-stock-admit, ours-prefix-admit  ours-dp-stock, and our proxy's --placement
              prefix over the stock engines, with the same admission

Every ours-dp setup but ours-dp-gpu-only gives each engine a CPU offload tier of
DP_CPU_TIER_BLOCKS blocks (kvbroker.tools.demo_stack, as `make up TOPOLOGY=dp:N` does): finished
requests' blocks are copied there, and a reader pulling from a busy holder reads that copy,
which the holder pins at once (common/scoring.py, rank_holders), instead of waiting for the
holder's current step.

`ours-dp` is the proxy's data-parallel mode (docs/serving.md, "Data-parallel fleets") as
tools/demo_stack.py's `dp:N` starts it: engines with our connector, role `both` (kv_both), given
as `--engine ID=URL`, the proxy with `--no-disaggregate --placement load` (engines pull).

Every engine: the run's model, block size 32, `--enable-prompt-tokens-details` (usage reports
cached tokens), vLLM's stats on (its /metrics counts prompt tokens by source: computed, local
cache hit, external KV transfer). Engines are pinned apart (`pin_apart`): with N engines on
C >= N cores, engine i gets the same C/N cores in every setup; with fewer cores, none is pinned. The stock engines of `rr` and `prefix`
are started once and shared by both (`Fleet`); each run's fresh cache_salt reuses no other's cache.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fleet.report import proxy_counts
from bench.harness.baselines import nixl_engine
from bench.harness.engines import broker_connector_config
from bench.harness.output import log
from kvbroker.tools.demo_stack import DP_CPU_TIER_BLOCKS
from kvbroker.tools.launch import EngineProcess, EngineStartError, free_port, pin_apart
from testkit.engines import BLOCK_SIZE, read_stats
from testkit.processes import REPO_ROOT, BrokerProcess, ChildProcess, ProxyProcess, python_env

SETUPS = (
    "rr",
    "prefix",
    "ours-pd",
    "nixl-pd",
    "ours-dp",
    "ours-dp-learn",
    "ours-dp-own-pull",
    "ours-dp-linear",
    "ours-dp-gpu-only",
    "ours-dp-stock",
    "ours-dp-admit",
    "ours-dp-stock-admit",
    "ours-prefix-admit",
)
# Our connector's counters the report reads (summed over the engines; engine_adapter/loads.py).
CONNECTOR_COUNTS = (
    "pulled_blocks",
    "pulled_tokens",
    "pulled_bytes",
    "loads_ready",
    "load_ready_steps",
    "pulled_blocks_tier_cpu",  # of pulled_blocks, read from a holder's CPU tier
    "cpu_restored_blocks",  # copied back from the engine's own CPU tier (no pull)
)
ENGINE_ARGS = ["--enable-prompt-tokens-details"]
HOLD_TTL_MS = 5000  # decode's multi-turn holds: leases must be gone this long after the run (+ slack)


class Unavailable(Exception):
    """A setup that cannot run here (the reason is printed and recorded instead of its figures)."""


@dataclass
class Context:
    model: Path
    work: Path
    engines: int
    start_timeout_s: float
    served_name: str | None = None
    max_model_len: int = 4096
    kv_cache_bytes: int = 256 << 20
    shared: dict[str, Any] = field(default_factory=dict)  # the stock fleet of rr and prefix
    admit_per_engine: int = 8  # the -admit setups' --admit-per-engine
    admit_max_wait_s: float = 60.0  # the -admit setups' --admit-max-wait-s
    admit_first_come: bool = False  # the -admit setups' --admit-ttft-goal-ms 0 (no deadline order)
    admit_early_token: bool = True  # off: the -admit setups' --no-admit-early-token
    ttft_slo_ms: float = 0.0  # the -admit setups' --admit-ttft-goal-ms: the run's TTFT SLO
    tpot_slo_ms: float = 0.0  # the run's TPOT SLO; the -admit setups' --admit-tpot-goal-ms is 0.8 of it

    def admit_args(self) -> list[str]:
        # A TPOT goal of 0.8 of the SLO: the answers' mean pace sits at the goal, a tail above it.
        tpot_goal, ttft_goal = 0.8 * self.tpot_slo_ms, 0.0 if self.admit_first_come else self.ttft_slo_ms
        return (
            f"--admit-per-engine {self.admit_per_engine} --admit-ttft-goal-ms {ttft_goal:g} "
            f"--admit-tpot-goal-ms {tpot_goal:g} --admit-max-wait-s {self.admit_max_wait_s:g}"
            + ("" if self.admit_early_token else " --no-admit-early-token")
        ).split()

    def engine(self, name: str, **kw: Any) -> EngineProcess:
        extra = ENGINE_ARGS + list(kw.pop("extra_args", ()))
        return EngineProcess(
            self.model,
            name=name,
            block_size=BLOCK_SIZE,
            max_model_len=self.max_model_len,
            kv_cache_bytes=self.kv_cache_bytes,
            served_model_name=self.served_name,
            extra_args=extra,
            log_stats=True,
            log_path=self.work / f"{name}.log",
            **kw,
        )

    @property
    def model_name(self) -> str:
        return self.served_name or str(self.model)

    def release_shared(self) -> None:
        fleet = self.shared.pop("stock", None)
        if fleet is not None:
            fleet.stop()


@dataclass
class Running:
    """One started setup: its URL, and what the benchmark reads from it around a run."""

    name: str
    url: str
    engines: list[EngineProcess]
    children: list[ChildProcess] = field(default_factory=list)
    broker: BrokerProcess | None = None
    stats_paths: dict[str, Path] = field(default_factory=dict)  # our connector's counters
    owns_engines: bool = True
    holds_leases: bool = False  # engines with our connector: leases are counted after the run
    note: str = ""

    def engine_counts(self) -> dict[str, dict[str, float]]:
        """Each engine's counters (vLLM's /metrics): requests finished, prompt tokens by source
        (``source:NAME``) and its requests' time per output token (sum and count)."""
        return {engine.name: _engine_counts(engine.url) for engine in self.engines}

    def connector_stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for path in self.stats_paths.values():
            stats = read_stats(path, settle=False)
            for key in CONNECTOR_COUNTS:
                out[key] = out.get(key, 0) + int(stats.get(key, 0))
        return out

    def router_stats(self) -> dict[str, Any]:
        """The router's counts since it started: bench.fleet.router's /stats, or our proxy's
        counters by label (report.PROXY_COUNTS, from its /metrics: routing choices by reason,
        the data-parallel placement's dp_* labels; admission orders; early first tokens).
        A router that no longer answers gives {"error": why}: the run's figures are kept."""
        try:
            return self._router_stats()
        except (OSError, ValueError) as e:  # URLError is an OSError
            return {"error": f"the router did not answer its counts: {e}"}

    def _router_stats(self) -> dict[str, Any]:
        for child in self.children:
            if child.name == "router":
                with urllib.request.urlopen(self.url + "/stats", timeout=10) as resp:
                    return dict(json.loads(resp.read()))
            if isinstance(child, ProxyProcess):
                with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
                    text = resp.read().decode()
                return proxy_counts(text)
        return {}

    def leases_active(self, wait_s: float) -> int | None:
        """Leases the broker still has once `wait_s` passed or none is left; None without our connector."""
        if self.broker is None or not self.holds_leases:
            return None
        from kvbroker.clients.sync import BrokerClient
        from testkit.waiting import wait_for

        with BrokerClient(self.broker.address) as client:
            wait_for(lambda: not client.list_leases().leases, wait_s, interval=0.5)
            return len(client.list_leases().leases)

    def stop(self) -> None:
        for child in self.children:
            child.stop()
        if self.owns_engines:
            for engine in self.engines:
                engine.stop()
            if self.broker is not None:
                self.broker.stop()


SOURCE = "source:"
# vLLM's counters read per engine (summed over their other labels), by the key they are kept under.
_ENGINE_COUNTERS = {
    "vllm:request_success_total": "requests",
    "vllm:request_time_per_output_token_seconds_sum": "tpot_s_sum",
    "vllm:request_time_per_output_token_seconds_count": "tpot_count",
}


def prompt_sources(counts: dict[str, dict[str, float]]) -> dict[str, int]:
    """Prompt tokens by source, summed over the engines of one `Running.engine_counts` reading."""
    out: dict[str, int] = {}
    for engine in counts.values():
        for key, n in engine.items():
            if key.startswith(SOURCE):
                source = key[len(SOURCE) :]
                out[source] = out.get(source, 0) + int(n)
    return out


def _engine_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name == "vllm:prompt_tokens_by_source_total":
            key = SOURCE + rest.split('source="', 1)[1].split('"', 1)[0]
        elif name in _ENGINE_COUNTERS:
            key = _ENGINE_COUNTERS[name]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rpartition(" ")[2])
    return out


def _ready(ctx: Context, engines: list[EngineProcess]) -> None:
    for engine in engines:
        engine.wait_ready(timeout=ctx.start_timeout_s, progress=log)
    pin_apart(engines, log)


def _router(ctx: Context, name: str, args: list[str]) -> tuple[ChildProcess, str]:
    """bench.fleet.router with `args`, answering; returns it and its URL."""
    port = free_port()
    router = ChildProcess(
        "router",
        [sys.executable, "-m", "bench.fleet.router", "--port", str(port), *args],
        ctx.work / f"router-{name}.log",
        env=python_env(),
        cwd=REPO_ROOT,
    ).start()
    url = f"http://127.0.0.1:{port}"
    router.wait_http(url + "/health", 60)
    return router, url


@dataclass
class _Stock:
    broker: BrokerProcess
    engines: list[EngineProcess]

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
        self.broker.stop()


class _PortTaken(Exception):
    """An engine could not bind the KV-event port chosen for it: another process took it first."""


def _stock(ctx: Context) -> _Stock:
    """N stock engines publishing KV events, and a broker following them (started once, shared).

    Each engine's KV-event port is chosen free before the engines start, and an engine starting
    beside it may bind that port first for one of its own sockets: then all start once more on
    new ports."""
    if "stock" in ctx.shared:
        return ctx.shared["stock"]  # type: ignore[no-any-return]
    try:
        stock = _start_stock(ctx)
    except _PortTaken as e:
        log(f"{e}; starting the stock engines once more on new ports")
        stock = _start_stock(ctx)
    ctx.shared["stock"] = stock
    return stock


def _start_stock(ctx: Context) -> _Stock:
    engines, specs = [], []
    for i in range(ctx.engines):
        port = free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        engine = ctx.engine(f"vllm-{i}", extra_args=["--kv-events-config", json.dumps(events)])
        engines.append(engine)
        specs.append(
            f"vllm-{i}=tcp://127.0.0.1:{port}?model={ctx.model_name}&block_size={BLOCK_SIZE}&url={engine.url}"
        )
    broker = BrokerProcess(ctx.work, ["--kv-events", ",".join(specs)], log_name="broker-stock.log").start()
    stock = _Stock(broker, engines)
    try:
        for engine in engines:
            engine.start()
        _ready(ctx, engines)
    except BaseException as e:
        stock.stop()
        taken = [x.name for x in engines if "Address already in use" in x.log_tail(None)]
        if taken and isinstance(e, EngineStartError):
            raise _PortTaken(f"{', '.join(taken)}: a port was taken while the engines started") from e
        raise
    return stock


def start_rr(ctx: Context) -> Running:
    stock = _stock(ctx)
    router, url = _router(
        ctx, "rr", ["--policy", "rr", *(f"--engine={e.name}={e.url}" for e in stock.engines)]
    )
    return Running("rr", url, stock.engines, [router], stock.broker, owns_engines=False)


def start_prefix(ctx: Context) -> Running:
    stock = _stock(ctx)
    from kvbroker.clients.sync import BrokerClient
    from testkit.waiting import wait_for

    with BrokerClient(stock.broker.address) as client:
        names = {e.name for e in stock.engines}
        if not wait_for(lambda: names <= {e.engine_id for e in client.list_engines().engines}, 60):
            raise RuntimeError(
                f"the broker does not follow every engine's KV events:\n{stock.broker.log_tail()}"
            )
    args = ["--policy", "prefix", "--broker", stock.broker.address]
    router, url = _router(ctx, "prefix", args + [f"--engine={e.name}={e.url}" for e in stock.engines])
    return Running("prefix", url, stock.engines, [router], stock.broker, owns_engines=False)


def start_ours_stock(
    ctx: Context, name: str = "ours-dp-stock", admit: bool = False, placement: str = "load"
) -> Running:
    """Our proxy's load-aware placement (no pulls) over the stock engines of `rr` and `prefix`,
    which the broker follows by their KV events: our routing without our connector."""
    stock = _stock(ctx)
    args = ["--no-disaggregate", "--placement", placement, "--no-dp-pull"]
    engines = {e.name: e.url for e in stock.engines}
    admitting = ctx.admit_args() if admit else []
    log_path = ctx.work / f"proxy-{name}.log"
    proxy = ProxyProcess(log_path, engines=engines, broker=stock.broker.address, extra_args=args + admitting)
    proxy.start(timeout=60)
    return Running(name, proxy.url, stock.engines, [proxy], stock.broker, owns_engines=False)


def _ours(ctx: Context, name: str, roles: list[tuple[str, str, dict[str, Any]]]) -> Running:
    """A broker and engines with our connector (name, role, extra connector options each)."""
    broker = BrokerProcess(ctx.work, log_name=f"broker-{name}.log").start()
    running = Running(name, "", [], broker=broker, holds_leases=True)
    try:
        for eng_name, role, extra in roles:
            stats = ctx.work / f"{eng_name}-stats.json"
            config = broker_connector_config(broker.address, eng_name, role, stats, **extra)
            running.engines.append(ctx.engine(eng_name, kv_transfer_config=config).start())
            running.stats_paths[eng_name] = stats
        _ready(ctx, running.engines)
    except BaseException:
        running.stop()
        raise
    return running


def start_ours_pd(ctx: Context) -> Running:
    half = max(1, ctx.engines // 2)
    roles: list[tuple[str, str, dict[str, Any]]] = [(f"P{i}", "prefill", {}) for i in range(half)]
    roles += [(f"D{i}", "decode", {"multi_turn": True, "hold_ttl_ms": HOLD_TTL_MS}) for i in range(half)]
    running = _ours(ctx, "ours-pd", roles)
    try:
        engines = {e.name: e.url for e in running.engines}
        proxy = ProxyProcess(
            ctx.work / "proxy-ours-pd.log",
            prefill={n: u for n, u in engines.items() if n.startswith("P")},
            decode={n: u for n, u in engines.items() if n.startswith("D")},
            broker=running.broker.address if running.broker else "",
            local_prefill_tokens=0,
        )
        running.children.append(proxy.start(timeout=60))
        running.url = proxy.url
    except BaseException:
        running.stop()
        raise
    return running


def start_nixl_pd(ctx: Context) -> Running:
    if ctx.engines != 2:
        raise Unavailable(
            f"nixl-pd is one P and one D (bench/harness/baselines.py): 2 engines, not {ctx.engines}"
        )
    engines = [
        nixl_engine(
            ctx.model,
            ctx.work,
            name,
            max_model_len=ctx.max_model_len,
            kv_cache_bytes=ctx.kv_cache_bytes,
            served_model_name=ctx.served_name,
            extra_args=list(ENGINE_ARGS),
        )
        for name in ("P-nixl", "D-nixl")
    ]
    running = Running("nixl-pd", "", engines)
    try:
        for engine in engines:
            engine.start()
        _ready(ctx, engines)
        p, d = engines
        router, running.url = _router(
            ctx, "nixl-pd", ["--policy", "nixl-pd", "--prefill", p.url, "--decode", d.url]
        )
        running.children.append(router)
    except BaseException:
        running.stop()
        raise
    return running


def start_ours_dp(
    ctx: Context,
    name: str = "ours-dp",
    learn: bool = False,
    linear: bool = False,
    own_pull: bool = False,
    cpu_tier: bool = True,
    admit: bool = False,
) -> Running:
    # Engines named apart per setup, so that each keeps its own log and stats in the work dir.
    # G: no tier, O: own pull, A: admission, L: learning, R: linear, E: the weights as set.
    flags = (("G", not cpu_tier), ("O", own_pull), ("A", admit), ("L", learn), ("R", linear), ("E", True))
    letter = next(k for k, on in flags if on)
    extra: dict[str, Any] = {"recompute_neighbour_cost": 0.0} if linear else {}
    if cpu_tier:
        extra["cpu_tier_blocks"] = DP_CPU_TIER_BLOCKS
    roles = [(f"{letter}{i}", "both", extra) for i in range(ctx.engines)]
    running = _ours(ctx, name, roles)
    try:
        proxy = ProxyProcess(
            ctx.work / f"proxy-{name}.log",
            engines={e.name: e.url for e in running.engines},
            broker=running.broker.address if running.broker else "",
            extra_args=[
                "--no-disaggregate",
                "--placement",
                "load",
                # Learning is the proxy's default; the other two keep the weights as set.
                *([] if learn else ["--no-placement-learn"]),
                *(["--dp-pull-fixed-tokens", "0", "--dp-neighbour-cost", "0"] if linear else []),
                *(["--no-dp-pull-as-placed"] if own_pull else []),
                *(ctx.admit_args() if admit else []),
            ],
        )
        running.children.append(proxy.start(timeout=60))
        running.url = proxy.url
    except BaseException:
        running.stop()
        raise
    return running


STARTERS: dict[str, Callable[[Context], Running]] = {
    "rr": start_rr,
    "prefix": start_prefix,
    "ours-pd": start_ours_pd,
    "nixl-pd": start_nixl_pd,
    "ours-dp": start_ours_dp,
    "ours-dp-learn": lambda ctx: start_ours_dp(ctx, "ours-dp-learn", learn=True),
    "ours-dp-own-pull": lambda ctx: start_ours_dp(ctx, "ours-dp-own-pull", learn=True, own_pull=True),
    "ours-dp-linear": lambda ctx: start_ours_dp(ctx, "ours-dp-linear", linear=True),
    "ours-dp-gpu-only": lambda ctx: start_ours_dp(ctx, "ours-dp-gpu-only", learn=True, cpu_tier=False),
    "ours-dp-stock": start_ours_stock,
    "ours-dp-admit": lambda ctx: start_ours_dp(ctx, "ours-dp-admit", learn=True, admit=True),
    "ours-dp-stock-admit": lambda ctx: start_ours_stock(ctx, "ours-dp-stock-admit", admit=True),
    "ours-prefix-admit": lambda ctx: start_ours_stock(ctx, "ours-prefix-admit", True, "prefix"),
}
SHARES_STOCK = ("rr", "prefix", "ours-dp-stock", "ours-dp-stock-admit", "ours-prefix-admit")


def start(name: str, ctx: Context) -> Running:
    """Start setup `name` (one of SETUPS); raises Unavailable with the reason when it cannot run here."""
    if name not in STARTERS:
        raise ValueError(f"unknown setup {name!r}; one of {SETUPS}")
    if name not in SHARES_STOCK:
        ctx.release_shared()  # the stock engines' cores and memory go to this setup's engines
    started = time.monotonic()
    running = STARTERS[name](ctx)
    log(f"{name}: up in {time.monotonic() - started:.0f} s at {running.url}")
    return running
