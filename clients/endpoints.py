"""Several broker replicas behind one client: a channel per address and an explicit failover.

``KVBROKER_ADDR=a:50051,b:50051`` names the replicas of a fleet sharing one
store. One gRPC channel over all of them (pick_first) is not enough: it moves
only when its connection breaks, and a frozen or partitioned replica breaks
nothing (a paused process's kernel still holds the connection open, and a
blackholed link sends no reset), so the channel stays on the silent address
until a keepalive ping times out, tens of seconds later.

``Endpoints`` keeps one channel per address, made when first used, and a
*current* address that every new call and stream takes. The caller decides
when an address has failed (a session that heard no answer to its heartbeat
in a fraction of its TTL, a unary call that timed out or found nobody) and
calls ``fail_over(address)``; the next address in the list becomes current,
round robin. Naming the address that failed makes concurrent reports of one
failure move the current address once, not once per caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

ChannelT = TypeVar("ChannelT")


def split_addresses(address: str) -> list[str]:
    """The replicas' addresses in ``address`` (comma separated), in order; one address as is."""
    parts = [part.strip() for part in address.split(",") if part.strip()]
    return parts or [address]


class Endpoints(Generic[ChannelT]):
    """One channel per address (made by ``make(address)`` when first used) and the current one."""

    def __init__(self, addresses: list[str], make: Callable[[str], ChannelT]) -> None:
        if not addresses:
            raise ValueError("no broker address")
        self.addresses = list(addresses)
        self._make = make
        self._channels: dict[str, ChannelT] = {}
        self._current = 0
        self.failovers = 0  # how often the current address moved

    def __len__(self) -> int:
        return len(self.addresses)

    @property
    def current(self) -> str:
        return self.addresses[self._current]

    def channel(self, address: str | None = None) -> ChannelT:
        """The channel to ``address`` (default: the current one), made on first use."""
        address = self.current if address is None else address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._make(address)
        return channel

    def fail_over(self, failed: str | None = None) -> str:
        """``failed`` did not answer: the next address becomes current (unless another caller
        already moved away from ``failed``). Returns the current address."""
        if len(self.addresses) > 1 and (failed is None or failed == self.current):
            self._current = (self._current + 1) % len(self.addresses)
            self.failovers += 1
        return self.current

    def retry_delay(self, failures: int, backoff: Callable[[int], float]) -> float:
        """How long to wait after ``failures`` failed tries in a row: none while some replica of
        this round is untried, else ``backoff`` of the rounds tried."""
        replicas = len(self.addresses)
        return 0.0 if failures % replicas else backoff(failures // replicas - 1)

    def take_all(self) -> list[ChannelT]:
        """Every channel made so far, forgotten here (to close, or to retire after new credentials)."""
        channels = list(self._channels.values())
        self._channels.clear()
        return channels

    def __iter__(self) -> Iterator[str]:
        return iter(self.addresses)
