"""`--state redis+sentinel://...`: the Sentinels, the service name and the options, or a reason."""

from __future__ import annotations

import pytest

from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.fleet.conn import parse_sentinel_url


def test_sentinels_service_and_credentials() -> None:
    nodes, service, options = parse_sentinel_url(
        "redis+sentinel://me:s%40cret@10.0.0.1:26379,[::1]:26380/kvb"
    )
    assert nodes == [("10.0.0.1", 26379), ("::1", 26380)]
    assert service == "kvb"
    assert options == {"username": "me", "password": "s@cret"}


@pytest.mark.parametrize(
    "url",
    ["redis+sentinel://10.0.0.1:26379", "redis+sentinel://10.0.0.1:26379/", "redis+sentinel://h:1/a/b"],
)
def test_a_missing_or_odd_service_name_is_refused(url: str) -> None:
    with pytest.raises(InvalidArgument, match="service"):
        parse_sentinel_url(url)


def test_a_bad_sentinel_address_is_refused_without_the_password() -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse_sentinel_url("redis+sentinel://me:secret@nohost/kvb")
    assert "secret" not in refused.value.message and "nohost" in refused.value.message
