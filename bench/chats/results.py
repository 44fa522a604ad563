"""What bench.chats.compare makes of its turns: percentiles per setup and turn, the
identical-answer check, the targets (ratios within the run), the printed report and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.chats.pd_results import pct
from bench.harness.output import format_table

LABELS = {
    "single": "one engine, prefix cache",
    "nocache": "one engine, no prefix cache",
    "nixl": "vLLM NixlConnector P/D",
    "broker": "kvbroker P/D",
    "broker-local": "kvbroker P/D, D serves held turns alone",
}
HISTORY_TARGET = 2048


def _p50_p90(xs: list[float]) -> dict[str, Any] | None:
    ms = [x * 1000 for x in xs]
    if not ms:
        return None
    return {
        "p50_ms": round(pct(ms, 50), 1),
        "p90_ms": round(pct(ms, 90), 1),
        "values_ms": [round(v, 1) for v in ms],
    }


def _span(xs: list[int]) -> str:
    return f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}..{max(xs)}"


def per_turn(setups: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """setup -> "turnN" -> figures."""
    out: dict[str, dict[str, Any]] = {}
    for name, s in setups.items():
        if not s.get("available"):
            continue
        rows = s["rows"]
        for turn in sorted({r["turn"] for r in rows}):
            every = [r for r in rows if r["turn"] == turn]
            ok = [r for r in every if "error" not in r and "fallback" not in r]
            fallback = sum(1 for r in every if "fallback" in r)
            entry: dict[str, Any] = {
                "ok": len(ok),
                "failed": len(every) - len(ok) - fallback,
                "fallback": fallback,
            }
            if ok:
                entry.update(
                    prompt_tokens=[r["prompt_tokens"] for r in ok],
                    ttft=_p50_p90([r["ttft_s"] for r in ok]),
                    turn_latency=_p50_p90([r["turn_s"] for r in ok]),
                    cached_tokens=[r["cached_tokens"] for r in ok],
                )
                if any("pulled_tokens" in r for r in ok):
                    entry["pulled_tokens"] = {
                        eng: [r["pulled_tokens"].get(eng, 0) for r in ok] for eng in ok[0]["pulled_tokens"]
                    }
            out.setdefault(name, {})[f"turn{turn}"] = entry
    return out


def compare_answers(setups: dict[str, Any]) -> dict[str, Any]:
    """Per (conversation, turn): are the greedy answers token-identical across the setups that ran?"""
    ran = [n for n, s in setups.items() if s.get("available")]
    by: dict[tuple[str, int], dict[str, Any]] = {}
    for n in ran:
        for r in setups[n]["rows"]:
            if "error" not in r:
                by.setdefault((r["conversation"], r["turn"]), {})[n] = r.get("token_ids") or r.get("text")
    cases = {}
    for (conv, turn), answers in sorted(by.items()):
        distinct = {json.dumps(a) for a in answers.values()}
        cases[f"{conv} turn{turn}"] = {
            "identical": len(answers) == len(ran) and len(distinct) == 1,
            "compared": sorted(answers),
        }
    return {"all": bool(cases) and all(c["identical"] for c in cases.values()), "setups": ran, "cases": cases}


def throughput(setups: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, s in setups.items():
        if not s.get("available"):
            continue
        ok = [r for r in s["rows"] if "error" not in r]
        wall = s["wall_s"] or 1e-9
        out[name] = {
            "turns_per_s": round(len(ok) / wall, 3),
            "answer_tokens_per_s": round(sum(r["answer_tokens"] for r in ok) / wall, 1),
            "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in ok) / wall, 1),
            "wall_s": s["wall_s"],
        }
    return out


def _p50(results: dict[str, Any], setup: str, turn: int) -> float | None:
    t = results.get(setup, {}).get(f"turn{turn}", {}).get("ttft")
    return float(t["p50_ms"]) if t else None


def targets(results: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """The four targets as ratios of p50 TTFTs in this run."""
    turn2_prompts = results.get("broker", {}).get("turn2", {}).get("prompt_tokens") or [0]
    applies = mode == "full" and min(turn2_prompts) >= HISTORY_TARGET
    b1, b2 = _p50(results, "broker", 1), _p50(results, "broker", 2)
    s1, s2 = _p50(results, "single", 1), _p50(results, "single", 2)
    n2 = _p50(results, "nocache", 2)
    out = []

    def add(name: str, value: float | None, bound: float, higher_is_better: bool, unit: str) -> None:
        if value is None:
            verdict = "not measured"
        elif not applies:
            verdict = "n/a (history < 2,048 tokens)"
        else:
            verdict = "met" if (value >= bound if higher_is_better else value <= bound) else "MISSED"
        out.append(
            {
                "target": name,
                "value": None if value is None else round(value, 2),
                "bound": bound,
                "unit": unit,
                "verdict": verdict,
            }
        )

    add("turn-2 TTFT: recompute / kvbroker P/D >= 10x", n2 / b2 if n2 and b2 else None, 10.0, True, "x")
    add(
        "turn-2 TTFT: kvbroker P/D / prefix-cache hit <= 1.5x",
        b2 / s2 if b2 and s2 else None,
        1.5,
        False,
        "x",
    )
    add("turn-1 TTFT: kvbroker P/D / one engine <= 1.15x", b1 / s1 if b1 and s1 else None, 1.15, False, "x")
    turns = sorted(int(k[4:]) for k in results.get("broker", {}))
    for t in turns:
        b, n = _p50(results, "broker", t), _p50(results, "nixl", t)
        add(
            f"turn-{t} TTFT: kvbroker P/D / NixlConnector P/D < 1x",
            b / n if b and n else None,
            1.0,
            False,
            "x",
        )
    return out


def evaluate(setups: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    results = per_turn(setups)
    return {
        "results": results,
        "identical": compare_answers(setups),
        "throughput": throughput(setups),
        "targets": targets(results, settings["mode"]),
    }


def _transfer_lines(setups: dict[str, Any]) -> list[str]:
    lines = []
    for eng, reads in (setups.get("broker", {}).get("transfers") or {}).items():
        if reads:
            ms = [r["ms"] for r in reads]
            lines.append(
                f"kvbroker {eng} NIXL reads: {len(reads)}, {sum(r['blocks'] for r in reads)} blocks, "
                f"{sum(r['bytes'] for r in reads) / 2**20:.1f} MiB, p50 {pct(ms, 50):.1f} ms, p90 {pct(ms, 90):.1f} ms"
            )
        else:
            lines.append(f"kvbroker {eng} NIXL reads: none")
    for eng, t in (setups.get("nixl", {}).get("transfers") or {}).items():
        lines.append(
            f"NixlConnector {eng} reads: {t['transfers']} transfers, {t['mb']} MB, mean {t['mean_xfer_ms']} ms, "
            f"worst interval p90 {t['max_interval_p90_xfer_ms']} ms"
        )
    stats = setups.get("nixl", {}).get("proxy_stats")
    if stats:
        lines.append(
            f"NixlConnector proxy: {stats['turns']} turns, P offered D's blocks {stats['offered_read_back']} times, "
            f"D params kept {stats['decode_params_kept']}, missing {stats['decode_params_missing']}"
        )
    return lines


def report(doc: dict[str, Any], setups: dict[str, Any], load_end: str) -> str:
    results = doc["results"]
    rows = []
    for name in LABELS:
        for turn_key, e in results.get(name, {}).items():
            if not e["ok"]:
                rows.append(
                    [name, turn_key[4:], "-", "none", "-", "-", "-", f"{e['failed']}/{e['fallback']}"]
                )
                continue
            pulled = e.get("pulled_tokens")
            rows.append(
                [
                    name,
                    turn_key[4:],
                    _span(e["prompt_tokens"]),
                    f"{e['ttft']['p50_ms']:.0f} / {e['ttft']['p90_ms']:.0f}",
                    f"{e['turn_latency']['p50_ms']:.0f} / {e['turn_latency']['p90_ms']:.0f}",
                    _span(e["cached_tokens"]),
                    " ".join(f"{k} {_span(v)}" for k, v in pulled.items()) if pulled else "-",
                    f"{e['failed']}/{e['fallback']}",
                ]
            )
    table = format_table(
        [
            "setup",
            "turn",
            "prompt tok",
            "TTFT ms p50/p90",
            "turn ms p50/p90",
            "cached (answering engine)",
            "pulled tokens",
            "failed/fallback",
        ],
        rows,
    )
    tp = doc["throughput"]
    lines = [f"Multi-turn chat, real model; machine shared, load at the end {load_end}", table, ""]
    lines += [
        f"throughput {n}: {v['turns_per_s']} turns/s, {v['answer_tokens_per_s']} answer tok/s, "
        f"{v['prompt_tokens_per_s']} prompt tok/s ({v['wall_s']} s)"
        for n, v in tp.items()
    ]
    lines += _transfer_lines(setups)
    same = doc["identical"]
    bad = [k for k, v in same["cases"].items() if not v["identical"]]
    lines.append(
        f"identical greedy tokens across {', '.join(same['setups'])}: "
        + ("yes, every turn" if same["all"] else f"NO for {len(bad)}: {', '.join(bad[:8])}")
    )
    lines.append("")
    lines.append(
        format_table(
            ["target", "value", "verdict"],
            [
                [t["target"], "-" if t["value"] is None else f"{t['value']:.2f}x", t["verdict"]]
                for t in doc["targets"]
            ],
        )
    )
    return "\n".join(lines)


def plot_ttft(doc: dict[str, Any], path: Path) -> Path | None:
    """TTFT p50 per turn for each setup (log scale), whiskers to p90."""
    from bench.harness.plot import matplotlib_missing

    if matplotlib_missing() or not doc["results"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = {
        "single": "#2ca02c",
        "nocache": "#7f7f7f",
        "nixl": "#1f77b4",
        "broker": "#d62728",
        "broker-local": "#ff7f0e",
    }
    for name, label in LABELS.items():
        res = doc["results"].get(name)
        if not res:
            continue
        turns = sorted(int(k[4:]) for k, e in res.items() if e.get("ttft"))
        p50 = [res[f"turn{t}"]["ttft"]["p50_ms"] for t in turns]
        p90 = [res[f"turn{t}"]["ttft"]["p90_ms"] for t in turns]
        ax.errorbar(
            turns,
            p50,
            yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p90, strict=True)]],
            marker="o",
            capsize=3,
            label=label,
            color=colors[name],
        )
        for t, v in zip(turns, p50, strict=True):
            ax.annotate(f"{v:,.0f}", (t, v), textcoords="offset points", xytext=(6, 2), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT at the client, ms (p50, whisker to p90)")
    ax.set_xticks(sorted({int(k[4:]) for r in doc["results"].values() for k in r}))
    s = doc.get("settings", {})
    ax.set_title(
        f"SmolLM2-135M, {s.get('conversations', '?')} chats, first prompt "
        f"{min(s.get('first_prompt_tokens') or [0])} tokens, answers {s.get('answer_tokens', '?')} tokens",
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
