"""An in-process stand-in for NIXL, with knobs, for unit tests.

Fake agents live in one `FakeFabric` and find each other by name. A READ
really copies bytes (ctypes.memmove between the registered addresses of the
two agents in this process), so tests can check what moved where. Knobs:

- `polls_to_complete`: a transfer reports PROC this many times, then moves
  the bytes and reports DONE;
- `kill(agent)`: the agent dies; transfers touching it raise the fake
  disconnect error, as real NIXL raises nixlRemoteDisconnectError;
- `error_state(agent)`: transfers from that peer end in the "ERR" state.

The fake checks what real NIXL checks and the data path relies on:
descriptors must fall inside registered memory, remote descriptors need the
peer's metadata loaded, and handles are counted so tests can assert that
nothing leaks.
"""

from __future__ import annotations

import ctypes
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbroker.engine_adapter.nixl_agent import NixlApi


class FakeNixlError(Exception):
    """Any refused operation (plays the role of nixlInvalidParamError and friends)."""


class FakeRemoteDisconnectError(Exception):
    """The remote agent is gone (plays nixlRemoteDisconnectError)."""


@dataclass
class FakeConfig:
    enable_prog_thread: bool = True
    backends: list[str] = field(default_factory=lambda: ["UCX"])


@dataclass
class FakeDlist:
    owner: FakeAgent
    agent: str  # "NIXL_INIT_AGENT" for local lists, else the remote agent's name
    descs: np.ndarray
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.fabric.live_dlists -= 1


@dataclass
class FakeXferDescs:
    descs: np.ndarray  # Nx3 (address, length, device)
    mem_type: str


def _inside(addr: int, length: int, mem_type: str, spans: list[tuple[int, int, str]]) -> None:
    if not any(s <= addr and addr + length <= e and mt == mem_type for s, e, mt in spans):
        raise FakeNixlError(f"descriptor {addr:#x}+{length} is outside registered {mem_type} memory")


@dataclass
class FakeXfer:
    peer: str
    pairs: list[tuple[int, int, int]]  # (local addr, remote addr, length)
    notif: bytes
    polls: int = 0
    state: str = "PROC"
    released: bool = False


class FakeFabric:
    """The 'network' the fake agents share, and the knobs tests turn."""

    def __init__(self, polls_to_complete: int = 0) -> None:
        self.polls_to_complete = polls_to_complete
        self.agents: dict[str, FakeAgent] = {}
        self.dead: set[str] = set()
        self.erroring: set[str] = set()
        self.transfers_posted = 0
        self.descs_per_transfer: list[int] = []
        self.prepped_transfers = 0  # requests made from prepared lists (make_prepped_xfer)
        self.live_xfers = 0
        self.live_dlists = 0

    def kill(self, agent_name: str) -> None:
        self.dead.add(agent_name)

    def error_state(self, agent_name: str) -> None:
        self.erroring.add(agent_name)

    def api(self) -> NixlApi:
        fabric = self

        def make_agent(name: str, config: FakeConfig | None = None) -> FakeAgent:
            return FakeAgent(fabric, name, config or FakeConfig())

        return NixlApi(
            nixl_agent=make_agent,
            nixl_agent_config=FakeConfig,
            errors=(FakeNixlError, FakeRemoteDisconnectError),
            disconnect_error=FakeRemoteDisconnectError,
        )


class FakeAgent:
    def __init__(self, fabric: FakeFabric, name: str, config: FakeConfig) -> None:
        if name in fabric.agents:
            raise FakeNixlError(f"agent {name!r} exists")
        self.fabric = fabric
        self.name = name
        self.config = config
        self.backends = {b: i for i, b in enumerate(config.backends)}
        self.registered: list[tuple[int, int, str]] = []  # (start, end, mem_type)
        self.remote: dict[str, list[tuple[int, int, str]]] = {}
        self.notifs: dict[str, list[bytes]] = {}
        fabric.agents[name] = self

    # memory
    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> list[Any]:
        spans = [(addr, addr + length, mem_type) for addr, length, _dev, _meta in reg_list]
        self.registered.extend(spans)
        return spans

    def deregister_memory(self, spans: list[tuple[int, int, str]]) -> None:
        for span in spans:
            self.registered.remove(span)

    def get_agent_metadata(self) -> bytes:
        return pickle.dumps({"name": self.name, "registered": list(self.registered)})

    def add_remote_agent(self, metadata: bytes) -> bytes:
        try:
            md = pickle.loads(metadata)
            name = md["name"]
        except Exception as exc:
            raise FakeNixlError(f"bad metadata: {exc}") from exc
        self.remote[name] = md["registered"]
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        if name not in self.remote:
            raise FakeNixlError(f"unknown remote agent {name!r}")
        del self.remote[name]

    # descriptor lists and transfers
    def prep_xfer_dlist(self, agent_name: str, descs: np.ndarray, mem_type: str) -> FakeDlist:
        if agent_name == "NIXL_INIT_AGENT":
            spans = self.registered
        elif agent_name in self.remote:
            spans = self.remote[agent_name]
        else:
            raise FakeNixlError(f"no metadata for remote agent {agent_name!r}")
        for addr, length, _dev in np.asarray(descs, dtype=np.uint64).tolist():
            if not any(s <= addr and addr + length <= e and mt == mem_type for s, e, mt in spans):
                raise FakeNixlError(f"descriptor {addr:#x}+{length} is outside registered {mem_type} memory")
        self.fabric.live_dlists += 1
        return FakeDlist(self, agent_name, np.asarray(descs, dtype=np.uint64))

    def get_xfer_descs(self, descs: np.ndarray, mem_type: str) -> FakeXferDescs:
        arr = np.asarray(descs, dtype=np.uint64)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise FakeNixlError(f"descriptors must be an Nx3 array, got shape {arr.shape}")
        return FakeXferDescs(arr, mem_type)

    def initialize_xfer(
        self,
        operation: str,
        local: FakeXferDescs,
        remote: FakeXferDescs,
        remote_agent: str,
        notif_msg: bytes = b"",
    ) -> FakeXfer:
        """Like NIXL's createXferReq: every descriptor must lie inside one registration."""
        if operation != "READ":
            raise FakeNixlError("the fake supports READ only")
        if remote_agent not in self.remote:
            raise FakeNixlError(f"no metadata for remote agent {remote_agent!r}")
        if len(local.descs) != len(remote.descs):
            raise FakeNixlError("descriptor lists differ in length")
        pairs = []
        for (laddr, llen, _), (raddr, rlen, _) in zip(
            local.descs.tolist(), remote.descs.tolist(), strict=True
        ):
            if llen != rlen:
                raise FakeNixlError(f"descriptor lengths differ: {llen} != {rlen}")
            _inside(laddr, llen, local.mem_type, self.registered)
            _inside(raddr, rlen, remote.mem_type, self.remote[remote_agent])
            pairs.append((laddr, raddr, llen))
        self.fabric.live_xfers += 1
        return FakeXfer(remote_agent, pairs, bytes(notif_msg))

    def make_prepped_xfer(
        self,
        operation: str,
        local: FakeDlist,
        local_indices: Any,
        remote: FakeDlist,
        remote_indices: Any,
        notif_msg: bytes = b"",
    ) -> FakeXfer:
        if operation != "READ":
            raise FakeNixlError("the fake supports READ only")
        if local.released or remote.released:
            raise FakeNixlError("descriptor list was released")
        li = np.asarray(local_indices).tolist()
        ri = np.asarray(remote_indices).tolist()
        if len(li) != len(ri):
            raise FakeNixlError("index lists differ in length")
        pairs = []
        for a, b in zip(li, ri, strict=True):
            laddr, llen, _ = local.descs[a].tolist()
            raddr, rlen, _ = remote.descs[b].tolist()
            if llen != rlen:
                raise FakeNixlError(f"descriptor lengths differ: {llen} != {rlen}")
            pairs.append((laddr, raddr, llen))
        self.fabric.live_xfers += 1
        self.fabric.prepped_transfers += 1
        return FakeXfer(remote.agent, pairs, bytes(notif_msg))

    def release_dlist_handle(self, dlist: FakeDlist) -> None:
        dlist.release()

    def transfer(self, xfer: FakeXfer, notif_msg: bytes = b"") -> str:
        self._check_peer(xfer.peer)
        self.fabric.transfers_posted += 1
        self.fabric.descs_per_transfer.append(len(xfer.pairs))
        if xfer.peer in self.fabric.erroring:
            return "PROC"  # like UCX: the error surfaces while the transfer progresses
        return self.check_xfer_state(xfer)

    def check_xfer_state(self, xfer: FakeXfer) -> str:
        if xfer.state != "PROC":
            return xfer.state
        self._check_peer(xfer.peer)
        if xfer.peer in self.fabric.erroring:
            xfer.state = "ERR"
            return xfer.state
        if xfer.polls < self.fabric.polls_to_complete:
            xfer.polls += 1
            return "PROC"
        for laddr, raddr, length in xfer.pairs:
            ctypes.memmove(laddr, raddr, length)
        peer = self.fabric.agents[xfer.peer]
        if xfer.notif:
            peer.notifs.setdefault(self.name, []).append(xfer.notif)
        xfer.state = "DONE"
        return xfer.state

    def release_xfer_handle(self, xfer: FakeXfer) -> None:
        if not xfer.released:
            xfer.released = True
            self.fabric.live_xfers -= 1

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.notifs = self.notifs, {}
        return out

    def _check_peer(self, peer: str) -> None:
        if peer in self.fabric.dead or self.name in self.fabric.dead:
            raise FakeRemoteDisconnectError(f"remote agent {peer!r} disconnected")
        if peer not in self.fabric.agents:
            raise FakeNixlError(f"no agent {peer!r}")
