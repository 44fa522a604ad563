"""Quotas' token buckets under a fake clock: per identity, per tenant, refilled with time."""

from __future__ import annotations

import pytest

from kvbroker.broker.errors import ResourceExhausted
from kvbroker.broker.security.config import SecurityConfig
from kvbroker.broker.security.identity import parse_identity
from kvbroker.broker.security.quotas import Quotas

A1 = parse_identity("kvbroker://acme/router/a1")
A2 = parse_identity("kvbroker://acme/router/a2")
G1 = parse_identity("kvbroker://globex/router/g1")


def test_rates_per_identity_and_per_tenant() -> None:
    now = [0.0]
    quotas = Quotas(SecurityConfig(quota_rate=10, quota_burst=10, quota_tenant_rate=15), clock=lambda: now[0])
    for _ in range(10):
        quotas.spend(A1)
    with pytest.raises(ResourceExhausted, match="--quota-rate 10"):
        quotas.spend(A1)
    for _ in range(5):
        quotas.spend(A2)  # its own 10, but acme has only 15 a second in all
    with pytest.raises(ResourceExhausted, match="--quota-tenant-rate 15"):
        quotas.spend(A2)
    for _ in range(10):
        quotas.spend(G1)  # another tenant is untouched
    now[0] += 1.0
    quotas.spend(A1)  # refilled


def test_zero_turns_a_quota_off() -> None:
    quotas = Quotas(SecurityConfig(quota_rate=0, quota_tenant_rate=0, quota_streams=0), clock=lambda: 0.0)
    for _ in range(100_000):
        quotas.spend(A1)
    for _ in range(100):
        quotas.open_stream(A1, "Watch")
