"""The ``kvbroker`` command line: global options, one subcommand per command, help text."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from kvbroker.clients.aio import DEFAULT_ADDRESS
from kvbroker.clients.credentials import ENV_PREFIX as SECURITY_ENV_PREFIX
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.common import keepalive, settings
from kvbroker.common.settings import setting
from kvbroker.common.version import version_text
from kvbroker.tools.cli_commands import (
    cmd_drain,
    cmd_engines,
    cmd_leases,
    cmd_revoke,
    cmd_score,
    cmd_stats,
    cmd_watch,
)

ADDRESS_ENV = "KVBROKER_ADDR"
ENV_PREFIX = "KVBROKER_CLI_"


@dataclass(frozen=True)
class CliOptions:
    """The operator commands' global options (kvbroker.common.settings, like every configuration)."""

    broker: str = setting(DEFAULT_ADDRESS, "broker host:port", env=ADDRESS_ENV, metavar="HOST:PORT")
    timeout: float = setting(5.0, "per-call timeout in seconds", metavar="S")
    json: bool = setting(False, "print JSON (proto3 JSON names, every field) instead of a table")
    keepalive_ms: int = setting(
        keepalive.CLIENT_PING_INTERVAL_MS,
        "keepalive ping interval on the broker connection (the broker must allow it: "
        "its --keepalive-min-ping-interval-ms)",
        metavar="MS",
    )


DESCRIPTION = """\
KV cache broker for disaggregated vLLM inference.

  kvbroker serve                 run the broker (flags below `kvbroker serve --help`)
  kvbroker engines               registered engines, their blocks and leases
  kvbroker leases [--all]        live leases (and recently ended ones with --all)
  kvbroker stats                 index and lease counters
  kvbroker revoke LEASE_ID       end a lease now; holder and reader are told
  kvbroker drain ENGINE_ID       stop naming an engine and revoke its leases
  kvbroker watch                 stream index, lease and engine events
  kvbroker score --layout-id L --tokens 1,2,3   who holds the longest prefix
  kvbroker doctor                check this installation (e.g. torch's build for the CPU engine side)
"""

EPILOG = """\
environment:
  KVBROKER_ADDR          broker address for the operator commands (default 127.0.0.1:50051)
  KVBROKER_CLI_TIMEOUT   per-call timeout in seconds (default 5)
  KVBROKER_CLI_JSON      1: print JSON
  KVBROKER_TLS_CA, KVBROKER_TLS_CERT, KVBROKER_TLS_KEY, KVBROKER_TOKEN_FILE
                         TLS, mutual TLS or a bearer token (see docs/security.md)
  KVBROKER_CLI_KEEPALIVE_MS  keepalive ping interval in ms (default 30000)

exit status:
  0 ok, 1 other broker error, 2 bad usage, 3 broker unreachable or too slow
  (or it closed the connection, e.g. GOAWAY too_many_pings),
  4 not found, 5 failed precondition (e.g. lease already ended),
  6 invalid argument or out of range
"""


def build_parser(
    serve_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbroker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_text("kvbroker"))
    settings.add_arguments(parser, CliOptions, ENV_PREFIX, error=parser.error)
    secure = parser.add_argument_group(
        "broker security", "TLS, mutual TLS or a bearer token (docs/security.md)"
    )
    settings.add_arguments(secure, ClientSecurity, SECURITY_ENV_PREFIX, error=parser.error)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The global options work after the command too (`kvbroker engines --json`).
    common = argparse.ArgumentParser(add_help=False)
    settings.add_arguments(common, CliOptions, ENV_PREFIX, repeated=True)
    settings.add_arguments(common, ClientSecurity, SECURITY_ENV_PREFIX, repeated=True)

    serve = commands.add_parser(
        "serve",
        help="run the broker",
        description="Run the broker until SIGINT/SIGTERM. Every flag also reads an environment variable.",
    )
    if serve_arguments is not None:
        serve_arguments(serve)
    serve.set_defaults(handler=None)

    doctor = commands.add_parser(
        "doctor",
        help="check this installation",
        description="Check that the installed packages can run what they were installed for: with "
        "vLLM's CPU build, torch must be its CPU build (not the CUDA build pip takes from PyPI) and "
        "torchvision/torchaudio/torchcodec must be absent. Exit status 1 names what is wrong and the fix.",
    )
    doctor.set_defaults(handler=None)

    commands.add_parser(
        "vllm",
        add_help=False,
        help="vLLM's own command line from this venv: `kvbroker vllm serve ...`, `kvbroker vllm bench serve ...`",
        description="Run vLLM's command line with the arguments that follow (the CPU build's own `vllm` "
        "command stops with PackageNotFoundError: vllm).",
    )

    engines = commands.add_parser(
        "engines",
        parents=[common],
        help="list registered engines",
        description="Registered engines: state, layout, ranks, indexed blocks per tier, how exact "
        "the index is for each (INDEX: exact, lagging, degraded), leases held "
        "and read, last load and session TTL.",
    )
    engines.add_argument("--layout-id", default="", help="only engines with this layout id")
    engines.set_defaults(handler=cmd_engines)

    leases = commands.add_parser(
        "leases",
        parents=[common],
        help="list leases",
        description="Live leases: who holds the blocks (HOLDER) and who reads them (READER), "
        "state, blocks, remaining TTL. With --all, recently ended leases too, with the cause "
        "(released, ttl_expired, reader_gone, holder_gone, operator, ...).",
    )
    leases.add_argument(
        "--engine", default="", metavar="ENGINE_ID", help="only leases this engine holds or reads"
    )
    leases.add_argument("--all", action="store_true", help="include recently ended leases")
    leases.set_defaults(handler=cmd_leases)

    stats = commands.add_parser(
        "stats",
        parents=[common],
        help="show index and lease counters",
        description="Engines, sessions, indexed blocks, leases by state and revocations by cause.",
    )
    stats.set_defaults(handler=cmd_stats)

    revoke = commands.add_parser(
        "revoke",
        parents=[common],
        help="revoke a lease",
        description="End a live lease now (cause: operator). The holder is told to free the blocks and "
        "the reader to discard anything it read under the lease.",
    )
    revoke.add_argument("lease_id", metavar="LEASE_ID")
    revoke.add_argument("--reason", default="", help="recorded with the lease and shown to both sides")
    revoke.set_defaults(handler=cmd_revoke)

    drain = commands.add_parser(
        "drain",
        parents=[common],
        help="drain an engine",
        description="Mark an engine as draining: the broker stops naming it as a holder, refuses new "
        "holds by it, revokes the leases it holds (cause: drain) and tells the engine.",
    )
    drain.add_argument("engine_id", metavar="ENGINE_ID")
    drain.add_argument("--reason", default="", help="sent to the engine with the drain command")
    drain.set_defaults(handler=cmd_drain)

    watch = commands.add_parser(
        "watch",
        parents=[common],
        help="stream broker events",
        description="Print index, lease and engine events as they happen (Ctrl-C to stop). "
        "Without a filter flag, all kinds.",
    )
    watch.add_argument("--index", action="store_true", help="index events (blocks stored/removed)")
    watch.add_argument("--leases", action="store_true", help="lease events (held, active, released, revoked)")
    watch.add_argument("--engines", action="store_true", help="engine events (registered, gone, draining)")
    watch.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events")
    watch.set_defaults(handler=cmd_watch)

    score = commands.add_parser(
        "score",
        parents=[common],
        help="score engines for a prompt",
        description="For a prompt (token ids, hashed by the broker with the layout's block size and "
        "hash algorithm) or a chain of block hashes: how many leading blocks each engine holds, "
        "per tier, best first.",
    )
    score.add_argument("--layout-id", required=True, help="layout id (see `kvbroker engines`)")
    score.add_argument("--tenant", default="", help="tenant / cache_salt (default: none)")
    what = score.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", help="token ids, comma or space separated")
    what.add_argument("--hashes", help="wire block hashes (fixed64, decimal or 0x hex), in chain order")
    score.add_argument(
        "--candidate", action="append", metavar="ENGINE_ID", help="score only these engines (repeatable)"
    )
    score.add_argument(
        "--require-exact",
        action="store_true",
        help="count only blocks of engines whose index entries are exact (not lagging or degraded)",
    )
    score.add_argument(
        "--placement",
        action="store_true",
        help="order by predicted time to first token (each engine's load against the prefix it holds "
        "and the cost of pulling it; the proxy's data-parallel rule) and show each engine's cost and "
        "why the first is first; default: longest prefix first",
    )
    score.set_defaults(handler=cmd_score)
    return parser
