"""vLLM's own NixlConnector, with its NIXL agent created without NIXL's progress thread.

Loaded into a vLLM engine by the benchmark as

    {"kv_connector": "NixlConnector", "kv_connector_module_path": "bench.harness.nixl_quiet", ...}

(vLLM prefers a module path over its registry, and the name stays "NixlConnector",
so every vLLM check keyed on that name still applies). Nothing of the connector
changes except how its NIXL agent is made:

- NIXL's progress thread spins a whole core per agent, which on a 2-core machine
  shared by two engines (and the client) measures the spinning, not the connector.
  It is turned off, as our own adapter does;
- without it an agent makes progress only while someone calls into it, and a
  holder must answer a new reader's UCX handshake even while its engine is idle.
  So a daemon ticker drains the agent's notifications every few milliseconds and
  keeps them for vLLM's next `get_new_notifs()` call; the agent runs in NIXL's
  strict thread-sync mode, so the ticker and vLLM's worker may call it at once.

This module imports vLLM; only the engine process loads it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vllm.distributed import nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as _VllmNixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

TICK_S = 0.005

_Agent: Any = nixl_utils.NixlWrapper
_AgentConfig: Any = nixl_utils.nixl_agent_config


def _quiet_config(**kwargs: Any) -> Any:
    """vLLM's agent config with the progress thread off and strict (thread-safe) sync."""
    from nixl._api import nixl_thread_sync_t

    kwargs["enable_prog_thread"] = False
    kwargs["sync_mode"] = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    return _AgentConfig(**kwargs)


class QuietNixlAgent(_Agent):  # type: ignore[misc,valid-type]
    """NIXL agent whose progress comes from a slow ticker instead of a spinning thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, list[bytes]] = {}
        self._pending_lock = threading.Lock()
        self._ticker = threading.Thread(target=self._tick, name="nixl-quiet-ticker", daemon=True)
        self._ticker.start()

    def _drain(self) -> None:
        fresh = self.agent.getNotifs({}, [])
        if fresh:
            for peer, msgs in fresh.items():
                self._pending.setdefault(peer, []).extend(msgs)

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_S)
            try:
                with self._pending_lock:
                    self._drain()
            except Exception:  # the agent was destroyed at shutdown
                return

    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        with self._pending_lock:
            self._drain()
            out, self._pending = self._pending, {}
        return out


# base_worker bound these names at import; the connector's worker reads them there.
base_worker.NixlWrapper = QuietNixlAgent  # pyright: ignore[reportPrivateImportUsage]
base_worker.nixl_agent_config = _quiet_config  # pyright: ignore[reportPrivateImportUsage]


class NixlConnector(_VllmNixlConnector):  # type: ignore[misc]
    """vLLM's NixlConnector, unchanged; importing this module made its agent quiet."""
