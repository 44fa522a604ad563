"""Tables, target checks and charts built from the result dicts of bench.control_plane.measure."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.checks import invalid_reason, is_invalid
from bench.harness.loops import med, spread
from bench.harness.output import fmt_num, fmt_spread, format_table
from bench.harness.plot import Bar, bar_panels

# (label, system key, figure key) of every lookup row, floors first.
LOOKUP_ROWS: list[tuple[str, str, str]] = [
    ("grpc.aio unary echo, 64 x fixed64 (floor)", "grpc", "unary"),
    ("grpc.aio bidi stream ping-pong (floor)", "grpc", "stream"),
    ("Redis MGET 64 keys", "redis", "mget"),
    ("Redis Lua chain walk (server-side)", "redis", "lua"),
    ("Mooncake batch_is_exist 64 keys", "mooncake", "batch_is_exist"),
    ("broker resolve over session stream", "broker", "resolve_session"),
    ("broker resolve on engine-local mirror", "broker", "resolve_mirror"),
    ("broker unary Resolve", "broker", "resolve_unary"),
]


# The broker's inventory measurements: (result key, row in the side-by-side
# publishing table, row label in the broker's own table).
INVENTORY_ROWS: list[tuple[str, str, str]] = [
    ("inventory", "broker InventoryUpdate of 64 over sessions", "inventory, 64-block updates"),
    (
        "inventory_with_mirror",
        "broker InventoryUpdate of 64, one index mirror following",
        "inventory, one mirror following",
    ),
    (
        "inventory_engine_session",
        "broker EngineSession.announce_stored of 64 (coalesced)",
        "inventory, EngineSession (coalesced)",
    ),
]


def _fig(results: dict[str, Any], system: str, key: str, c: int) -> dict[str, Any] | None:
    sysres = results.get(system) or {}
    if not sysres.get("available"):
        return None
    return (sysres.get(key) or {}).get(f"c{c}")


def unavailable_lines(results: dict[str, Any]) -> list[str]:
    return [
        f"  {name}: not measured: {res.get('reason', 'unknown')}"
        for name, res in results.items()
        if isinstance(res, dict) and res.get("available") is False
    ]


def lookup_table(results: dict[str, Any], concurrency: Sequence[int]) -> str:
    headers = ["lookup of a 64-block chain"]
    for c in concurrency:
        headers += [f"p50 us ({c} cl)", f"p99 us ({c} cl)", f"ops/s ({c} cl)", f"srv CPU us/op ({c} cl)"]
    rows = []
    for label, system, key in LOOKUP_ROWS:
        figs = [_fig(results, system, key, c) for c in concurrency]
        if all(f is None for f in figs):
            continue
        row = [label]
        for f in figs:
            row += [
                fmt_spread(f, "p50_us"),
                fmt_num(med(f, "p99_us")),
                fmt_spread(f, "ops_per_s"),
                fmt_num(med(f, "server_cpu_us_per_op")),
            ]
        rows.append(row)
    return format_table(headers, rows)


def publish_table(results: dict[str, Any], concurrency: Sequence[int]) -> str:
    headers = ["publishing blocks"] + [f"blocks/s ({c} cl)" for c in concurrency]
    rows = []
    redis = results.get("redis") or {}
    if redis.get("available"):
        rows.append(
            ["Redis pipeline of 64 SET PX"]
            + [fmt_spread(redis["publish"].get(f"c{c}"), "blocks_per_s") for c in concurrency]
        )
    broker = results.get("broker") or {}
    for key, label, _ in INVENTORY_ROWS:
        if broker.get("available") and broker.get(key):
            rows.append([label] + [fmt_spread(broker[key].get(f"c{c}"), "blocks_per_s") for c in concurrency])
    return format_table(headers, rows) if rows else ""


def memory_table(results: dict[str, Any]) -> str:
    headers = ["memory per indexed block", "entries", "bytes/entry", "how"]
    rows = []
    redis = results.get("redis") or {}
    if redis.get("available") and redis.get("memory"):
        m = redis["memory"]
        rows.append(
            [
                "Redis string + PX",
                f"{m['keys']:,}",
                fmt_num(m["used_memory_bytes_per_key"]),
                "INFO used_memory delta",
            ]
        )
    mc = results.get("mooncake") or {}
    if mc.get("available") and mc.get("memory"):
        m = mc["memory"]
        rows.append(
            [
                "Mooncake master object (1 B value)",
                f"{m['keys']:,}",
                fmt_num(m["rss_bytes_per_key"]),
                "master RSS delta",
            ]
        )
    broker = results.get("broker") or {}
    if broker.get("available") and broker.get("memory"):
        for p in broker["memory"]["points"]:
            rows.append(
                [
                    "broker index",
                    f"{p['blocks_indexed']:,}",
                    fmt_num(p["bytes_per_block"]),
                    "broker RSS delta",
                ]
            )
    inproc = results.get("index_inprocess") or {}
    for p in inproc.get("points", []):
        rows.append(
            [
                "broker index alone, in process",
                f"{p['blocks']:,}",
                fmt_num(p["bytes_per_block"]),
                "RSS delta of a fresh process",
            ]
        )
    return format_table(headers, rows) if rows else ""


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def targets(results: dict[str, Any], hi_c: int = 16) -> list[dict[str, Any]]:
    """The broker's targets, as ratios to the peers measured in the same run."""
    out: list[dict[str, Any]] = []
    mooncake = _fig(results, "mooncake", "batch_is_exist", 1)
    mget = _fig(results, "redis", "mget", 1)
    mooncake16 = _fig(results, "mooncake", "batch_is_exist", hi_c)

    def add(
        name: str,
        our: float,
        peer: float,
        limit: float,
        lower_is_better: bool,
        unit: str,
        figs: Sequence[dict[str, Any] | None] = (),
    ) -> None:
        r = _ratio(our, peer)
        met = (r <= limit) if lower_is_better else (r >= limit)
        row: dict[str, Any] = {
            "target": name,
            "ours": our,
            "peer": peer,
            "ratio": r,
            "limit": limit,
            "lower_is_better": lower_is_better,
            "unit": unit,
            "met": bool(met) if r == r else None,
        }
        # A figure that failed its consistency check (bench.harness.checks) judges nothing.
        bad = [invalid_reason(f) for f in figs if is_invalid(f)]
        if bad:
            row["met"] = None
            row["verdict"] = "invalid"
            row["invalid"] = bad
        out.append(row)

    # The engine side resolves on its index mirror (no round trip); the session-stream
    # rows show what a round trip to the broker costs, for routers and mirror-less engines.
    for key, how in (("resolve_mirror", "engine-local mirror"), ("resolve_session", "session stream")):
        ours = _fig(results, "broker", key, 1)
        if ours and mooncake:
            add(
                f"resolve p50 ({how}) <= Mooncake batch_is_exist p50",
                med(ours, "p50_us"),
                med(mooncake, "p50_us"),
                1.0,
                True,
                "us",
                (ours, mooncake),
            )
        if ours and mget:
            add(
                f"resolve p50 ({how}) <= 0.7 x Redis MGET p50",
                med(ours, "p50_us"),
                med(mget, "p50_us"),
                0.7,
                True,
                "us",
                (ours, mget),
            )
        ours16 = _fig(results, "broker", key, hi_c)
        if ours16 and mooncake16:
            add(
                f"resolves/s ({how}) with {hi_c} clients >= Mooncake's",
                med(ours16, "ops_per_s"),
                med(mooncake16, "ops_per_s"),
                1.0,
                False,
                "ops/s",
                (ours16, mooncake16),
            )
    broker = results.get("broker") or {}
    redis = results.get("redis") or {}
    # The engine's path (EngineSession coalesces announces on its stream), then one
    # InventoryUpdate message per 64-block chain (the shape of Redis's pipelines).
    for key, how in (("inventory_engine_session", "engine session"), ("inventory", "64-block messages")):
        for c in (1, hi_c):
            inv = (broker.get(key) or {}).get(f"c{c}") if broker.get("available") else None
            pub = (redis.get("publish") or {}).get(f"c{c}") if redis.get("available") else None
            if inv and pub:
                add(
                    f"inventory blocks/s ({how}, {c} cl) >= 10 x Redis pipelined SET PX",
                    med(inv, "blocks_per_s"),
                    med(pub, "blocks_per_s"),
                    10.0,
                    False,
                    "blocks/s",
                    (inv, pub),
                )
    points = (broker.get("memory") or {}).get("points", []) if broker.get("available") else []
    if points:
        p = points[-1]
        bpb = float(p["bytes_per_block"])
        out.append(
            {
                "target": f"memory <= 150 B/block (at {p['blocks_indexed']:,} blocks)",
                "ours": bpb,
                "peer": None,
                "ratio": None,
                "limit": 150.0,
                "lower_is_better": True,
                "unit": "B/block",
                "met": bpb <= 150.0,
            }
        )
    return out


def targets_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["target", "broker", "peer", "ratio", "need", "verdict"]
    body = []
    for t in rows:
        need = (
            ("<= " if t["lower_is_better"] else ">= ")
            + fmt_num(t["limit"])
            + ("" if t["ratio"] is not None else f" {t['unit']}")
        )
        verdict = t.get("verdict") or {True: "met", False: "MISSED", None: "-"}[t["met"]]
        if verdict == "invalid":
            verdict = f"invalid ({'; '.join(t.get('invalid', []))})"
        body.append(
            [
                t["target"],
                fmt_num(t["ours"], " " + t["unit"]),
                fmt_num(t["peer"], " " + t["unit"]) if t["peer"] is not None else "",
                f"{t['ratio']:.2f}x" if t["ratio"] is not None and t["ratio"] == t["ratio"] else "",
                need + ("x" if t["ratio"] is not None else ""),
                verdict,
            ]
        )
    return format_table(headers, body)


def plot_lookup(
    results: dict[str, Any], concurrency: Sequence[int], path: Path, title: str, footnote: str
) -> Path | None:
    panels = []
    for c in concurrency:
        lat, thr = [], []
        for label, system, key in LOOKUP_ROWS:
            f = _fig(results, system, key, c)
            if f is None:
                continue
            lo, hi = spread(f, "p50_us")
            lat.append(Bar(label, med(f, "p50_us"), lo, hi))
            lo, hi = spread(f, "ops_per_s")
            thr.append(Bar(label, med(f, "ops_per_s"), lo, hi))
        panels.append(
            (f"p50 latency, {c} client{'s' if c > 1 else ''}", "microseconds (lower is better)", lat)
        )
        panels.append((f"throughput, {c} client{'s' if c > 1 else ''}", "lookups/s (higher is better)", thr))
    return bar_panels(path, title, panels, footnote)


def broker_table(results: dict[str, Any], concurrency: Sequence[int]) -> str:
    """The broker's own figures: resolve over sessions and unary, inventory rate."""
    broker = results.get("broker") or {}
    if not broker.get("available"):
        return ""
    headers = ["broker figure"] + [f"{c} client{'s' if c > 1 else ''}" for c in concurrency]
    rows = []
    for key, label in (
        ("resolve_mirror", "resolve on the engine-local index mirror"),
        ("resolve_session", "resolve over session stream"),
        ("resolve_unary", "unary Resolve"),
    ):
        figs = [(broker.get(key) or {}).get(f"c{c}") for c in concurrency]
        rows.append([f"{label}: p50 us"] + [fmt_spread(f, "p50_us") for f in figs])
        rows.append([f"{label}: p99 us"] + [fmt_spread(f, "p99_us") for f in figs])
        rows.append([f"{label}: resolves/s"] + [fmt_spread(f, "ops_per_s") for f in figs])
        rows.append(
            [f"{label}: broker CPU us per resolve"] + [fmt_spread(f, "server_cpu_us_per_op") for f in figs]
        )
    for key, _, label in INVENTORY_ROWS:
        inv = broker.get(key) or {}
        if inv or key == "inventory":
            rows.append(
                [f"{label}: blocks/s"] + [fmt_spread(inv.get(f"c{c}"), "blocks_per_s") for c in concurrency]
            )
            rows.append(
                [f"{label}: broker CPU ns per block"]
                + [fmt_spread(inv.get(f"c{c}"), "server_cpu_ns_per_block") for c in concurrency]
            )
    sync = broker.get("mirror_sync")
    if sync:
        rows.append(
            [f"mirror snapshot of {sync['blocks']:,} blocks: seconds", fmt_num(sync["seconds"])]
            + [""] * (len(concurrency) - 1)
        )
    lag = broker.get("mirror_lag")
    if lag:
        rows.append(
            [
                "mirror lag, announce -> visible: p50 / p99 us",
                f"{fmt_num(lag['p50_us'])} / {fmt_num(lag['p99_us'])}",
            ]
            + [""] * (len(concurrency) - 1)
        )
    mem = broker.get("memory") or {}
    for p in mem.get("points", []):
        label = f"bulk load to {p['blocks_indexed']:,} blocks, all sessions ({mem.get('load_batch_blocks')}-block updates): blocks/s"
        rows.append([label, fmt_num(p["load_blocks_per_s"])] + [""] * (len(concurrency) - 1))
    return format_table(headers, rows)
