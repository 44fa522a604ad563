"""Consistency checks every throughput figure passes before it is printed or judged.

A benchmark can be wrong in ways no single number shows: a clock started late, an
operation counted twice, a wall time that misses part of the work. These checks
compare a figure with what the same run says elsewhere and with what the machine
can do at all:

- Little's law: ``c`` closed-loop clients whose operations take ``L`` seconds on
  average cannot complete more than ``c / L`` operations a second (each client's
  measured operations run one after another inside the wall time).
- CPU-bound work in one process cannot go faster than the machine's cores times
  the one-client rate.
- Bytes moved (GB/s, or blocks/s times the bytes of a block) cannot exceed this
  machine's memcpy bandwidth.

A figure that fails is marked ``{"invalid": [reasons]}``: the tables print it as
INVALID with the reason, a target judged from it gets the verdict "invalid", and
the program exits non-zero (``exit_code``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from typing import Any

# Timer overhead and per-run jitter: a figure may exceed its bound by this much.
LITTLE_TOLERANCE = 0.10
CORES_TOLERANCE = 0.25
MEMCPY_TOLERANCE = 0.25
INVALID_KEY = "invalid"


def little_law_reason(ops_per_s: float, clients: int, mean_latency_s: float) -> str | None:
    """Why ``ops_per_s`` is impossible for ``clients`` closed-loop clients, or None."""
    if ops_per_s != ops_per_s or ops_per_s <= 0:  # NaN or nothing done
        return None
    if mean_latency_s <= 0 or clients <= 0:
        return f"{ops_per_s:,.0f} ops/s with a mean latency of {mean_latency_s * 1e6:.2f} us"
    bound = clients / mean_latency_s
    if ops_per_s > bound * (1 + LITTLE_TOLERANCE):
        return (
            f"Little's law: {ops_per_s:,.0f} ops/s > {clients} clients / mean latency "
            f"{mean_latency_s * 1e6:.2f} us = {bound:,.0f} ops/s"
        )
    return None


def cores_reason(
    ops_per_s: float, clients: int, one_client_ops_per_s: float, cores: int | None = None
) -> str | None:
    """Why CPU-bound in-process work at ``ops_per_s`` with ``clients`` is impossible, or None."""
    n = min(clients, cores or os.cpu_count() or 1)
    if (
        not (ops_per_s == ops_per_s and one_client_ops_per_s == one_client_ops_per_s)
        or one_client_ops_per_s <= 0
    ):
        return None
    bound = n * one_client_ops_per_s
    if ops_per_s > bound * (1 + CORES_TOLERANCE):
        return (
            f"CPU-bound in one process: {ops_per_s:,.0f} ops/s > {n} core(s) x the 1-client rate "
            f"{one_client_ops_per_s:,.0f} ops/s = {bound:,.0f} ops/s"
        )
    return None


def bandwidth_reason(gb_per_s: float, memcpy_gb_per_s: float, what: str = "") -> str | None:
    """Why moving ``gb_per_s`` is impossible on a machine whose memcpy does ``memcpy_gb_per_s``."""
    if not (gb_per_s == gb_per_s and memcpy_gb_per_s == memcpy_gb_per_s) or memcpy_gb_per_s <= 0:
        return None
    if gb_per_s > memcpy_gb_per_s * (1 + MEMCPY_TOLERANCE):
        return f"{what}{gb_per_s:.2f} GB/s > this machine's memcpy {memcpy_gb_per_s:.2f} GB/s"
    return None


@functools.cache
def memcpy_gb_per_s(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """This machine's memcpy bandwidth (best of ``reps`` copies of ``nbytes``), measured once."""
    src = bytearray(b"\x01") * nbytes
    dst = bytearray(nbytes)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


# --------------------------------------------------------------------------- marking figures


def mark(fig: dict[str, Any], reason: str) -> None:
    reasons = fig.setdefault(INVALID_KEY, [])
    if reason not in reasons:
        reasons.append(reason)


def is_invalid(fig: dict[str, Any] | None) -> bool:
    return bool(fig and fig.get(INVALID_KEY))


def invalid_reason(fig: dict[str, Any] | None) -> str:
    return "; ".join(fig.get(INVALID_KEY, [])) if fig else ""


def _figures(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every dict in a results tree that holds a throughput figure (ops/s, blocks/s)."""
    if isinstance(node, dict):
        if "ops_per_s" in node or "blocks_per_s" in node:
            yield path, node
        for k, v in node.items():
            if isinstance(v, dict):
                yield from _figures(v, f"{path}.{k}" if path else str(k))


def one_client_rate(fig: dict[str, Any]) -> float:
    """What one client does per second, for the cores check: the best of its measured
    ops/s and 1 / its p50 latency (a pause on a busy machine lowers the measured rate
    of one repetition; the p50 of the operation itself is what one core can repeat)."""
    rates = list(fig["ops_per_s"].get("runs") or [fig["ops_per_s"]["median"]])
    p50s = [x for x in (fig.get("p50_us", {}).get("runs") or []) if x and x > 0]
    if p50s:
        rates.append(1e6 / min(p50s))
    return max(r for r in rates if r == r) if any(r == r for r in rates) else float("nan")


def validate_results(results: dict[str, Any], memcpy: float | None = None) -> list[str]:
    """Check every figure in a benchmark's results (in place); return 'path: reason' lines.

    Run-level checks (Little's law) were made when the runs were aggregated
    (bench.harness.loops.aggregate); this adds the checks that need several figures (the
    cores check of in-process work against its 1-client rate) or the machine
    (blocks/s against memcpy), and collects every failure.
    """
    memcpy_bw = memcpy if memcpy is not None else memcpy_gb_per_s()
    figs = list(_figures(results))
    by_parent: dict[str, dict[str, dict[str, Any]]] = {}
    for path, fig in figs:
        parent, _, leaf = path.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = fig
    for path, fig in figs:
        parent, _, leaf = path.rpartition(".")
        if fig.get("in_process") and leaf.startswith("c") and leaf != "c1":
            one = by_parent.get(parent, {}).get("c1")
            clients = int(fig.get("clients") or leaf[1:])
            if one is not None:
                one_rate = one_client_rate(one)
                for v in fig["ops_per_s"].get("runs") or [fig["ops_per_s"]["median"]]:
                    why = cores_reason(v, clients, one_rate)
                    if why:
                        mark(fig, why)
                        break
        bpb = fig.get("bytes_per_block")
        if bpb and "blocks_per_s" in fig:
            rate = fig["blocks_per_s"].get("max") or fig["blocks_per_s"].get("median")
            if rate is not None:
                why = bandwidth_reason(rate * bpb / 1e9, memcpy_bw, f"{rate:,.0f} blocks/s x {bpb} B = ")
                if why:
                    mark(fig, why)
    return [f"{path}: {r}" for path, fig in figs for r in fig.get(INVALID_KEY, [])]


def check_gbps(fig: dict[str, Any], nbytes: int, what: str) -> list[str]:
    """Check a GB/s figure (``samples_gbps``, or its median) of transfers of ``nbytes``
    against memcpy of the same size on this machine; mark it and return 'what: reason'."""
    samples = fig.get("samples_gbps") or [fig.get("gbps_median", float("nan"))]
    why = bandwidth_reason(max(samples), memcpy_gb_per_s(nbytes), f"{nbytes >> 10} KiB transfers at ")
    if why:
        mark(fig, why)
        return [f"{what}: {why}"]
    return []


def report_invalid(lines: list[str]) -> str:
    """The text a program prints under its tables when figures failed their checks."""
    if not lines:
        return "Consistency checks (Little's law, cores, memcpy): every throughput figure passed."
    return "\n".join(
        ["INVALID figures (failed their consistency checks; their verdicts are 'invalid'):"]
        + [f"  {line}" for line in lines]
    )


def exit_code(lines: list[str]) -> int:
    return 3 if lines else 0
