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
    rows = ["| block | adapter GB/s | raw NIXL GB/s | memcpy GB/s | adapter / raw |", "|---|---|---|---|---|"]
    for r in d["results"]:
        kib = r["block_bytes"] // 1024
        size = f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"

        def cell(m: dict[str, Any]) -> str:
            text = f"{m['gbps_median']:.2f} ({m['gbps_min']:.2f}..{m['gbps_max']:.2f})"
            return f"INVALID {text} ({'; '.join(m['invalid'])})" if m.get("invalid") else text

        rows.append(
            f"| {size} | {cell(r['adapter'])} | {cell(r['raw_nixl'])} | {cell(r['memcpy'])} | "
            f"{r['adapter_vs_raw']:.2f} |"
        )
    return "\n".join(rows)


def summary(results: Path) -> str:
    out: list[str] = []
    cp = _load(results, "control_plane") or _load(results, "broker_bench")
    if cp is not None:
        out.append(
            f"**Control plane** (`bench/control_plane.py`, {cp.get('mode', '?')} mode, "
            f"{cp.get('date_utc', '?')}; {cp.get('note', '')}):"
        )
        out.append("```\n" + _targets(results) + "\n```")
    for name, title in (
        ("reclaim", "Lease reclamation after kill -9 of the reader"),
        ("idle_hold", "Engine CPU while it only holds blocks for a reader (cores; 1.00 = one core)"),
        ("multiturn_ttft", "Multi-turn, turn-2 TTFT, pull vs recompute"),
        ("pd_compare", "P/D three ways: one engine, NixlConnector, kvbroker (TTFT ms p50/p90 per turn)"),
        ("pull_policy", "Pull or recompute: turn-2 TTFT per policy, adaptive against the fixed rules"),
    ):
        d = _load(results, name)
        if d is not None:
            out.append(f"**{title}** (`bench/{name}.py`, {d.get('date_utc', '?')}; {d.get('note', '')}):")
            out.append("```\n" + str(d["table"]).strip() + "\n```")
    dp = _load(results, "data_path")
    if dp is not None:
        out.append(
            f"**Data path** (`bench/data_path.py`, {dp.get('date_utc', '?')}; {dp.get('note', '')}), median (min..max):"
        )
        out.append(_data_path(dp))
    return "\n\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
