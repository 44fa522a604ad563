"""The VRAM data path in one short run: every byte checked, speed against NIXL's and torch's own.

Made for a lent GPU machine (one GPU, no vLLM, no internet): scripts/gpu_check.sh
installs the carried wheels (NIXL, protobuf, pytest) and runs this. Without
CUDA the same code runs on DRAM: the dry run the test suite does, so the
check cannot rot between device runs (its figures mean nothing).

Two processes on the one GPU, each with our own data path (BlockMover over
one NIXL agent, UCX, NIXL's progress thread off; CpuTierBuffer; the regions
`regions_from_kv_caches` maps). The holder (bench/data_path/gpu_check_holder.py) has
the KV caches of the tiny test model and of SmolLM2-135M in VRAM, in the
layouts engines use (bench/data_path/kv_layouts.py: vLLM 0.32's per-layer pages, K and
V apart per layer, block-outermost), and a pinned CPU tier holding a history.
For each model, layout and history the reader (this process):

- reads the holder's VRAM blocks into its VRAM KV cache, peer to peer (UCX
  cuda_ipc), against one contiguous NIXL read of the same byte count between
  two flat VRAM buffers (a bare nixl_agent; target >= 0.9);
- reads the holder's pinned CPU tier into its VRAM, against torch's pinned
  host-to-device copy of the same bytes (target >= 0.8; a contiguous NIXL
  read host to VRAM is shown beside it), and the holder's VRAM into its own
  pinned tier, against torch's device-to-host copy (shown);
- stores its VRAM blocks into its own pinned CPU tier and loads them back
  (CpuTierBuffer, what an engine does with its offloaded blocks), against
  torch's copies (the load: target >= 0.8);
- checks every byte each of those delivered (and what the contiguous
  reference read delivered) before timing it.

Then it runs the five CUDA tests (pytest -m cuda; they skip without CUDA).
Each part stands alone: one that fails is reported in the table, and the
others still run. Prints one table with PASS/FAIL per target and writes JSON.
Exit status: 1 on any wrong byte or failed test, 2 when a part could not run,
else 0 (a missed speed target is reported, not an exit status).

    python -m bench.data_path.gpu_check                  # on a GPU: 1,024 and 4,096 tokens, under a minute
    python -m bench.data_path.gpu_check --quick          # the dry run's sizes (64 tokens, two layouts)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from bench.data_path.gpu_check_holder import FLAT_SEED, HOLDER, Plan, holder_main, seed_of
from bench.data_path.gpu_check_parts import (
    P2P_TARGET,
    READ_TIMEOUT_S,
    TIER_TARGET,
    CaseMemory,
    HistoryParts,
    RawNixl,
    Row,
    guarded,
    run_cuda_tests,
)
from bench.data_path.kv_layouts import LAYOUTS, MODELS, fill, kv_caches
from bench.harness.output import RESULTS_DIR, log, write_json

READER = "gpucheck-reader"


class Check:
    """The reader: buffers every case shares, the mover, and the reference agent."""

    def __init__(self, plan: Plan, args: argparse.Namespace) -> None:
        self.plan, self.reps = plan, args.reps
        self.deadline = time.monotonic() + args.budget_s
        self.cuda = plan.device == "cuda"
        size = plan.flat_bytes()
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)  # torch's copies
        self.devbuf = torch.empty(size, dtype=torch.uint8, device=plan.device)
        self.flat = torch.empty(size, dtype=torch.uint8, device=plan.device)  # contiguous reads land here
        self.flat_want = torch.empty(size, dtype=torch.uint8, device=plan.device)
        fill(self.flat_want, FLAT_SEED)
        self.keep: list[Any] = []  # registered with NIXL until the end: never freed earlier
        self.info: dict[str, Any] | None = None
        self.nixl_error: str | None = None
        self.mover: Any = None
        self.raw: RawNixl | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def connect(self, info: dict[str, Any]) -> None:
        from kvbroker.engine_adapter.block_mover import BlockMover

        # No ticker: only this thread calls into NIXL, so the reference agent needs no lock.
        self.mover = BlockMover(READER, progress_interval_s=None, read_timeout_s=READ_TIMEOUT_S)
        self.mover.add_peer(HOLDER, info["metadata"])
        self.raw = RawNixl(info["metadata"])
        self.raw.register(self.flat, self.plan.mem_type)
        self.info = info

    def case(self, model: str, layout: str) -> list[Row]:
        from kvbroker.engine_adapter.cpu_tier import CpuTierBuffer
        from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches

        plan, index = self.plan, self.plan.cases().index((model, layout))
        pool = plan.pool(model)
        kv = kv_caches(MODELS[model], layout, pool, None, plan.device)
        want = kv_caches(MODELS[model], layout, pool, seed_of(model, layout), plan.device)
        regions, _, mem_type = regions_from_kv_caches(kv)
        tier = CpuTierBuffer(regions, plan.max_blocks(model))
        self.keep += [kv, tier]
        peer: dict[str, Any] = {}
        if self.info is not None and self.mover is not None:
            self.mover.register_tier(1000 + index, mem_type, regions, pool)
            self.mover.register_tier(2000 + index, tier.mem_type, tier.regions(), tier.num_slots)
            peer["gpu"], peer["gpu_blocks"] = self.info["gpu"][(model, layout)]
            peer["cpu"], peer["cpu_slots"], _ = self.info["cpu"][(model, layout)]
        mem = CaseMemory(model, layout, kv, want, tier, 1000 + index, 2000 + index, peer)
        rows: list[Row] = []
        for tokens in plan.histories:
            rows += HistoryParts(self, mem, tokens).rows()
        for r in rows:
            log(f"{r.part} {r.case}: {r.verdict} {r.gbps} GB/s ({r.ref} {r.ref_gbps})")
        return rows

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        if self.mover is not None:
            self.mover.close()
        for item in self.keep:
            if hasattr(item, "close"):
                item.close()


def start_holder(plan: Plan) -> tuple[Any, Any, dict[str, Any] | None, str | None]:
    """(process, pipe, the holder's info or None, why not)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=holder_main, args=(child, plan), daemon=True)
    proc.start()
    deadline = time.monotonic() + 180
    while not conn.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            return proc, conn, None, f"the holder process did not start (exit code {proc.exitcode})"
    info = conn.recv()
    if "error" in info:
        return proc, conn, None, f"the holder failed: {info['error']}"
    return proc, conn, info, None


def run(plan: Plan, args: argparse.Namespace) -> list[Row]:
    check = Check(plan, args)
    proc = conn = None
    try:
        from kvbroker.engine_adapter.nixl_agent import real_nixl

        real_nixl()
        proc, conn, info, check.nixl_error = start_holder(plan)
        if info is not None:
            check.connect(info)
    except Exception as exc:  # no NIXL (or no numpy): the local tier rows and the tests still run
        check.nixl_error, check.info = f"{type(exc).__name__}: {exc}", None
    if check.nixl_error:
        log(f"the peer parts will not run: {check.nixl_error}")
    rows: list[Row] = []
    for model, layout in plan.cases():
        try:
            rows += check.case(model, layout)
        except Exception as exc:  # building the case's memory failed: one row says so
            rows.append(Row("case setup", f"{model} {layout}", error=f"{type(exc).__name__}: {exc}"))
    check.close()
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.send("stop")
    if proc is not None:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    # The tests run even when the transfers spent the budget (they have their own timeout).
    rows.append(guarded(Row("CUDA tests", "pytest -m cuda"), run_cuda_tests, check.deadline + 60))
    return rows


def table(rows: list[Row], device: str) -> str:
    def num(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    head = (
        f"{'part':<30} {'model layout tokens':<32} {'MB':>7} {'GB/s':>8} {'reference':<15} "
        f"{'ref GB/s':>8} {'ratio':>5} {'target':>6} {'bytes':<5} verdict"
    )
    lines = [f"data path on {device}", head, "-" * len(head)]
    last_error = None
    for r in rows:
        same = {True: "same", False: "WRONG", None: "-"}[r.bytes_ok]
        lines.append(
            f"{r.part:<30} {r.case:<32} {r.nbytes / 1e6:>7.2f} {num(r.gbps):>8} {r.ref:<15} "
            f"{num(r.ref_gbps):>8} {num(r.ratio):>5} {num(r.target, '>={:.1f}'):>6} {same:<5} {r.verdict}"
        )
        if r.error:
            lines.append("    (the same)" if r.error == last_error else f"    {r.error}")
            last_error = r.error
        if "contiguous_nixl_host_to_device_gbps" in r.extra:
            lines.append(
                f"    contiguous NIXL host -> device: {r.extra['contiguous_nixl_host_to_device_gbps']} GB/s"
            )
        if "contiguous_nixl_host_to_device_error" in r.extra:
            lines.append(
                f"    contiguous NIXL host -> device failed: {r.extra['contiguous_nixl_host_to_device_error']}"
            )
    return "\n".join(lines)


def environment(plan: Plan) -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "device": torch.cuda.get_device_name(0) if plan.device == "cuda" else "DRAM (no CUDA: the dry run)",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "packages": {
            d: version(d) for d in ("nixl", "nixl-cu13", "nixl-cu12", "numpy", "protobuf", "pytest")
        },
        "ucx_nixl_env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
        "cpu_count": os.cpu_count(),
    }


def verdict_of(rows: list[Row], device: str) -> tuple[str, int]:
    """The closing line, and the exit status: 1 wrong bytes or failed tests, 2 a part did not run."""
    wrong = [r for r in rows if r.verdict == "WRONG BYTES" or (r.verdict == "FAIL" and r.target is None)]
    errors = [r for r in rows if r.verdict == "ERROR"]
    judged = [r for r in rows if r.target is not None and r.verdict in ("PASS", "FAIL")]
    passed = sum(r.verdict == "PASS" for r in judged)
    line = f"targets: {passed} PASS, {len(judged) - passed} FAIL; "
    line += "WRONG: " + "; ".join(f"{r.part} {r.case}" for r in wrong) if wrong else "every byte identical"
    if errors:
        line += f"; {len(errors)} part(s) could not run"
    if device != "cuda":
        line += " (DRAM dry run: the targets are for VRAM, these figures judge nothing)"
    return line, 1 if wrong else (2 if errors else 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--models", type=csv, default=list(MODELS), help="comma separated (default: all)")
    p.add_argument("--layouts", type=csv, help="comma separated (default: all; --quick: cpu,kv_split)")
    p.add_argument(
        "--histories", type=lambda s: [int(x) for x in csv(s)], help="tokens (default 1024,4096; --quick: 64)"
    )
    p.add_argument("--reps", type=int, default=9, help="timed repetitions per method (default 9)")
    p.add_argument(
        "--quick", action="store_true", help="the dry run's sizes: 64 tokens, cpu and kv_split, 2 reps"
    )
    p.add_argument("--dram", action="store_true", help="DRAM even where CUDA is present (the dry run)")
    p.add_argument(
        "--budget-s", type=float, default=240, help="parts not started by then are reported, not run"
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where gpu_check.json goes")
    args = p.parse_args(argv)
    if args.layouts is None:
        args.layouts = ["cpu", "kv_split"] if args.quick else list(LAYOUTS)
    if args.histories is None:
        args.histories = [64] if args.quick else [1024, 4096]
    if args.quick:
        args.reps = 2
    bad = [m for m in args.models if m not in MODELS] + [x for x in args.layouts if x not in LAYOUTS]
    if bad:
        p.error(f"unknown model or layout: {bad}")
    device = "cuda" if torch.cuda.is_available() and not args.dram else "cpu"
    torch.set_num_threads(1)  # CPU-side copies in one thread, like the NIXL reads they are compared with
    plan = Plan(tuple(args.models), tuple(args.layouts), tuple(args.histories), device)
    started = time.monotonic()
    env = environment(plan)
    log(f"data path check on {env['device']}; packages {env['packages']}")
    rows = run(plan, args)
    text = table(rows, env["device"])
    line, status = verdict_of(rows, device)
    print(text)
    print(line)
    doc = {
        "settings": {
            "models": list(plan.models),
            "layouts": list(plan.layouts),
            "histories": list(plan.histories),
            "reps": args.reps,
            "mem_type": plan.mem_type,
            "targets": {
                "peer_vram_read_vs_contiguous_nixl": P2P_TARGET,
                "cpu_tier_to_vram_vs_torch_h2d": TIER_TARGET,
            },
            "wall_s": round(time.monotonic() - started, 1),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        },
        "environment": env,
        "results": [asdict(r) | {"ratio": r.ratio, "verdict": r.verdict} for r in rows],
        "verdict": line,
        "exit_status": status,
        "table": text,
    }
    name = "gpu_check" if device == "cuda" else "gpu_check_dram"
    print(f"wrote {write_json(name, doc, args.out_dir)}")
    return status


if __name__ == "__main__":
    status = main()
    from kvbroker.engine_adapter.nixl_agent import exit_skipping_nixl_teardown

    exit_skipping_nixl_teardown(status)
