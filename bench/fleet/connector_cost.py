"""What our connector costs an engine that is busy and moves no KV: the same requests on a stock
vLLM engine, on one with our connector (kv_both) and a CPU offload tier, and on one with the
connector and no tier.

    .venv/bin/python -m bench.fleet.connector_cost [--model real] [--reps 2] [--concurrency 4]

The fleet benchmark's data-parallel engines (`ours-dp*`, bench/fleet/setups.py) carry our
connector, its broker session and (but for `ours-dp-gpu-only`) a CPU tier of
DP_CPU_TIER_BLOCKS blocks. The stock engines of its `rr` and `prefix` setups carry none of them.
Past saturation, whatever the connector costs a step is served time lost, and this program
measures that cost alone: no request is ever pulled or offered to another engine.

The three engines are started once, with the fleet's engine settings (block size 32, the same
KV cache), and serve in turn, one at a time. Each rep sends each engine REQUESTS prompts,
CONCURRENCY at a time: four 1,024-token system prompts, each followed by 64 tokens of its own
(a fresh set per rep and engine, so every rep starts from an empty prefix cache), 24 greedy
answer tokens each, streamed. The engines take turns in an order that alternates per rep. Per
run: wall time, the CPU seconds of the engine's processes (from /proc), TTFT p50 and time per
output token p50. The figure is each setup's CPU seconds against the stock engine's, medians
over the reps. Writes bench/results/connector_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet.driver import Turn, one_turn
from bench.fleet.setups import Context
from bench.harness.engines import broker_connector_config
from bench.harness.output import load_note, log, write_json
from kvbroker.tools.demo_stack import DP_CPU_TIER_BLOCKS
from kvbroker.tools.launch import EngineProcess
from kvbroker.tools.real_model import ensure_real_model
from kvbroker.tools.tiny_model import build_tiny_model
from testkit.processes import BrokerProcess

SYSTEM_TOKENS = 1024
OWN_TOKENS = 64
ANSWER_TOKENS = 24
CLASSES = 4
# Token ids as bench.fleet's workload draws them: valid in both models' vocabularies.
TOKEN_BASE, TOKEN_SPAN = 10, 400


def prompts(seed: int, n: int) -> list[list[int]]:
    """`n` prompts: CLASSES system prompts in turn, each followed by tokens of the prompt's own."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(TOKEN_BASE, TOKEN_BASE + TOKEN_SPAN) for _ in range(k)]

    systems = [tokens(SYSTEM_TOKENS) for _ in range(CLASSES)]
    return [systems[i % CLASSES] + tokens(OWN_TOKENS) for i in range(n)]


async def serve(url: str, model: str, batch: list[list[int]], concurrency: int) -> dict[str, float]:
    """Stream every prompt's answer, `concurrency` at a time, timed as bench.fleet times a turn
    (driver.one_turn): wall seconds, TTFT and TPOT p50 (ms)."""
    gate = asyncio.Semaphore(concurrency)
    turns: list[Turn] = []

    async def one(http: aiohttp.ClientSession, i: int, prompt: list[int]) -> None:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        turn = Turn(f"cost-{i}", 0, 0.0, len(prompt))
        async with gate:
            await one_turn(http, url, body, turn.sid, turn)
        turns.append(turn)

    started = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(one(http, i, p) for i, p in enumerate(batch)))
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "ttft_ms_p50": statistics.median(t.ttft_s for t in turns) * 1000,
        "tpot_ms_p50": statistics.median(t.tpot_s for t in turns) * 1000,
    }


def ratios(runs: dict[str, list[dict[str, float]]], key: str, base: str = "stock") -> dict[str, float]:
    """Each setup's median of `key` over its runs, against `base`'s median."""
    ref = statistics.median(r[key] for r in runs[base])
    return {name: statistics.median(r[key] for r in rs) / ref for name, rs in runs.items()}


async def main_async(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvbroker-connector-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}")
    if args.model == "real":
        model, served = ensure_real_model(log=log), "smollm2"
    else:
        model, served = build_tiny_model(work / "model"), None
    ctx = Context(model=model, work=work, engines=3, start_timeout_s=args.start_timeout_s, served_name=served)
    broker = BrokerProcess(work, log_name="broker.log").start()
    setups: dict[str, EngineProcess] = {"stock": ctx.engine("stock")}
    for name, extra in (("ours-cpu-tier", {"cpu_tier_blocks": DP_CPU_TIER_BLOCKS}), ("ours-no-tier", {})):
        config = broker_connector_config(broker.address, name, "both", work / f"{name}-stats.json", **extra)
        setups[name] = ctx.engine(name, kv_transfer_config=config)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    try:
        for engine in setups.values():
            engine.start()
        for engine in setups.values():
            engine.wait_ready(args.start_timeout_s)
        log(f"engines up; load average {load_note()}")
        names = list(setups)
        for rep in range(args.reps):
            for k, name in enumerate(names if rep % 2 == 0 else names[::-1]):
                engine = setups[name]
                batch = prompts(args.seed + 100 * rep + k, args.requests)
                cpu0 = sum(engine.cpu_seconds().values())
                run = await serve(engine.url, ctx.model_name, batch, args.concurrency)
                run["cpu_s"] = sum(engine.cpu_seconds().values()) - cpu0
                runs[name].append(run)
                log(
                    f"rep {rep + 1} {name}: {run['wall_s']:.1f} s, {run['cpu_s']:.1f} CPU s, TTFT p50 "
                    f"{run['ttft_ms_p50']:.0f} ms, TPOT p50 {run['tpot_ms_p50']:.1f} ms"
                )
    finally:
        for engine in setups.values():
            engine.stop()
        broker.stop()
    cpu = ratios(runs, "cpu_s")
    wall = ratios(runs, "wall_s")
    tpot = ratios(runs, "tpot_ms_p50")
    load = load_note()
    print(
        f"the same {args.requests} requests, {args.concurrency} at a time, median of {args.reps} reps (load average {load}):"
    )
    for name in runs:
        print(
            f"  {name:14s} CPU {cpu[name]:.3f}x, wall {wall[name]:.3f}x, TPOT p50 {tpot[name]:.3f}x the stock engine's"
        )
    result: dict[str, Any] = {
        "load": load,
        "settings": {k: v for k, v in vars(args).items() if k != "workdir"},
        "runs": runs,
        "cpu_vs_stock": cpu,
        "wall_vs_stock": wall,
        "tpot_vs_stock": tpot,
    }
    log(f"wrote {write_json(args.name, result, Path(args.out_dir) if args.out_dir else None)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", choices=("tiny", "real"), default="real", help="tiny (built here) or SmolLM2-135M"
    )
    ap.add_argument("--reps", type=int, default=2, help="runs per engine, the order alternating")
    ap.add_argument("--requests", type=int, default=48, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--seed", type=int, default=1000, help="prompts' seed")
    ap.add_argument(
        "--start-timeout-s", type=float, default=400.0, help="how long an engine may take to start"
    )
    ap.add_argument("--workdir", default="", help="model and logs (default: a new temp dir)")
    ap.add_argument("--name", default="connector_cost", help="bench/results/NAME.json")
    ap.add_argument("--out-dir", default="", help="write NAME.json here instead of bench/results")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
