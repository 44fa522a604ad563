"""The parts bench/data_path/gpu_check.py measures, one row each: bytes checked first, then timed.

A part never raises to the check: `guarded` records what went wrong in the
part's row, so the table still shows every other part.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.data_path.gpu_check_holder import FIRST_REMOTE_BLOCK, HOLDER
from bench.data_path.kv_layouts import MODELS, blocks_of
from bench.harness.output import REPO_ROOT, log

P2P_TARGET = 0.9  # the adapter's peer read / one contiguous NIXL read of the same bytes
TIER_TARGET = 0.8  # CPU tier into VRAM / torch's pinned host-to-device copy
FIRST_LOCAL_BLOCK = 5
READ_TIMEOUT_S = 30.0
# The tests that need CUDA (marked `cuda`): four in the first file, one in the second.
CUDA_TESTS = ("tests/engine_adapter/test_cuda_transfers.py", "tests/engine_adapter/test_cpu_tier.py")
CUDA_TEST_COUNT = 5
CUDA_TESTS_TIMEOUT_S = 150


@dataclass
class Row:
    part: str
    case: str
    nbytes: int = 0
    ref: str = ""
    target: float | None = None
    gbps: float | None = None
    ref_gbps: float | None = None
    bytes_ok: bool | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.gbps is None or not self.ref_gbps:
            return None
        return self.gbps / self.ref_gbps

    @property
    def verdict(self) -> str:
        if "passed" in self.extra:  # the CUDA tests' row
            if self.extra["failed"]:
                return "FAIL"
            return "PASS" if self.extra["passed"] == CUDA_TEST_COUNT else "skipped"
        if self.bytes_ok is False:
            return "WRONG BYTES"
        if self.error is not None:
            return "ERROR"
        if self.target is None or self.ratio is None:
            return "info"
        return "PASS" if self.ratio >= self.target else "FAIL"


def guarded(row: Row, body: Callable[[Row], None], deadline: float) -> Row:
    """Run one part; whatever it raises is recorded in its row, and the check goes on."""
    if time.monotonic() > deadline:
        row.error = "not run: the time budget (--budget-s) was spent"
        return row
    try:
        body(row)
    except Exception as exc:  # a broken part must not hide the others' results
        row.error = f"{type(exc).__name__}: {exc}"
        log(f"{row.part} {row.case}: {row.error}")
    return row


def measure(
    methods: dict[str, Callable[[], object]], nbytes: int, reps: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median GB/s of each method after one warm call each; repetitions interleave, the order rotates."""
    for fn in methods.values():
        fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            start = time.perf_counter()
            methods[name]()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: round(nbytes / statistics.median(s) / 1e9, 3) for name, s in samples.items()}


class RawNixl:
    """A bare nixl_agent reading one contiguous descriptor: the reference the adapter is held to."""

    def __init__(self, holder_metadata: bytes) -> None:
        from kvbroker.engine_adapter.nixl_agent import create_agent, real_nixl

        self.agent = create_agent(real_nixl(), "gpucheck-raw")
        peer = self.agent.add_remote_agent(holder_metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.registered: list[Any] = []

    def register(self, buf: torch.Tensor, mem: str) -> None:
        desc = [(buf.data_ptr(), buf.nbytes, max(buf.get_device(), 0), "")]
        self.registered.append(self.agent.register_memory(desc, mem))

    def read(self, local: tuple[int, int, str], remote: tuple[int, int, str], nbytes: int) -> None:
        """READ nbytes from remote (address, device, memory type) into local (the same)."""
        import numpy as np

        (la, ld, lm), (ra, rd, rm) = local, remote
        local_dl = self.agent.get_xfer_descs(np.array([(la, nbytes, ld)], dtype=np.uint64), lm)
        remote_dl = self.agent.get_xfer_descs(np.array([(ra, nbytes, rd)], dtype=np.uint64), rm)
        xfer = self.agent.initialize_xfer("READ", local_dl, remote_dl, self.peer, b"")
        state = self.agent.transfer(xfer)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while state == "PROC":
            if time.monotonic() > deadline:
                raise RuntimeError(f"contiguous NIXL read timed out after {READ_TIMEOUT_S:g}s")
            state = self.agent.check_xfer_state(xfer)
        self.agent.release_xfer_handle(xfer)
        if state != "DONE":
            raise RuntimeError(f"contiguous NIXL read ended in state {state}")

    def close(self) -> None:
        for reg in self.registered:
            self.agent.deregister_memory(reg)
        self.agent.remove_remote_agent(self.peer)
        del self.agent


@dataclass
class CaseMemory:
    """One (model, layout) on the reader's side: its KV cache, the holder's contents, a CPU tier."""

    model: str
    layout: str
    kv: dict[str, torch.Tensor]  # where reads land (zeros between parts)
    want: dict[str, torch.Tensor]  # what the holder has (same seed), to compare with
    tier: Any  # CpuTierBuffer shaped like `kv`
    gpu_tier: int  # the mover's tier ids of `kv` and `tier`
    cpu_tier: int
    peer: dict[str, Any]  # holder's regions and block counts: gpu, gpu_blocks, cpu, cpu_slots


class HistoryParts:
    """The parts of one history (a run of blocks) of one case; `ctx` is the reader (gpu_check.Check)."""

    def __init__(self, ctx: Any, mem: CaseMemory, tokens: int) -> None:
        self.ctx, self.mem = ctx, mem
        n = ctx.plan.blocks(mem.model, tokens)
        self.nbytes = n * MODELS[mem.model].block_bytes
        self.remote = list(range(FIRST_REMOTE_BLOCK, FIRST_REMOTE_BLOCK + n))
        self.local = list(range(FIRST_LOCAL_BLOCK, FIRST_LOCAL_BLOCK + n))
        self.slots = list(range(n))
        self.case = f"{mem.model} {mem.layout} {tokens}"

    def rows(self) -> list[Row]:
        m, deadline, case, nbytes = self.ctx.plan.mem_type, self.ctx.deadline, self.case, self.nbytes
        rows = [
            guarded(
                Row(f"CPU tier -> {m} (local load)", case, nbytes, "torch H2D", TIER_TARGET),
                self.load,
                deadline,
            ),
            guarded(Row(f"{m} -> CPU tier (local store)", case, nbytes, "torch D2H"), self.store, deadline),
        ]
        peer = [
            (Row(f"{m} -> {m} (peer)", case, nbytes, "contiguous NIXL", P2P_TARGET), self.peer_read),
            (Row(f"CPU tier (peer) -> {m}", case, nbytes, "torch H2D", TIER_TARGET), self.peer_tier_in),
            (Row(f"{m} (peer) -> CPU tier", case, nbytes, "torch D2H"), self.peer_tier_out),
        ]
        for row, body in peer:
            if self.ctx.info is None:
                row.error = f"not run: {self.ctx.nixl_error}"
                rows.append(row)
            else:
                rows.append(guarded(row, body, deadline))
                if row.error is not None and "timed out" in row.error:
                    # A hung peer would cost every later peer part its whole timeout.
                    self.ctx.info, self.ctx.nixl_error = None, f"an earlier peer read hung ({row.error})"
        return rows

    # ------------------------------------------------------------ the parts

    def load(self, row: Row) -> None:
        """The local CPU tier into VRAM (CpuTierBuffer.start_load), against torch's H2D."""
        self._fill_tier()
        row.bytes_ok = self._kv_is(self.local)
        self._time(row, self._load, self._h2d)

    def store(self, row: Row) -> None:
        """VRAM into the local CPU tier (CpuTierBuffer.start_store), against torch's D2H."""
        self._fill_tier()
        row.bytes_ok = self._kv_is(self.local)
        self._time(row, self._store, self._d2h)

    def peer_read(self, row: Row) -> None:
        """The holder's VRAM blocks into ours, peer to peer, against one contiguous NIXL read."""
        peer = self.mem.peer
        ours = partial(
            self._read, peer["gpu"], self.remote, self.mem.gpu_tier, self.local, peer["gpu_blocks"]
        )
        self._zero_kv()
        ours()
        kv_ok = self._kv_is(self.remote)
        ref = partial(self._contiguous, self.ctx.plan.mem_type, "flat_device")
        self.ctx.flat[: self.nbytes].zero_()
        self.ctx.sync()
        ref()
        self.ctx.sync()
        ref_ok = torch.equal(self.ctx.flat[: self.nbytes], self.ctx.flat_want[: self.nbytes])
        row.bytes_ok, row.extra["reference_bytes_ok"] = kv_ok and ref_ok, ref_ok
        self._time(row, ours, ref)

    def peer_tier_in(self, row: Row) -> None:
        """The holder's pinned CPU tier into our VRAM, against torch's H2D (contiguous NIXL shown)."""
        peer = self.mem.peer
        ours = partial(
            self._read, peer["cpu"], self.slots, self.mem.gpu_tier, self.local, peer["cpu_slots"], "DRAM"
        )
        self._zero_kv()
        ours()
        row.bytes_ok = self._kv_is(self.remote)
        self._time(row, ours, self._h2d)
        # Shown beside it, what UCX itself gives host to device; its failure is not ours.
        raw = partial(self._contiguous, "DRAM", "flat_host")
        try:
            self.ctx.flat[: self.nbytes].zero_()
            self.ctx.sync()
            raw()
            self.ctx.sync()
            if not torch.equal(self.ctx.flat[: self.nbytes], self.ctx.flat_want[: self.nbytes]):
                row.bytes_ok = row.extra["reference_bytes_ok"] = False
            g = measure({"raw": raw}, self.nbytes, self.ctx.reps, self.ctx.sync)
            row.extra["contiguous_nixl_host_to_device_gbps"] = g["raw"]
        except Exception as exc:  # reported in the row; the part's own figures stand
            row.extra["contiguous_nixl_host_to_device_error"] = f"{type(exc).__name__}: {exc}"

    def peer_tier_out(self, row: Row) -> None:
        """The holder's VRAM into our pinned CPU tier, and back into VRAM to check; against torch's D2H."""
        peer, m = self.mem.peer, self.ctx.plan.mem_type
        ours = partial(
            self._read, peer["gpu"], self.remote, self.mem.cpu_tier, self.slots, peer["gpu_blocks"], m
        )
        self._zero_tier()
        ours()
        self._zero_kv()
        self._load()
        row.bytes_ok = self._kv_is(self.remote)
        self._time(row, ours, self._d2h)

    # -------------------------------------------------------------- helpers

    def _time(
        self, row: Row, ours: Callable[[], object], ref: Callable[[], object], **more: Any
    ) -> dict[str, float]:
        g = measure({"ours": ours, "ref": ref, **more}, self.nbytes, self.ctx.reps, self.ctx.sync)
        row.gbps, row.ref_gbps = g["ours"], g["ref"]
        return g

    def _read(
        self,
        peer_regions: Any,
        remote: list[int],
        tier: int,
        local: list[int],
        blocks: int,
        mem: str | None = None,
    ) -> None:
        mover = self.ctx.mover
        handle = mover.start_read(
            HOLDER, peer_regions, remote, tier, local, peer_num_blocks=blocks, peer_mem_type=mem
        )
        while True:
            done, failed = mover.poll()
            if handle in failed:
                raise RuntimeError(f"adapter read failed: {failed[handle]}")
            if handle in done:
                return

    def _contiguous(self, remote_mem: str, key: str) -> None:
        ctx = self.ctx
        dev = max(ctx.flat.get_device(), 0)
        ctx.raw.read(
            (ctx.flat.data_ptr(), dev, ctx.plan.mem_type), (ctx.info[key], dev, remote_mem), self.nbytes
        )

    def _load(self) -> None:
        self._tier_wait(self.mem.tier.start_load(self.slots, self.mem.kv, self.local))

    def _store(self) -> None:
        self._tier_wait(self.mem.tier.start_store(self.mem.kv, self.local, self.slots))

    def _h2d(self) -> None:
        self.ctx.devbuf[: self.nbytes].copy_(self.ctx.host[: self.nbytes], non_blocking=True)

    def _d2h(self) -> None:
        self.ctx.host[: self.nbytes].copy_(self.ctx.devbuf[: self.nbytes], non_blocking=True)

    def _kv_is(self, want_ids: list[int]) -> bool:
        """Our blocks `self.local` hold the holder's blocks `want_ids`, every byte of every layer."""
        self.ctx.sync()
        got = blocks_of(self.mem.kv, self.mem.layout, self.local)
        want = blocks_of(self.mem.want, self.mem.layout, want_ids)
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    def _zero_kv(self) -> None:
        for t in self.mem.kv.values():
            t.zero_()
        self.ctx.sync()  # a NIXL read does not wait for torch's stream: the zeros must land first

    def _zero_tier(self) -> None:
        tier = self.mem.tier
        for r in range(len(tier.regions())):
            for s in self.slots:
                tier.slot_bytes(r, s).zero_()

    def _fill_tier(self) -> None:
        """Our KV = the holder's contents; store our blocks into zeroed slots, zero the KV, load them back."""
        for name, t in self.mem.kv.items():
            t.copy_(self.mem.want[name])
        self._zero_tier()
        self._store()
        self._zero_kv()
        self._load()

    def _tier_wait(self, handle: int) -> None:
        tier, deadline = self.mem.tier, time.monotonic() + READ_TIMEOUT_S
        while handle not in tier.poll():
            time.sleep(0)  # let the tier's copy thread (DRAM) have the GIL
            if failed := tier.take_failed():
                raise RuntimeError(f"CPU tier copy failed: {failed}")
            if time.monotonic() > deadline:
                raise RuntimeError("CPU tier copy did not finish")


def run_cuda_tests(row: Row) -> None:
    """The CUDA tests in a pytest of their own; the row counts passed, skipped, failed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda"]
        cmd += [f"--junitxml={report}", *CUDA_TESTS]
        proc = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=CUDA_TESTS_TIMEOUT_S,
            check=False,
        )
        if not report.exists():
            raise RuntimeError(
                f"pytest wrote no report (exit {proc.returncode}): {proc.stdout[-800:]}{proc.stderr[-800:]}"
            )
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    row.extra = {
        "passed": passed,
        "skipped": counts["skipped"],
        "failed": counts["failures"] + counts["errors"],
    }
    if row.extra["failed"]:
        row.error = f"{row.extra['failed']} CUDA test(s) failed:\n{proc.stdout[-1500:]}"
    elif counts["tests"] != CUDA_TEST_COUNT:
        row.error = f"expected {CUDA_TEST_COUNT} CUDA tests, pytest ran {counts['tests']}"
    row.case = f"{passed} passed, {counts['skipped']} skipped, {row.extra['failed']} failed"
