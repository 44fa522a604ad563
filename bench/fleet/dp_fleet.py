"""A data-parallel fleet under concurrent multi-turn sessions: three routers over the same engines.

    python -m bench.fleet.dp_fleet            # 2 tiny-model engines, rates 1, 2, 4 sessions/s
    python -m bench.fleet.dp_fleet --quick    # rates 1 and 4, fewer sessions

A first version of issue 26's `bench.fleet`. Starts a broker and N vLLM
engines (tiny model, our connector, kv_both, each pinned to its own cores),
then for each router setup a proxy with `--no-disaggregate` over the same
engines, with the same cores:

- `round_robin`: each engine in turn (`--placement round_robin`);
- `prefix`: prefix affinity, the longest held prefix first whatever the load
  (`--placement prefix`; the engines still pull, as ours do, so this is
  prefix-affinity routing with our connector, not stock engines with KV events);
- `load`: ours, load against locality with cross-engine pulls (`--placement load`).

Each setup and rate runs the same sessions (bench/fleet/workload.py: agent
classes sharing a system prompt, Zipf-skewed, bursty arrivals, think time,
histories growing per turn), streamed, greedy, under a cache_salt of its own
so no setup reuses another's cache. Reports per setup and rate: goodput
(requests meeting the TTFT and per-token SLOs below, per second), TTFT
p50/p90/p99, throughput, prefix reuse (cached or pulled prompt tokens / prompt
tokens) against the ideal, tokens recomputed, pulls and their bytes, failed
requests, and the proxy's routing reasons. Writes bench/results/dp_fleet[-quick].json
and .txt (`-threshold` added with `--pull-policy threshold`). Not yet: stock-engine KV-event affinity, P/D setups, SmolLM2, plots.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.fleet.workload import IdealCache, Workload, WorkloadSpec, build
from bench.harness.engines import add_run_arguments, prepare_workdir, read_stats
from bench.harness.output import RESULTS_DIR, format_table, load_note, log, shared_cores_note, write_json
from kvbroker.tools.children import ProxyProcess
from kvbroker.tools.launch import EngineProcess, connector_config, pin_apart
from testkit.engines import ACQUIRE_WAIT_MS, BLOCK_SIZE, RESOLVE_WAIT_MS
from testkit.processes import BrokerProcess

SETUPS = ("round_robin", "prefix", "load")
TTFT_SLO_S = 1.0
TPOT_SLO_S = 0.1


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_tokens: int = 0
    engine: str = ""
    error: str = ""


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream(
    url: str, body: dict[str, Any], timeout: float = 300.0
) -> tuple[float, float, list[int], dict[str, Any], str]:
    """(TTFT s, mean s per later token, token ids, usage, serving engine) of one streamed request."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    ids: list[int] = []
    usage: dict[str, Any] = {}
    sent = time.perf_counter()
    first = last = 0.0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        engine = resp.headers.get("X-KVBroker-Decode", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                if new:
                    last = time.perf_counter()
                    first = first or last
                    ids.extend(new)
    if not ids:
        raise RuntimeError("the stream carried no token")
    tpot = (last - first) / (len(ids) - 1) if len(ids) > 1 else 0.0
    return first - sent, tpot, ids, usage, engine


def run_session(url: str, model: str, salt: str, work: Workload, s: int, ideal: IdealCache, run: Run) -> None:
    session = work.sessions[s]
    history = list(work.system_prompts[session.agent_class])
    for turn, user in enumerate(session.user_turns):
        if turn:
            time.sleep(session.think_s[turn - 1])
        prompt = history + list(user)
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": work.spec.answer_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "cache_salt": salt,
        }
        with run.lock:
            reusable = ideal.reused(prompt)
        try:
            ttft, tpot, ids, usage, engine = stream(url, body)
        except (OSError, ValueError, RuntimeError) as e:
            with run.lock:
                run.results.append(Result(False, prompt_tokens=len(prompt), error=str(e)[:200]))
            return
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        with run.lock:
            ideal.add(prompt + ids[:-1])
            run.results.append(Result(True, ttft, tpot, len(prompt), cached, reusable, engine))
        history = prompt + ids


def drive(url: str, model: str, work: Workload) -> tuple[Run, float]:
    run, ideal = Run(), IdealCache(BLOCK_SIZE)
    salt = f"fleet-{uuid.uuid4().hex[:8]}"
    threads = []
    start = time.perf_counter()
    for i, session in enumerate(work.sessions):
        wait = session.arrival_s - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        t = threading.Thread(target=run_session, args=(url, model, salt, work, i, ideal, run), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(600)
    return run, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def route_reasons(proxy_url: str) -> dict[str, float]:
    with urllib.request.urlopen(proxy_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = re.findall(r'kvbroker_proxy_route_choices_total\{reason="([^"]+)"\} ([\d.]+)', text)
    return {reason: float(v) for reason, v in found}


def figures(run: Run, wall_s: float, pulls: dict[str, int], reasons: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok]
    good = [r for r in ok if r.ttft_s <= TTFT_SLO_S and r.tpot_s <= TPOT_SLO_S]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(min(r.cached_tokens, r.prompt_tokens) for r in ok)
    ideal = sum(r.ideal_tokens for r in ok)
    return {
        "requests": len(run.results),
        "failed": len(run.results) - len(ok),
        "wall_s": round(wall_s, 2),
        "goodput_rps": round(len(good) / wall_s, 3) if wall_s else 0.0,
        "throughput_rps": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "ttft_ms": {q: round(pct(ttfts, v), 1) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "ttft_mean_ms": round(statistics.fmean(ttfts), 1) if ttfts else None,
        "prompt_tokens": prompt,
        "reused_tokens": cached,
        "ideal_reused_tokens": ideal,
        "reuse_of_ideal": round(cached / ideal, 3) if ideal else None,
        "recomputed_tokens": prompt - cached,
        "pulled_blocks": pulls["blocks"],
        "pulled_bytes": pulls["bytes"],
        "per_engine": {e: sum(1 for r in ok if r.engine == e) for e in sorted({r.engine for r in ok})},
        "route_reasons": reasons,
        "errors": sorted({r.error for r in run.results if not r.ok})[:5],
    }


def start_engines(
    model: Path, work: Path, broker: str, n: int, timeout_s: float, pull_policy: str
) -> tuple[list[EngineProcess], list[Path]]:
    engines, stats = [], []
    for i in range(n):
        name = f"E{i}"
        stats.append(work / f"{name}-stats.json")
        config = connector_config(
            broker_address=broker,
            engine_id=name,
            role="both",
            stats_path=str(stats[-1]),
            pull_policy=pull_policy,
            resolve_wait_ms=RESOLVE_WAIT_MS,
            acquire_wait_ms=ACQUIRE_WAIT_MS,
        )
        engines.append(
            EngineProcess(
                model,
                name=name,
                kv_transfer_config=config,
                block_size=BLOCK_SIZE,
                max_model_len=4096,
                extra_args=["--enable-prompt-tokens-details"],
                log_path=work / f"{name}.log",
            ).start()
        )
    for e in engines:
        e.wait_ready(timeout=timeout_s, progress=log)
    pin_apart(engines, log)
    return engines, stats


def pulled(stats: list[Path]) -> dict[str, int]:
    out = {"blocks": 0, "bytes": 0}
    for path in stats:
        s = read_stats(path)
        out["blocks"] += int(s.get("pulled_blocks", 0))
        out["bytes"] += int(s.get("pulled_bytes", 0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet.dp_fleet", description=(__doc__ or "").split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="rates 1 and 4 sessions/s, 8 sessions each")
    ap.add_argument("--engines", type=int, default=2, help="data-parallel engines (default 2)")
    ap.add_argument("--rates", type=float, nargs="*", default=None, help="session arrival rates per second")
    ap.add_argument("--sessions", type=int, default=None, help="sessions per rate (default 12; quick 8)")
    ap.add_argument(
        "--pull-policy",
        choices=("adaptive", "threshold"),
        default="adaptive",
        help="the engines' pull policy (adaptive, the default, may rightly recompute on the tiny model)",
    )
    add_run_arguments(ap)
    args = ap.parse_args(argv)
    rates = args.rates or ([1.0, 4.0] if args.quick else [1.0, 2.0, 4.0])
    spec = WorkloadSpec(sessions=args.sessions or (8 if args.quick else 12))
    work, model = prepare_workdir(args, "kvbroker-dp-fleet-")
    broker = BrokerProcess(work).start()
    engines: list[EngineProcess] = []
    results: dict[str, dict[str, Any]] = {}
    try:
        engines, stats = start_engines(
            model, work, broker.address, args.engines, args.start_timeout_s, args.pull_policy
        )
        for setup in SETUPS:
            proxy = ProxyProcess(
                work / f"proxy-{setup}.log",
                engines={e.name: e.url for e in engines},
                broker=broker.address,
                extra_args=["--no-disaggregate", "--placement", setup],
                name=f"proxy-{setup}",
            ).start()
            try:
                for rate in rates:
                    workload = build(replace(spec, rate=rate))
                    before, reasons_before = pulled(stats), route_reasons(proxy.url)
                    run, wall = drive(proxy.url, str(model), workload)
                    after, reasons_after = pulled(stats), route_reasons(proxy.url)
                    delta = {k: after[k] - before[k] for k in after}
                    reasons = {k: v - reasons_before.get(k, 0) for k, v in reasons_after.items()}
                    fig = figures(run, wall, delta, {k: v for k, v in reasons.items() if v})
                    results.setdefault(setup, {})[f"{rate:g}"] = fig
                    log(
                        f"{setup} @ {rate:g} sessions/s: goodput {fig['goodput_rps']} req/s, TTFT p50/p90 "
                        f"{fig['ttft_ms']['p50']}/{fig['ttft_ms']['p90']} ms, reuse {fig['reuse_of_ideal']} of ideal, "
                        f"pulled {fig['pulled_blocks']} blocks, failed {fig['failed']}; load {load_note()}"
                    )
            finally:
                proxy.stop()
    finally:
        for e in engines:
            e.stop()
        broker.stop()
    rows = [
        [
            setup,
            rate,
            str(f["goodput_rps"]),
            str(f["throughput_rps"]),
            f"{f['ttft_ms']['p50']}/{f['ttft_ms']['p90']}/{f['ttft_ms']['p99']}",
            str(f["reuse_of_ideal"]),
            str(f["recomputed_tokens"]),
            f"{f['pulled_blocks']} ({f['pulled_bytes'] / 1e6:.1f} MB)",
            str(f["failed"]),
        ]
        for setup, by_rate in results.items()
        for rate, f in by_rate.items()
    ]
    table = format_table(
        [
            "setup",
            "sessions/s",
            "goodput req/s",
            "req/s",
            "TTFT p50/p90/p99 ms",
            "reuse/ideal",
            "recomputed tok",
            "pulled",
            "failed",
        ],
        rows,
    )
    note = (
        f"{args.engines} tiny-model engines (pull policy {args.pull_policy}), each pinned to its own cores; {spec.sessions} sessions x {spec.turns} turns "
        f"per rate, {spec.classes} agent classes (Zipf), system prompt {spec.system_tokens} tokens, {spec.user_tokens}-token "
        f"user turns, {spec.answer_tokens}-token answers, think {spec.think_s} s, bursts of {spec.burst}; SLO: TTFT <= "
        f"{TTFT_SLO_S * 1000:.0f} ms and <= {TPOT_SLO_S * 1000:.0f} ms per later token; {shared_cores_note()}; "
        f"load {load_note()}"
    )
    print(table)
    print(note)
    name = ("dp_fleet-quick" if args.quick else "dp_fleet") + (
        "" if args.pull_policy == "adaptive" else f"-{args.pull_policy}"
    )
    out_dir = args.out_dir or RESULTS_DIR
    write_json(
        name, {"note": note, "slo": {"ttft_s": TTFT_SLO_S, "tpot_s": TPOT_SLO_S}, "results": results}, out_dir
    )
    (out_dir / f"{name}.txt").write_text(table + "\n" + note + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
