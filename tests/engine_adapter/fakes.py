"""Fakes for the adapter's unit tests: a broker link with hand-completed
futures, a NIXL block mover with knobs, a vLLM request (the clock:
testkit.clock.FakeClock)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvbroker.engine_adapter.broker_link import LeaseEndNotice, NewGeneration
from kvbroker.v1 import broker_pb2 as pb


@dataclass
class Call:
    name: str
    args: dict[str, Any]
    future: Future[Any] | None = None


class FakeLink:
    """BrokerLink whose futures the test completes by hand."""

    def __init__(self, layout_id: str = "layout-a") -> None:
        self.connected = True
        self.layout_id = layout_id
        self.session_id = "session-1"  # a new id: the engine registered anew
        self.calls: list[Call] = []
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.cpu_stored: list[int] = []
        self.cpu_removed: list[int] = []
        self.ends: list[LeaseEndNotice] = []
        self.closed = False
        self.pin_handler: Any = None
        self.unpin_handler: Any = None
        # What the index mirror answers (None: not synced, ask the broker).
        self.mirror_matches: list[pb.HolderMatch] | None = None
        self.listener: Any = None
        self.loads: list[float] = []  # every set_load figure, in order
        self.given_up: list[tuple[str, str]] = []  # (lease id, reason) of every pin given up
        self.generations: list[NewGeneration] = []  # what the broker said registered anew, not yet taken

    def _call(self, name: str, **args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.calls.append(Call(name, args, future))
        return future

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def resolve(self, namespace, hashes, *, acquire, lease_ttl_ms, min_blocks, request_id):  # type: ignore[no-untyped-def]
        return self._call(
            "resolve",
            namespace=namespace,
            hashes=list(hashes),
            acquire=acquire,
            min_blocks=min_blocks,
            request_id=request_id,
        )

    def mirror_resolve(self, namespace, hashes):  # type: ignore[no-untyped-def]
        return None if self.mirror_matches is None else list(self.mirror_matches)

    def acquire(self, lease_id, ttl_ms):  # type: ignore[no-untyped-def]
        return self._call("acquire", lease_id=lease_id, ttl_ms=ttl_ms)

    def hold(self, namespace, hashes, block_ids, *, ttl_ms, request_id, reader_engine_id=""):  # type: ignore[no-untyped-def]
        return self._call(
            "hold",
            namespace=namespace,
            hashes=list(hashes),
            block_ids=list(block_ids),
            request_id=request_id,
            reader=reader_engine_id,
        )

    def release(self, lease_id, epoch, read=None):  # type: ignore[no-untyped-def]
        return self._call("release", lease_id=lease_id, epoch=epoch, read=read)

    def decline(self, holder_engine_id, request_id, reason):  # type: ignore[no-untyped-def]
        return self._call("decline", holder=holder_engine_id, request_id=request_id, reason=reason)

    def announce_stored(self, namespace, hashes, tier=pb.TIER_GPU):  # type: ignore[no-untyped-def]
        (self.stored if tier == pb.TIER_GPU else self.cpu_stored).extend(hashes)

    def announce_removed(self, namespace, hashes, tier=pb.TIER_GPU):  # type: ignore[no-untyped-def]
        (self.removed if tier == pb.TIER_GPU else self.cpu_removed).extend(hashes)

    def give_up_pin(self, lease_id: str, reason: str) -> None:
        self.given_up.append((lease_id, reason))

    def set_pin_handlers(self, pin, unpin):  # type: ignore[no-untyped-def]
        self.pin_handler, self.unpin_handler = pin, unpin

    def take_lease_ends(self) -> list[LeaseEndNotice]:
        ends, self.ends = self.ends, []
        return ends

    def take_generations(self) -> list[NewGeneration]:
        news, self.generations = self.generations, []
        return news

    def set_load(self, load: float) -> None:
        self.loads.append(load)

    def set_event_listener(self, listener):  # type: ignore[no-untyped-def]
        self.listener = listener

    def end_lease(self, lease_id: str, cause: str, request_id: str = "") -> None:
        """A lease-end notice as the session thread delivers it: queued, then the listener.
        `request_id`: that of a lease this engine holds."""
        self.ends.append(LeaseEndNotice(lease_id, cause, request_id))
        self.listener()

    def reconnect(self, *, resumed: bool) -> None:
        """The stream is back: the same session resumed (a broker replica took it over with its
        leases), or a new one registered (the old one's leases ended with it)."""
        if not resumed:
            self.session_id += "+"
        self.connected = True

    def close(self) -> None:
        self.closed = True


class Status:
    def __init__(self, name: str) -> None:
        self.name = name


@dataclass
class FakeRequest:
    request_id: str
    num_tokens: int
    block_size: int = 32
    kv_transfer_params: Any = None
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    status: Status = field(default_factory=lambda: Status("FINISHED_LENGTH_CAPPED"))
    block_hashes: list[bytes] = field(default_factory=list)
    # The request's tokens, as vLLM's Request.all_token_ids (None: a request without them).
    all_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.block_hashes:
            self.block_hashes = [
                (i + 1).to_bytes(8, "big") + b"\x00" * 24 for i in range(self.num_tokens // self.block_size)
            ]


def wire(i: int) -> int:
    """Wire hash of FakeRequest's block i."""
    return i + 1


def holder_info(engine_id: str = "holder", tp: int = 1, pp: int = 1, layers: int = 2) -> pb.EngineInfo:
    ranks = []
    per_stage = layers // pp
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            start = pp_rank * per_stage
            ranks.append(
                pb.RankInfo(
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    agent_name=f"{engine_id}-pp{pp_rank}-tp{tp_rank}",
                    agent_metadata=b"meta",
                    start_layer=start,
                    end_layer=start + per_stage,
                    tiers=[
                        pb.TierInfo(
                            tier=pb.TIER_GPU,
                            mem_type="DRAM",
                            num_blocks=100,
                            regions=[
                                pb.MemoryRegion(
                                    layer=layer, base_addr=4096 * layer, block_stride=64, block_bytes=64
                                )
                                for layer in range(start, start + per_stage)
                            ],
                        )
                    ],
                )
            )
    return pb.EngineInfo(
        engine_id=engine_id,
        layout=pb.LayoutFingerprint(tp_size=tp, pp_size=pp, num_layers=layers),
        ranks=ranks,
    )


class FakeMover:
    """BlockMover stand-in: reads finish after ``polls_to_finish`` polls, or fail on demand."""

    def __init__(self, agent_name: str, polls_to_finish: int = 1) -> None:
        self.agent_name = agent_name
        self.polls_to_finish = polls_to_finish
        self.fail_peers: set[str] = set()
        self.peers: dict[str, bytes] = {}
        self.peer_log: list[tuple[str, str, bytes]] = []
        self.reads: dict[int, dict[str, Any]] = {}
        self._polls_left: dict[int, int] = {}
        self._next = 1
        self.tiers: list[tuple[int, str, int]] = []
        self.closed = False

    def register_tier(self, tier: int, mem_type: str, regions: list[Any], num_blocks: int) -> None:
        self.tiers.append((tier, mem_type, num_blocks))

    def agent_metadata(self) -> bytes:
        return b"agent:" + self.agent_name.encode()

    def add_peer(self, agent_name: str, metadata: bytes) -> None:
        self.peers[agent_name] = metadata
        self.peer_log.append(("add", agent_name, metadata))

    def remove_peer(self, agent_name: str) -> None:
        self.peers.pop(agent_name, None)
        self.peer_log.append(("remove", agent_name, b""))

    def start_read(
        self,
        peer_agent,
        peer_regions,
        remote_block_ids,
        local_tier,
        local_block_ids,
        layers=None,
        notif=None,
        **kwargs,
    ):  # type: ignore[no-untyped-def]
        handle = self._next
        self._next += 1
        self.reads[handle] = {
            "peer": peer_agent,
            "remote": list(remote_block_ids),
            "local": list(local_block_ids),
            "layers": layers,
            "regions": list(peer_regions),
        }
        self._polls_left[handle] = self.polls_to_finish
        return handle

    def poll(self) -> tuple[list[int], dict[int, str]]:
        finished: list[int] = []
        failed: dict[int, str] = {}
        for handle in list(self._polls_left):
            self._polls_left[handle] -= 1
            if self._polls_left[handle] > 0:
                continue
            del self._polls_left[handle]
            if self.reads[handle]["peer"] in self.fail_peers:
                failed[handle] = "nixlRemoteDisconnectError: peer gone"
            else:
                finished.append(handle)
        return finished, failed

    def close(self) -> None:
        self.closed = True
