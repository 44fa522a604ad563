"""What retention buys: an agent session resumed after a pause longer than eviction allows.

    .venv/bin/python -m bench.chats.retention [--history 1536] [--reps 5] [--quick]

Starts a broker process and one vLLM engine E (the tiny random-weight model,
our BrokerConnector) with a small KV cache (--kv-blocks, default 128 blocks of
32 tokens), so that other traffic evicts an idle conversation from vLLM's
prefix cache.

Per repetition, one agent session in each of three setups (in turn, the
order rotating every repetition):

1. turn 1: a prompt of H - ANSWER tokens, a greedy answer of ANSWER tokens;
2. setup **retained** only: the router retains the session's history with the
   broker (`Retain`, token ids, a TTL of --ttl-s): E pins those blocks;
3. the pause: other sessions' prompts, --filler-x times E's KV cache in all
   (setup **warm** has no pause: turn 2 right after turn 1, the best case);
4. turn 2 = turn 1 + answer + NEW fresh tokens, streamed: time to first token
   at the client, and the tokens vLLM's prefix cache supplied (E's own
   `vllm:prefix_cache_hits` counter); then **retained** unretains.

Setups: **retained** (pinned through the pause), **evicted** (the same pause,
no pin: vLLM evicted the session and E recomputes it) and **warm**. Every
turn-2 answer is compared token for token with the same turn 2 computed from
scratch (a fresh cache_salt: a namespace nobody holds).
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from typing import Any

from bench.harness.engines import (
    BLOCK_SIZE,
    add_run_arguments,
    broker_engine,
    complete,
    output_ids,
    prepare_workdir,
    prompt_of,
    stream_ttft,
    summary,
    wait_for,
)
from bench.harness.output import format_table, load_note, log, write_json
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.hashing import wire_chain
from kvbroker.tools.launch import EngineProcess
from kvbroker.v1 import broker_pb2 as pb
from testkit.engines import recompute_reference
from testkit.processes import BrokerProcess

ANSWER_TOKENS = 32
NEW_TOKENS = 32
OUTPUT_TOKENS = 4
FILLER_TOKENS = 1024
# The tiny model: 2 layers x 2 KV heads x head size 32 x 32 tokens x K and V x 4 bytes.
BLOCK_BYTES = 2 * 2 * 32 * BLOCK_SIZE * 2 * 4
SETUPS = ("retained", "evicted", "warm")


def prefix_hits(engine: EngineProcess) -> float:
    """Tokens vLLM's prefix cache supplied so far (its own /metrics counter)."""
    text = urllib.request.urlopen(f"{engine.url}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total{")
    )


def named_blocks(client: BrokerClient, layout: str, engine_id: str, chain: list[int]) -> int:
    matches = client.resolve(namespace=pb.Namespace(layout_id=layout), block_hashes=chain).matches
    return max(
        (m.matched_blocks for m in matches if m.engine_id == engine_id and m.tier == pb.TIER_GPU), default=0
    )


class Session:
    """One agent session on E, in one setup."""

    def __init__(
        self, engine: EngineProcess, client: BrokerClient, layout: str, args: argparse.Namespace
    ) -> None:
        self.engine, self.client, self.layout, self.args = engine, client, layout, args
        self.fillers = 0

    def pause(self, seed: int) -> None:
        """Other sessions' prompts: --filler-x times E's KV cache."""
        count = max(1, round(self.args.filler_x * self.args.kv_blocks * BLOCK_SIZE / FILLER_TOKENS))
        for i in range(count):
            complete(self.engine, prompt_of(FILLER_TOKENS, seed * 1000 + i), max_tokens=1)
        self.fillers += count

    def run(self, setup: str, seed: int) -> dict[str, Any]:
        turn1 = prompt_of(self.args.history - ANSWER_TOKENS, seed)
        answer1 = output_ids(complete(self.engine, turn1, max_tokens=ANSWER_TOKENS))
        chain = wire_chain(turn1 + answer1[:-1], BLOCK_SIZE)  # what E computed of the session
        if not wait_for(lambda: named_blocks(self.client, self.layout, "E", chain) == len(chain), 15, 0.02):
            log(f"warning: the broker does not name E for session {seed}")
        lease_id = ""
        if setup == "retained":
            lease = self.client.retain(
                namespace=pb.Namespace(layout_id=self.layout),
                token_ids=turn1 + answer1[:-1],
                ttl_ms=int(self.args.ttl_s * 1000),
                engine_id="E",
                key=f"agent-{seed}",
            ).lease
            lease_id = lease.lease_id
        if setup != "warm":
            self.pause(seed + 500_000)
        kept = named_blocks(self.client, self.layout, "E", chain)
        turn2 = turn1 + answer1 + prompt_of(NEW_TOKENS, seed + 100_000)
        hits = prefix_hits(self.engine)
        ttft, ids = stream_ttft(self.engine, turn2, max_tokens=OUTPUT_TOKENS)
        wait_for(lambda: prefix_hits(self.engine) > hits, 2)  # the counter trails the answer
        hit_tokens = prefix_hits(self.engine) - hits
        # The same turn 2 computed from scratch (a namespace nobody holds): the answers must agree.
        reference = recompute_reference(self.engine, turn2, OUTPUT_TOKENS)
        if lease_id:
            self.client.unretain(lease_id=lease_id)
        return {
            "setup": setup,
            "seed": seed,
            "prompt_tokens": len(turn2),
            "history_blocks": len(chain),
            "blocks_named_after_pause": kept,
            "ttft_s": ttft,
            "cached_tokens": int(hit_tokens),
            "identical": ids == reference,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=1536, help="tokens of the session before turn 2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-blocks", type=int, default=128, help="E's KV cache, in blocks of 32 tokens")
    ap.add_argument("--filler-x", type=float, default=2.0, help="the pause's traffic, in KV caches")
    ap.add_argument("--ttl-s", type=float, default=600.0, help="the retention's TTL")
    ap.add_argument("--quick", action="store_true", help="2 repetitions, history 512 (a smoke run)")
    add_run_arguments(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.history = 2, 512
    name = "retention-quick" if args.quick else "retention"

    work, model = prepare_workdir(args, "kvbroker-retention-bench-")
    broker = BrokerProcess(work).start()
    engine, _stats = broker_engine(
        model,
        work,
        name="E",
        broker_address=broker.address,
        role="both",
        max_model_len=max(2048, args.history + NEW_TOKENS + OUTPUT_TOKENS + BLOCK_SIZE),
        kv_cache_bytes=args.kv_blocks * BLOCK_BYTES,
        log_stats=True,
    )
    rows: list[dict[str, Any]] = []
    try:
        engine.wait_ready(timeout=args.start_timeout_s, progress=log)
        with BrokerClient(broker.address) as client:
            wait_for(lambda: any(e.engine_id == "E" for e in client.list_engines().engines), 30)
            layout = next(e.layout_id for e in client.list_engines().engines if e.engine_id == "E")
            session = Session(engine, client, layout, args)
            session.run("warm", seed=1)  # warm-up, not recorded
            seed = 1000
            for rep in range(args.reps):
                order = SETUPS[rep % 3 :] + SETUPS[: rep % 3]
                for setup in order:
                    seed += 1
                    r = session.run(setup, seed)
                    log(
                        f"rep {rep} {setup}: TTFT {r['ttft_s'] * 1000:.1f} ms, {r['cached_tokens']} tokens "
                        f"from the prefix cache, {r['blocks_named_after_pause']}/{r['history_blocks']} blocks kept"
                    )
                    rows.append(r)
    finally:
        engine.stop()
        broker.stop()

    results: dict[str, Any] = {}
    for setup in SETUPS:
        rs = [r for r in rows if r["setup"] == setup]
        results[setup] = {
            "ttft": summary([r["ttft_s"] for r in rs]),
            "cached_tokens": sorted({r["cached_tokens"] for r in rs}),
            "blocks_kept": sorted({r["blocks_named_after_pause"] for r in rs}),
        }
    base = results["evicted"]["ttft"]["median_ms"]
    table = format_table(
        ["setup", "turn-2 TTFT ms med (min..max)", "tokens from prefix cache", "blocks kept", "evicted/this"],
        [
            [
                setup,
                f"{e['ttft']['median_ms']:.1f} ({e['ttft']['min_ms']:.1f}..{e['ttft']['max_ms']:.1f})",
                "/".join(map(str, e["cached_tokens"])),
                "/".join(map(str, e["blocks_kept"])),
                f"{base / e['ttft']['median_ms']:.2f}x",
            ]
            for setup, e in results.items()
        ],
    )
    print(
        f"agent session resumed after a pause of {args.filler_x:g}x E's KV cache of other traffic; "
        f"history {args.history} tokens, {args.reps} repetitions; load {load_note()}"
    )
    print(table)
    path = write_json(
        name,
        {
            "settings": {
                "history": args.history,
                "reps": args.reps,
                "kv_blocks": args.kv_blocks,
                "filler_x": args.filler_x,
                "filler_tokens": FILLER_TOKENS,
                "answer_tokens": ANSWER_TOKENS,
                "new_tokens": NEW_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
                "block_size": BLOCK_SIZE,
                "ttl_s": args.ttl_s,
                "model": "tiny random-weight Llama (kvbroker.tools.tiny_model defaults), float32, vLLM CPU",
                "ttft": "client-side, streamed /v1/completions over loopback HTTP",
                "cached_tokens": "delta of E's vllm:prefix_cache_hits counter over turn 2",
            },
            "results": results,
            "runs": rows,
            "table": table,
            "load_at_end": load_note(),
        },
        args.out_dir,
    )
    print(f"wrote {path}")
    kept_all = all(
        r["blocks_named_after_pause"] == r["history_blocks"] for r in rows if r["setup"] == "retained"
    )
    identical = all(r["identical"] for r in rows)
    print(f"retained sessions kept whole: {kept_all}; turn 2 token-identical to a recompute: {identical}")
    return 0 if kept_all and identical else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    log(f"done in {time.monotonic() - started:.0f} s")
    raise SystemExit(code)
