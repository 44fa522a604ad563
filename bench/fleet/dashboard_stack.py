"""The stack bench/fleet/dashboard.py draws: broker, P and D with our connector, the proxy, and one
vLLM engine without our connector that the broker follows by its KV cache events."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvbroker.tools.launch import EngineProcess
from testkit.chat import doc_conversations, run_conversations
from testkit.engines import complete, prompt_of, start_engine
from testkit.ports import free_port
from testkit.processes import BrokerProcess, ProxyProcess

SERVED = "tiny"
HOLD_TTL_MS = 5_000  # D's holds of finished turns end after 5 s: the lease panels show them end


class DashboardStack:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Any] = []

    def __enter__(self) -> DashboardStack:
        from kvbroker.tools.tiny_model import build_tiny_model

        self.workdir.mkdir(parents=True, exist_ok=True)
        model = build_tiny_model(self.workdir / "model")
        self.metrics_port, events_port, self.proxy_port = free_port(), free_port(), free_port()
        spec = f"events=tcp://127.0.0.1:{events_port}?model={SERVED}&block_size=32"
        self.broker = BrokerProcess(
            self.workdir,
            ["--metrics-port", str(self.metrics_port), "--kv-events", spec],
            command=("-m", "kvbroker.broker"),
        ).start()
        self.children.append(self.broker)
        common = dict(broker_address=self.broker.address, log_stats=True, served_model_name=SERVED)
        self.p, _ = start_engine(model, self.workdir, name="prefill", role="prefill", **common)  # type: ignore[arg-type]
        self.children.append(self.p)
        self.d, _ = start_engine(
            model,
            self.workdir,
            name="decode",
            role="decode",
            multi_turn=True,
            hold_ttl_ms=HOLD_TTL_MS,
            **common,  # type: ignore[arg-type]
        )
        self.children.append(self.d)
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
        }
        self.events = EngineProcess(
            model,
            name="events",
            extra_args=["--kv-events-config", json.dumps(events_config)],
            log_path=self.workdir / "events.log",
        ).start()
        self.children.append(self.events)
        for engine in (self.p, self.d, self.events):
            engine.wait_ready(timeout=600, progress=print)
        self.proxy = ProxyProcess(
            self.workdir / "proxy.log",
            prefill={"prefill": self.p.url},
            decode={"decode": self.d.url},
            broker=self.broker.address,
            # Every turn prefills on P, as in the demo, so the panels show KV moving both ways.
            local_prefill_tokens=0,
            port=self.proxy_port,
        )
        self.children.append(self.proxy)
        self.proxy.start(timeout=60)
        return self

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def targets(self) -> dict[str, str]:
        """job -> /metrics URL, as deploy/prometheus.yml names the jobs."""
        return {
            "broker": f"http://127.0.0.1:{self.metrics_port}/metrics",
            "prefill": f"{self.p.url}/metrics",
            "decode": f"{self.d.url}/metrics",
            "events": f"{self.events.url}/metrics",
            "proxy": f"{self.proxy_url}/metrics",
        }

    def workload(
        self, *, conversations: int, turns: int, max_tokens: int, waves: int, pause_s: float
    ) -> None:
        """`waves` rounds of chats through the proxy, `pause_s` apart (holds end in between)."""
        for wave in range(waves):
            if wave:
                time.sleep(pause_s)
            convs = doc_conversations(conversations, turns, seed=3 + wave)
            runs = run_conversations(self.proxy_url, convs, model=SERVED, max_tokens=max_tokens)
            failed = [r.error for r in runs if r.error]
            print(f"wave {wave + 1}: {len(runs)} conversations of {turns} turns; failed: {failed or 'none'}")
            for seed in range(3):  # the event-fed engine serves prompts of its own
                complete(self.events, prompt_of(4 * 32 + 5, seed=100 + 10 * wave + seed), max_tokens=4)

    def __exit__(self, *exc: object) -> None:
        for child in reversed(self.children):
            child.stop()
