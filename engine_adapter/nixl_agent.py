"""The one place that imports NIXL.

NIXL is an optional, heavy dependency (the engine-side extras install it), so
it is imported lazily here and nowhere else: the broker, the clients and the
rest of the adapter import on any machine. Everything the data path needs from
NIXL goes through a `NixlApi` value, which unit tests replace with the fake in
`tests.engine_adapter.fake_nixl`.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

# Names of the exception classes the NIXL bindings raise. They share no common
# base class (each derives from Exception directly), so the data path catches
# this tuple and nothing broader.
_NIXL_ERROR_NAMES = (
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
)


# UCX state is partly process-global (memory hooks, async events) and agents
# run without NIXL's internal locking, so every call into any NIXL agent of
# this process goes through this one lock. In an engine there is one agent
# per process; the lock matters in tests and tools that hold several.
NIXL_LOCK = threading.RLock()


_agents_created = 0


def nixl_agents_created() -> int:
    """How many NIXL agents this process created (see `exit_skipping_nixl_teardown`)."""
    return _agents_created


def exit_skipping_nixl_teardown(status: int) -> NoReturn:
    """Flush stdio and leave with `status` without running interpreter teardown.

    With nixl 1.5.1 (nixl_cu13 wheel) a process that created a UCX agent
    segfaults during normal interpreter exit, after all of its work is done,
    even if the agent was deleted first (reproduce: create one nixl_agent and
    return from `python -c`). The exit status then reads 139 and hides the
    real one. Programs and test sessions that created agents call this last.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class NixlUnavailableError(ImportError):
    """NIXL is not installed (or cannot load) on this machine."""


@dataclass(frozen=True)
class NixlApi:
    """What the data path uses from NIXL: the agent factory and its errors."""

    nixl_agent: Any  # class: nixl_agent(name, nixl_agent_config)
    nixl_agent_config: Any  # class: nixl_agent_config(enable_prog_thread=..., backends=[...])
    errors: tuple[type[BaseException], ...]  # every exception NIXL raises for a failed operation
    disconnect_error: type[BaseException]  # raised when the remote agent is gone
    is_real: bool = False  # True for the installed NIXL, False for fakes

    def is_disconnect(self, exc: BaseException) -> bool:
        return isinstance(exc, self.disconnect_error)


@functools.cache
def real_nixl() -> NixlApi:
    """Import NIXL (once) and describe it; raises NixlUnavailableError with a fix if missing."""
    try:
        api = importlib.import_module("nixl._api")
        bindings = importlib.import_module("nixl._bindings")
    except ImportError as exc:
        raise NixlUnavailableError(
            "NIXL is not available: install the engine-side extra "
            "(`pip install '.[cpu]'` on CPU machines, `pip install '.[gpu]'` with CUDA), "
            f"which pins nixl==1.5.1. Import failed with: {exc}"
        ) from exc
    errors = tuple(getattr(bindings, name) for name in _NIXL_ERROR_NAMES if hasattr(bindings, name))
    return NixlApi(
        nixl_agent=api.nixl_agent,
        nixl_agent_config=api.nixl_agent_config,
        errors=errors,
        disconnect_error=bindings.nixlRemoteDisconnectError,
        is_real=True,
    )


def nixl_available() -> bool:
    """True when NIXL imports and loads on this machine."""
    try:
        real_nixl()
    except ImportError:
        return False
    return True


def create_agent(api: NixlApi, agent_name: str, backend: str = "UCX") -> Any:
    """One NIXL agent with one backend and NIXL's progress thread off.

    The progress thread spins a whole core per agent; instead the owner drives
    progress by polling (BlockMover does this, plus a slow ticker thread so an
    idle holder still answers connection handshakes).
    """
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[backend])
    global _agents_created
    with NIXL_LOCK:
        agent = api.nixl_agent(agent_name, config)
        if api.is_real:
            _agents_created += 1
    if backend not in getattr(agent, "backends", {backend: None}):
        raise NixlUnavailableError(
            f"NIXL backend {backend!r} could not be created for agent {agent_name!r}; "
            f"available plugins: {getattr(agent, 'plugin_list', '?')}"
        )
    return agent
