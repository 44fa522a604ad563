"""clients/endpoints.py: one channel per replica, made on first use, and an explicit failover."""

from __future__ import annotations

from kvbroker.clients.endpoints import Endpoints, split_addresses


def test_split_keeps_order_and_one_address_as_is() -> None:
    assert split_addresses("a:1, b:2,") == ["a:1", "b:2"]
    assert split_addresses("dns:///fleet:50051") == ["dns:///fleet:50051"]


def test_channels_are_made_once_per_address_when_first_used() -> None:
    made: list[str] = []
    endpoints = Endpoints(["a:1", "b:2"], lambda address: made.append(address) or f"ch-{address}")
    assert endpoints.channel() == "ch-a:1" and endpoints.channel() == "ch-a:1"
    assert made == ["a:1"]
    assert endpoints.channel("b:2") == "ch-b:2" and made == ["a:1", "b:2"]
    assert endpoints.take_all() == ["ch-a:1", "ch-b:2"]
    assert endpoints.channel() == "ch-a:1" and made == ["a:1", "b:2", "a:1"]  # made anew after take_all


def test_a_failure_reported_twice_moves_once() -> None:
    endpoints = Endpoints(["a:1", "b:2", "c:3"], str)
    assert endpoints.fail_over("a:1") == "b:2"
    assert endpoints.fail_over("a:1") == "b:2"  # another caller saw the same failure of a
    assert endpoints.fail_over("b:2") == "c:3"
    assert endpoints.fail_over() == "a:1"  # round robin
    assert endpoints.failovers == 3


def test_one_address_never_moves() -> None:
    endpoints = Endpoints(["a:1"], str)
    assert endpoints.fail_over("a:1") == "a:1" and endpoints.failovers == 0


def test_retry_delay_tries_every_replica_before_backing_off() -> None:
    endpoints = Endpoints(["a:1", "b:2"], str)
    backoff = lambda rounds: 0.1 * 2**rounds  # noqa: E731
    assert [endpoints.retry_delay(n, backoff) for n in range(1, 7)] == [0.0, 0.1, 0.0, 0.2, 0.0, 0.4]
    single = Endpoints(["a:1"], str)
    assert [single.retry_delay(n, backoff) for n in range(1, 4)] == [0.1, 0.2, 0.4]
