"""What every benchmark program prints and writes: tables, figures with their spread, the JSON
record (with the machine and its load beside the numbers) and progress lines."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.checks import invalid_reason, is_invalid
from bench.harness.loops import med, spread

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def shared_cores_note() -> str:
    cores = os.cpu_count() or 0
    return (
        f"clients and servers run on the same machine and share its {cores} CPU cores "
        "(loopback, Python clients); figures include client-side Python overhead"
    )


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min)"


def fmt_num(x: float, unit: str = "") -> str:
    if x != x:  # NaN
        return "-"
    if abs(x) >= 100:
        s = f"{x:,.0f}"
    elif abs(x) >= 10:
        s = f"{x:.1f}"
    else:
        s = f"{x:.2f}"
    return s + unit


THROUGHPUT_KEYS = ("ops_per_s", "blocks_per_s", "gb_per_s")


def fmt_spread(d: dict[str, Any] | None, key: str) -> str:
    m = med(d, key)
    lo, hi = spread(d, key)
    if m != m:
        return "-"
    text = f"{fmt_num(m)} [{fmt_num(lo)}..{fmt_num(hi)}]"
    if key in THROUGHPUT_KEYS and is_invalid(d):
        return f"INVALID {text} ({invalid_reason(d)})"
    return text


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([line, sep, *body])


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
                break
    return {
        "hostname_hidden": True,
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(mem_kb / 2**20, 1),
        # Other work on the machine skews every figure: keep the load beside the numbers.
        "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out = out_dir or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info(),
        "note": shared_cores_note(),
        **payload,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def write_result(path: Path, result: dict[str, Any]) -> None:
    """A small benchmark's figures as they are, to `path` (its folder made), and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def log(msg: str) -> None:
    """Progress lines go to stderr so the table on stdout stays clean."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
