"""The proxy maps API keys to tenants and sets cache_salt itself; a salt of another tenant is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbroker.clients.proxy.tenants import ApiKeys, TenantRefused
from tests.clients.proxy.test_proxy import COMPLETION, engines, proxy

__all__ = ["engines", "proxy"]  # fixtures

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant\nkey-acme acme\nkey-globex globex\n")
    return path


def test_keys_set_the_tenant_and_keep_salts_inside_it(keys_file: Path) -> None:
    keys = ApiKeys(str(keys_file))
    for given, expected in ((None, "acme"), ("conv-1", "acme/conv-1"), ("acme/conv-2", "acme/conv-2")):
        body: dict[str, Any] = {} if given is None else {"cache_salt": given}
        assert keys.apply("Bearer key-acme", body) == "acme"
        assert body["cache_salt"] == expected
    for salt in ("globex", "globex/conv-1"):
        with pytest.raises(TenantRefused) as refused:
            keys.apply("Bearer key-acme", {"cache_salt": salt})
        assert refused.value.status == 403
    for header in (None, "Bearer nope", "Basic key-acme"):
        with pytest.raises(TenantRefused) as refused:
            keys.apply(header, {})
        assert refused.value.status == 401


async def test_proxy_sends_the_tenant_salt_to_the_engines(engines: Any, proxy: Any, keys_file: Path) -> None:
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url], api_keys_file=str(keys_file))
    status, _headers, raw = await px.post("/v1/completions", COMPLETION)
    assert status == 401, raw
    status, _headers, raw = await px.post(
        "/v1/completions", {**COMPLETION, "cache_salt": "globex/x"}, Authorization="Bearer key-acme"
    )
    assert status == 403, raw
    status, _headers, raw = await px.post(
        "/v1/completions", {**COMPLETION, "cache_salt": "x"}, Authorization="Bearer key-acme"
    )
    assert status == 200, raw
    (pre,) = p.completions()
    (dec,) = d.completions()
    assert pre.body["cache_salt"] == dec.body["cache_salt"] == "acme/x"
