"""What `--state` names: a Redis URL's scheme, hosts, credentials and TLS options, or a precise reason.

`redis://` and `rediss://` (TLS) go to redis-py as they are (its query options included, e.g.
`?ssl_ca_certs=/etc/redis/ca.pem`); a Cluster (`redis[s]+cluster://`) and a Sentinel-managed primary
(`redis[s]+sentinel://`) are parsed here. Under `rediss+sentinel://`, TLS is spoken to the Sentinels
and to the primary they name, with the TLS options of the query string (``TLS_OPTIONS``) for both.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote

from kvbroker.broker.errors import InvalidArgument

SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
USAGE = (
    "use redis://HOST:PORT[/DB], rediss://HOST:PORT (TLS), "
    "redis+cluster://HOST:PORT[,HOST:PORT...] (a Redis Cluster's seed nodes; rediss+cluster:// for TLS), "
    "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE (Sentinels and the primary's service name; "
    "rediss+sentinel://...?ssl_ca_certs=CA.pem for TLS), "
    "or leave it empty for the in-memory broker"
)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Seed nodes and connection options from `redis[s]+cluster://[USER:PASSWORD@]H1:P1,H2:P2`."""
    scheme, _, rest = url.partition("://")
    options: dict[str, Any] = {"ssl": scheme == "rediss+cluster"}
    if "?" in rest or "#" in rest:
        raise InvalidArgument(f"--state {shown_url(url)}: a Cluster URL takes no query or fragment; {USAGE}")
    userinfo, at, hosts = rest.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if colon:
            options["password"] = unquote(password)
    hosts, _, db = hosts.partition("/")
    if db not in ("", "0"):
        raise InvalidArgument(
            f"--state {shown_url(url)}: a Redis Cluster has only database 0, not {db!r}; drop the /{db}"
        )
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")  # [::1]:7000
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"--state {shown_url(url)}: seed node {item.strip()!r} is not HOST:PORT (port 1-65535); {USAGE}"
            )
        nodes.append((host, int(port)))
    return nodes, options


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """Sentinels, the service name and connection options from
    `redis[s]+sentinel://[USER:PASSWORD@]H1:P1,H2:P2/SERVICE[?TLS options]` (the credentials go to
    the primary; under rediss+sentinel the TLS options, see `tls_options`, to Sentinels and primary)."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    hosts, slash, service = rest.partition("/")
    if not slash or not service or "/" in service or "#" in service:
        raise InvalidArgument(
            f"--state {shown_url(url)}: name the primary's service after the Sentinels (.../SERVICE); {USAGE}"
        )
    nodes, options = parse_cluster_url("redis+cluster://" + hosts)
    options.pop("ssl")
    tls = scheme == "rediss+sentinel"
    if query and not tls:
        raise InvalidArgument(
            f"--state {shown_url(url)}: redis+sentinel:// takes no query; TLS options go with rediss+sentinel://"
        )
    if tls:
        options["ssl"] = True
        options.update(_tls_query(url, query))
    return nodes, service, options


TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
_CERT_REQS = ("required", "optional", "none")


def _tls_query(url: str, query: str) -> dict[str, Any]:
    """The TLS options of a query string, by redis-py's names (as `rediss://` takes them)."""
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in TLS_OPTIONS:
            raise InvalidArgument(
                f"--state {shown_url(url)}: unknown option {key!r}; rediss+sentinel:// takes {', '.join(TLS_OPTIONS)}"
            )
        if key == "ssl_cert_reqs" and value not in _CERT_REQS:
            raise InvalidArgument(
                f"--state {shown_url(url)}: ssl_cert_reqs is one of {', '.join(_CERT_REQS)}"
            )
        if key == "ssl_check_hostname":
            if value.lower() not in ("true", "false", "yes", "no", "1", "0"):
                raise InvalidArgument(f"--state {shown_url(url)}: ssl_check_hostname is true or false")
            options[key] = value.lower() in ("true", "yes", "1")
        else:
            options[key] = value
    return options


def tls_options(options: dict[str, Any]) -> dict[str, Any]:
    """The part of the connection options that a Sentinel's own connection takes too."""
    return {k: v for k, v in options.items() if k == "ssl" or k in TLS_OPTIONS}


def shown_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if at and ":" in userinfo:
        return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{hosts}"
    return url
