"""A holder restarted under the same engine id while a reader keeps pulling from it
(one real broker process, two real vLLM engines with BrokerConnector, real NIXL over UCX).

P prefills and holds, D pulls (the P to D flow), a loader thread sends P to D
requests without pause. P is killed -9 in the middle of the load and started
again as engine "P": a new NIXL agent under the old agent name. The broker
gives the new registration a larger generation and tells D at once; D drops
the old agent before any lease names the new generation. Checked: every answer D gave equals a
recompute token for token (0 wrong bytes), and from the moment the new P's
registration is known no pull fails (no read went to the dead agent).
"""

from __future__ import annotations

import http.client
import threading
import urllib.error
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbroker.clients.sync import BrokerClient
from kvbroker.tools.launch import EngineProcess
from testkit.engines import complete, output_ids, prompt_of, read_stats, recompute_reference, start_engine
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 4
PROMPT_TOKENS = 130  # five blocks of 32: four pulled, the partial last one computed by D


@dataclass
class Load:
    """P to D requests in a loop, each on its own prompt; what D answered, per prompt seed."""

    p: EngineProcess
    d: EngineProcess
    answers: dict[int, list[int]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    p_down: int = 0  # requests P could not answer (it was dead or starting)
    seed: int = 1000

    def swap_holder(self, p: EngineProcess) -> None:
        self.p = p

    def run(self) -> None:
        while not self.stop.is_set():
            self.seed += 1
            prompt = prompt_of(PROMPT_TOKENS, self.seed)
            salt = f"load-{uuid.uuid4().hex}"  # a namespace of its own: D has none of it locally
            try:
                first = complete(
                    self.p,
                    prompt,
                    max_tokens=1,
                    cache_salt=salt,
                    kv_transfer_params={"do_remote_decode": True},
                    timeout=60,
                )
            except (OSError, urllib.error.URLError, http.client.HTTPException):
                # Killed -9 before or while it answered (IncompleteRead: mid-body, seen in CI).
                self.p_down += 1
                self.stop.wait(0.2)
                continue
            answer = complete(
                self.d,
                prompt,
                max_tokens=MAX_TOKENS,
                cache_salt=salt,
                kv_transfer_params=first.get("kv_transfer_params"),
            )
            self.answers[self.seed] = output_ids(answer)


def _p(client: BrokerClient) -> tuple[int, bool]:
    """P's generation and whether its rank is registered (0, False: P is not registered)."""
    for engine in client.list_engines().engines:
        if engine.engine_id == "P":
            return engine.generation, bool(engine.ranks and engine.ranks[0].agent_name)
    return 0, False


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, BrokerProcess]]:
    from kvbroker.tools.tiny_model import build_tiny_model

    log_dir = tmp_path_factory.mktemp("replaced")
    model = build_tiny_model(log_dir / "model")
    broker = BrokerProcess(log_dir).start()
    try:
        yield model, log_dir, broker
    finally:
        broker.stop()


def test_a_restarted_holder_is_never_read_as_its_old_self(
    parts: tuple[Path, Path, BrokerProcess],
) -> None:
    model, log_dir, broker = parts
    p, _ = start_engine(model, log_dir, name="P", broker_address=broker.address, role="prefill")
    d, d_stats = start_engine(model, log_dir, name="D", broker_address=broker.address, role="decode")
    engines = [p, d]
    load = Load(p, d)
    loader = threading.Thread(target=load.run, name="p-to-d-load", daemon=True)
    try:
        for engine in engines:
            engine.wait_ready(timeout=400, progress=print)
        client = BrokerClient(broker.address)
        assert wait_for(lambda: _p(client)[1], 30), "P did not register its rank"
        old_generation = _p(client)[0]
        assert old_generation > 0

        def stat(key: str) -> int:
            return int(read_stats(d_stats).get(key, 0))

        loader.start()
        assert wait_for(lambda: len(load.answers) >= 3, 120), "the load made no progress before the kill"
        assert stat("pulled_blocks") > 0, "D pulled nothing from the first P"

        p.kill9()  # under load: requests of the loader are in flight
        assert wait_for(lambda: _p(client)[0] != old_generation, 20), "the broker kept naming the dead P"
        answered_before = len(load.answers)
        p2, _ = start_engine(
            model, log_dir / "restarted", name="P", broker_address=broker.address, role="prefill"
        )
        engines.append(p2)
        p2.wait_ready(timeout=400, progress=print)
        assert wait_for(lambda: _p(client)[1], 30), "the restarted P did not register its rank"
        new_generation = _p(client)[0]
        assert new_generation > old_generation
        # The broker's word alone (SessionDown.engine_generation): the loader still sends to the
        # dead P, so no lease names the new one yet; D, idle, is woken and drops the old agent.
        assert wait_for(lambda: stat("holder_agents_replaced") >= 1, 60), "D kept the dead P's agent"
        # From here on the broker names only the new P: no pull may fail (a read against the
        # dead agent would fail in NIXL, or be refused as a replaced holder's).
        failed_at_restart = stat("pulls_failed")
        pulled_at_restart = stat("pulled_blocks")
        load.swap_holder(p2)
        assert wait_for(lambda: len(load.answers) >= answered_before + 4, 180), "no progress after restart"
        load.stop.set()
        loader.join(90)
        assert not loader.is_alive()

        assert stat("pulled_blocks") > pulled_at_restart, "D did not pull from the restarted P"
        assert stat("pulls_failed") == failed_at_restart, read_stats(d_stats)
        assert stat("holder_agents_replaced") >= 1, "D kept the old agent of P loaded"
        assert load.p_down > 0, "the loader never saw P down: the kill happened outside the load"
        # 0 wrong bytes: every answer D gave, before, during and after the restart, is a recompute's.
        wrong = {
            seed: got
            for seed, got in load.answers.items()
            if got != recompute_reference(d, prompt_of(PROMPT_TOKENS, seed), MAX_TOKENS)
        }
        assert wrong == {}, f"{len(wrong)} of {len(load.answers)} answers differ from a recompute"
        print(
            f"P generation {old_generation} -> {new_generation}; {len(load.answers)} P->D answers, "
            f"{load.p_down} requests while P was down; D stats {read_stats(d_stats)}"
        )
        client.close()
    finally:
        load.stop.set()
        for engine in engines:
            engine.stop()
