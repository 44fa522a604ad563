"""`--state redis+sentinel://...`: the Sentinels, the service name and the options, or a reason."""

from __future__ import annotations

import pytest

from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.fleet.conn import RedisState, parse_sentinel_url
from kvbroker.broker.fleet.urls import tls_options


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


def test_tls_to_the_sentinels_and_the_primary_takes_the_certificate_options() -> None:
    nodes, service, options = parse_sentinel_url(
        "rediss+sentinel://me:pw@10.0.0.1:26379/kvb?ssl_ca_certs=%2Fpki%2Fca.pem"
        "&ssl_certfile=/pki/c.pem&ssl_keyfile=/pki/c.key&ssl_cert_reqs=required&ssl_check_hostname=false"
    )
    assert nodes == [("10.0.0.1", 26379)] and service == "kvb"
    assert options == {
        "username": "me",
        "password": "pw",
        "ssl": True,
        "ssl_ca_certs": "/pki/ca.pem",
        "ssl_certfile": "/pki/c.pem",
        "ssl_keyfile": "/pki/c.key",
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": False,
    }
    # What a Sentinel's own connection takes: TLS, not the primary's credentials.
    assert "password" not in tls_options(options) and tls_options(options)["ssl"] is True
    assert parse_sentinel_url("rediss+sentinel://h:1/kvb")[2] == {"ssl": True}


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+sentinel://h:1/kvb?ssl_ca_certs=/ca.pem", "TLS options go with"),
        ("rediss+sentinel://h:1/kvb?ssl_ca=/ca.pem", "unknown option 'ssl_ca'"),
        ("rediss+sentinel://h:1/kvb?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("rediss+sentinel://h:1/kvb?ssl_check_hostname=perhaps", "true or false"),
    ],
)
def test_tls_options_that_cannot_apply_are_refused_with_the_reason(url: str, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        parse_sentinel_url(url)


def test_the_state_names_a_tls_sentinel_store() -> None:
    with pytest.raises(InvalidArgument, match="not a Redis URL"):
        RedisState("rediss+sentinels://h:1/kvb")
