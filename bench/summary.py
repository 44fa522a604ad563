"""Print the README's benchmark summary from the JSON the benchmarks wrote.

Usage: python -m bench.summary [--results bench/results]

Nothing in the summary is typed by hand: the README section between the
BENCH-SUMMARY markers is this program's output, pasted (or rewritten in place
with --write-readme).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- BENCH-SUMMARY:BEGIN -->", "<!-- BENCH-SUMMARY:END -->"


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _targets(results: Path) -> str:
    """The target table the control-plane benchmark printed (its own text)."""
    for name in ("control_plane", "broker_bench"):
        txt = results / f"{name}.txt"
        if txt.exists():
            text = txt.read_text()
            start = text.find("target ")
            if start >= 0:
                return text[start:].strip()
    return "(no control-plane results yet: run `make bench`)"


def _data_path(d: dict[str, Any]) -> str:
    """vLLM's CPU layout, sequential block ids (the judged rows), and the target verdicts."""
    rows = [
        "| model | history | MB | descriptors | adapter GB/s | one contiguous read GB/s, flat buffers "
        "| one contiguous read GB/s, KV memory | raw NIXL GB/s | memcpy GB/s | adapter / contiguous (flat, KV) "
        "| adapter spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(m: dict[str, Any] | None) -> str:
        if m is None:
            return "-"
        text = f"{m['gbps_median']:.2f} ({m['gbps_min']:.2f}..{m['gbps_max']:.2f})"
        return f"INVALID {text} ({'; '.join(m['invalid'])})" if m.get("invalid") else text

    for r in d["results"]:
        if r.get("layout") != "cpu" or r.get("pattern") != "runs":
            continue
        rows.append(
            f"| {r['model']} | {r['history_tokens']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['descriptors_per_block_and_region']} -> {r['descriptors_adapter']} | {cell(r['adapter'])} | "
            f"{cell(r['contiguous'])} | {cell(r.get('contiguous_kv'))} | {cell(r['raw_nixl'])} | "
            f"{cell(r['memcpy'])} | {r['adapter_vs_contiguous']:.2f}, "
            f"{r.get('adapter_vs_contiguous_kv', float('nan')):.2f} | {r['adapter']['spread']:.2f}x |"
        )
    for v in d.get("targets", []):
        rows.append("")
        rows.append(
            f"{v['model']}: {v['target']}: worst {v['worst_ratio']:.2f}x"
            + (
                f" ({v['worst_ratio_flat_buffers']:.2f}x of the flat buffers' read)"
                if "worst_ratio_flat_buffers" in v
                else ""
            )
            + f", spread {v['worst_spread']:.2f}x: **{v['verdict']}**"
        )
    load = d.get("settings", {}).get("load_avg_before_after")
    if load:
        rows.append("")
        rows.append(f"Load average (1/5/15 min) before, after the run: {load[0]}, {load[1]} on 2 cores.")
    return "\n".join(rows)


def _chat_compare(d: dict[str, Any], results: Path) -> str:
    """The real-model chat comparison: its table (with the targets) and its plot."""
    s = d.get("settings", {})
    head = (
        f"**Multi-turn chats on a real model, four ways** (`bench/chats/compare.py`, {s.get('mode', '?')} mode, "
        f"{d.get('date_utc', '?')}; {s.get('conversations', '?')} chats x {s.get('turns', '?')} turns, "
        f"first prompt {min(s.get('first_prompt_tokens') or [0])} tokens, answers {s.get('answer_tokens', '?')} "
        f"tokens; load at the end {d.get('load_at_end', '?')}; {d.get('note', '')}):"
    )
    if d.get("complete") is False:
        head += " **partial run: the setups not shown did not finish.**"
    parts = [head, "```\n" + str(d["table"]).strip() + "\n```"]
    if (results / "chat_compare.png").exists():
        parts.append("![TTFT per turn, four setups](bench/results/chat_compare.png)")
    return "\n\n".join(parts)


def summary(results: Path) -> str:
    out: list[str] = []
    cp = _load(results, "control_plane") or _load(results, "broker_bench")
    if cp is not None:
        out.append(
            f"**Control plane** (`bench/control_plane/compare.py`, {cp.get('mode', '?')} mode, "
            f"{cp.get('date_utc', '?')}; {cp.get('note', '')}):"
        )
        out.append("```\n" + _targets(results) + "\n```")
    for name, program, title in (
        ("reclaim", "bench/fleet/reclaim.py", "Lease reclamation after kill -9 of the reader"),
        (
            "idle_hold",
            "bench/fleet/idle_hold.py",
            "Engine CPU while it only holds blocks for a reader (cores; 1.00 = one core)",
        ),
        (
            "multiturn_ttft",
            "bench/chats/multiturn_ttft.py",
            "Multi-turn, turn-2 TTFT, pull vs recompute, tiny random-weight model",
        ),
        (
            "pd_compare",
            "bench/chats/pd_compare.py",
            "P/D three ways on the tiny random-weight model: one engine, NixlConnector, kvbroker "
            "(TTFT ms p50/p90 per turn)",
        ),
        (
            "pull_policy",
            "bench/chats/pull_policy.py",
            "Pull or recompute: turn-2 TTFT per policy, adaptive against the fixed rules",
        ),
    ):
        d = _load(results, name)
        if d is not None:
            out.append(f"**{title}** (`{program}`, {d.get('date_utc', '?')}; {d.get('note', '')}):")
            out.append("```\n" + str(d["table"]).strip() + "\n```")
    chat = _load(results, "chat_compare")
    if chat is not None:
        out.append(_chat_compare(chat, results))
    dp = _load(results, "data_path")
    if dp is not None:
        out.append(
            f"**Data path at real KV layouts** (`bench/data_path/reads.py`, {dp.get('date_utc', '?')}; "
            f"{dp.get('note', '')}), vLLM CPU layout, sequential block ids, median (min..max); "
            "every layout and pattern: `bench/results/data_path.json`:"
        )
        out.append(_data_path(dp))
    return "\n\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--write-readme", action="store_true", help="rewrite the README section in place")
    args = parser.parse_args()
    text = summary(args.results)
    if args.write_readme:
        readme = ROOT / "README.md"
        body = readme.read_text()
        block = f"{BEGIN}\n{text}\n{END}"
        body = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: block, body, flags=re.S)
        readme.write_text(body)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
