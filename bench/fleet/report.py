"""The fleet benchmark's figures: one run (a setup at a rate) summarized, the table, the plot.

Definitions (printed with the table and in docs/bench.md):

- goodput: completed requests whose TTFT <= the TTFT SLO and whose time per output
  token after the first <= the TPOT SLO, per second of the run's wall time; the
  completed requests that missed it, by what they missed (TTFT only, TPOT only, both);
- goodput ceiling: what no setup can pass on this plan at this rate: every request
  meeting the SLO, over the shortest wall time the plan allows when every turn takes as
  long as the run's quickest (a session's turns follow one another, so the run lasts
  until its latest session's last answer; `Plan.min_wall_s`);
- throughput: completed requests (and output tokens) per second of wall time;
- recomputed tokens: prompt tokens the engines computed (vLLM's
  `vllm:prompt_tokens_by_source{source="local_compute"}`, summed over every engine of
  the setup, so in P/D both P's prefill and D's last token);
- prefix reuse: 1 - recomputed / prompt tokens sent: the share of prompt tokens no engine
  computed for this request (served from a local prefix cache or pulled), against the
  ideal for the workload (bench.fleet.agent_sessions: a perfect fleet-wide cache);
- cached tokens (client): the sum of `usage.prompt_tokens_details.cached_tokens` the
  client saw (in P/D that is D's, where the handed-over prompt counts as cached);
- pulled tokens: `vllm:prompt_tokens_by_source{source="external_kv_transfer"}` summed over
  the engines (every connector, ours and NixlConnector); pulled blocks and bytes: our
  connector's own counters (its stats file); for NixlConnector the bytes are estimated
  from the tokens and the model's KV bytes per token;
- steps/load: our connector's readers' scheduler steps from a load's block allocation to
  its prefill, averaged over the run's loads (1 the fewest; docs/adapter.md "A pull's steps").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.fleet.agent_sessions import Plan
from bench.fleet.driver import RunRecord
from bench.harness.output import format_table
from bench.harness.plot import line_panels


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def summarize(
    record: RunRecord,
    plan: Plan,
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    sources: tuple[dict[str, int], dict[str, int]],
    connector: tuple[dict[str, int], dict[str, int]],
    kv_bytes_per_token: int,
) -> dict[str, Any]:
    ok = [t for t in record.turns if not t.error]
    # (TTFT over its SLO, TPOT over its SLO) per completed turn: goodput counts (False, False).
    missed = Counter((t.ttft_s > slo_ttft_s, t.tpot_s > slo_tpot_s) for t in ok)
    good = missed[(False, False)]
    wall = max(record.wall_s, 1e-9)
    prompt = sum(t.prompt_tokens for t in record.turns)
    ideal_map = plan.ideal_cached_tokens()
    ideal = sum(ideal_map[(t.sid, t.turn)] for t in record.turns)
    before, after = sources
    recomputed = _delta(after, before, "local_compute")
    pulled = _delta(after, before, "external_kv_transfer")
    pulled_bytes = _delta(connector[1], connector[0], "pulled_bytes")
    loads_ready = _delta(connector[1], connector[0], "loads_ready")
    reuse = max(0.0, 1.0 - recomputed / prompt) if prompt else float("nan")
    ideal_share = ideal / prompt if prompt else float("nan")
    ttfts = [t.ttft_s * 1000 for t in ok]
    quickest = min((t.e2e_s for t in ok), default=0.0)
    return {
        "rate_offered_rps": plan.rate,
        "requests_sent": len(record.turns),
        "completed": len(ok),
        "failed": len(record.turns) - len(ok),
        "not_sent": record.not_sent,
        "errors": sorted({t.error for t in record.turns if t.error})[:5],
        "wall_s": round(record.wall_s, 2),
        "goodput_rps": round(good / wall, 3),
        # No setup's goodput can pass this: every request meeting the SLO, in the shortest run the
        # plan allows when each turn takes as long as this run's quickest (its sessions' turns follow
        # one another; Plan.min_wall_s).
        "goodput_ceiling_rps": round(plan.requests / max(plan.min_wall_s(quickest), 1e-9), 3),
        # Why the completed requests that missed the SLO missed it.
        "missed_ttft_only": missed[(True, False)],
        "missed_tpot_only": missed[(False, True)],
        "missed_both": missed[(True, True)],
        # Every completed turn, for where the time went: (session, turn, sent s, TTFT ms, TPOT ms).
        "turns": [
            [t.sid, t.turn, round(t.sent_s, 2), round(t.ttft_s * 1000, 1), round(t.tpot_s * 1000, 1)]
            for t in ok
        ],
        "throughput_rps": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(sum(t.output_tokens for t in ok) / wall, 1),
        "ttft_ms": {q: round(pct(ttfts, v), 1) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "tpot_ms_p50": round(pct([t.tpot_s * 1000 for t in ok], 0.5), 2),
        "tpot_ms_p90": round(pct([t.tpot_s * 1000 for t in ok], 0.9), 2),
        # Sending to the last token: where a wait went (before the first token or after it) aside.
        "e2e_ms": {
            q: round(pct([t.e2e_s * 1000 for t in ok], v), 1) for q, v in (("p50", 0.5), ("p90", 0.9))
        },
        "prompt_tokens": prompt,
        "recomputed_tokens": recomputed,
        "local_cache_hit_tokens": _delta(after, before, "local_cache_hit"),
        "client_cached_tokens": sum(t.cached_tokens for t in ok),
        "prefix_reuse": round(reuse, 4),
        "ideal_reuse": round(ideal_share, 4),
        "reuse_of_ideal": round(reuse / ideal_share, 3) if ideal_share else float("nan"),
        "pulled_tokens": pulled,
        "pulled_blocks": _delta(connector[1], connector[0], "pulled_blocks"),
        "pulled_blocks_cpu_tier": _delta(connector[1], connector[0], "pulled_blocks_tier_cpu"),
        "restored_blocks_own_cpu_tier": _delta(connector[1], connector[0], "cpu_restored_blocks"),
        "pulled_bytes": pulled_bytes if pulled_bytes else pulled * kv_bytes_per_token,
        "pulled_bytes_estimated": not pulled_bytes and pulled > 0,
        # The readers' scheduler steps from a load's allocation to its prefill (1 the fewest;
        # docs/adapter.md "A pull's steps"), averaged over the run's loads; None without loads.
        "load_ready_steps_mean": round(
            _delta(connector[1], connector[0], "load_ready_steps") / loads_ready, 2
        )
        if loads_ready
        else None,
    }


def per_engine(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, Any]]:
    """One run's share of each engine (differences of its vLLM counters): requests it finished,
    prompt tokens it computed, and its requests' mean time per output token. An engine that took
    more than its share, or decoded slower than the others, shows here."""
    out: dict[str, dict[str, Any]] = {}
    for name, now in after.items():
        then = before.get(name, {})
        grew = {key: value - then.get(key, 0.0) for key, value in now.items()}
        tpots = grew.get("tpot_count", 0.0)
        out[name] = {
            "requests": round(grew.get("requests", 0.0)),
            "computed_tokens": round(grew.get("source:local_compute", 0.0)),
            "tpot_ms_mean": round(1000 * grew.get("tpot_s_sum", 0.0) / tpots, 1) if tpots else None,
        }
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    headers = [
        "setup",
        "rate/s",
        "goodput/s (ceiling)",
        "missed ttft/tpot/both",
        "req/s",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90 ms",
        "e2e p50/p90 s",
        "per engine: req/TPOT ms",
        "reuse (ideal)",
        "recomputed",
        "pulled tok (bytes)",
        "steps/load",
        "failed",
        "leases left",
    ]
    rows, notes = [], []
    for name, entry in results.items():
        if "unavailable" in entry:
            rows.append([name, "-", "unavailable", *["-"] * 12])
            notes.append(f"{name} unavailable: {entry['unavailable']}")
            continue
        for r in entry["runs"]:
            t = r["ttft_ms"]
            rows.append(
                [
                    name,
                    f"{r['rate_offered_rps']:g}",
                    f"{r['goodput_rps']:.2f} ({r['goodput_ceiling_rps']:.2f})",
                    f"{r['missed_ttft_only']}/{r['missed_tpot_only']}/{r['missed_both']}",
                    f"{r['throughput_rps']:.2f}",
                    f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f}",
                    f"{r['tpot_ms_p50']:.0f}" + (f" / {r['tpot_ms_p90']:.0f}" if "tpot_ms_p90" in r else ""),
                    _e2e_cell(r.get("e2e_ms")),
                    _engines_cell(r.get("per_engine")),
                    f"{r['prefix_reuse']:.0%} ({r['ideal_reuse']:.0%})",
                    str(r["recomputed_tokens"]),
                    f"{r['pulled_tokens']} ({r['pulled_bytes'] / 2**20:.1f} MiB)",
                    "-" if r.get("load_ready_steps_mean") is None else f"{r['load_ready_steps_mean']:g}",
                    f"{r['failed']}+{r['not_sent']} not sent",
                    "-" if r.get("leases_left") is None else str(r["leases_left"]),
                ]
            )
    return "\n".join([format_table(headers, rows), *notes])


def _e2e_cell(e2e: dict[str, float] | None) -> str:
    return "-" if not e2e else f"{e2e['p50'] / 1000:.1f} / {e2e['p90'] / 1000:.1f}"


def _engines_cell(engines: dict[str, dict[str, Any]] | None) -> str:
    if not engines:
        return "-"
    return " ".join(
        f"{e['requests']}/{'-' if e['tpot_ms_mean'] is None else format(e['tpot_ms_mean'], '.0f')}"
        for e in engines.values()
    )


def plot(results: dict[str, dict[str, Any]], path: Path, title: str, footnote: str) -> Path | None:
    goodput: dict[str, Sequence[tuple[float, float]]] = {}
    ttft: dict[str, Sequence[tuple[float, float]]] = {}
    for name, entry in results.items():
        for r in entry.get("runs", []):
            goodput[name] = [*goodput.get(name, []), (r["rate_offered_rps"], r["goodput_rps"])]
            ttft[name] = [*ttft.get(name, []), (r["rate_offered_rps"], r["ttft_ms"]["p90"])]
    if not goodput:
        return None
    return line_panels(
        path,
        title,
        [
            ("goodput at the SLO", "offered requests/s", "requests/s meeting the SLO", goodput),
            ("p90 TTFT", "offered requests/s", "ms", ttft),
        ],
        footnote,
    )


# Our proxy's counters a run records (from its /metrics): the key in the record, the metric.
PROXY_COUNTS = {
    "route_reasons": "kvbroker_proxy_route_choices_total",  # the placement's choices, by reason
    "admission_orders": "kvbroker_proxy_admission_wait_seconds_count",  # who went, by order
    "early_first_tokens": "kvbroker_proxy_early_first_tokens_total",  # by result
}


def proxy_counts(metrics_text: str) -> dict[str, dict[str, int]]:
    """PROXY_COUNTS read from a Prometheus text page, by their one label's value; a counter
    the proxy does not have (admission off, say) is left out."""
    out = {}
    for key, metric in PROXY_COUNTS.items():
        found = re.findall(rf'^{metric}\{{\w+="([^"]+)"\}} ([0-9.e+]+)$', metrics_text, re.MULTILINE)
        if found:
            out[key] = {label: int(float(n)) for label, n in found}
    return out
