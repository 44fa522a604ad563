"""The ``kvbroker`` command: run the broker and look into a running one.

Every command except ``serve`` talks to the broker named by ``--broker``
(default ``$KVBROKER_ADDR`` or 127.0.0.1:50051) and prints an aligned table,
or JSON with ``--json``. Errors print one line naming the gRPC status and
exit non-zero (see ``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from kvbroker.clients import errors
from kvbroker.clients.credentials import ClientSecurity, CredentialError
from kvbroker.clients.sync import BrokerClient
from kvbroker.common import keepalive, settings
from kvbroker.tools import doctor
from kvbroker.tools.cli_commands import cmd_serve
from kvbroker.tools.cli_parser import build_parser
from kvbroker.tools.cli_render import format_table, to_json

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CODES",
    "EXIT_USAGE",
    "build_parser",
    "exit_code_of",
    "format_table",
    "main",
    "to_json",
]

# Exit status per error class (first match wins, so subclasses come first).
EXIT_CODES: tuple[tuple[type[errors.BrokerError], int], ...] = (
    (errors.Unavailable, 3),
    (errors.DeadlineExceeded, 3),
    (errors.NotFound, 4),
    (errors.FailedPrecondition, 5),
    (errors.InvalidArgument, 6),
    (errors.OutOfRange, 6),
    (errors.BrokerError, 1),
)
EXIT_USAGE = 2
# The reader of our output left (`kvbroker watch | head`): what a shell reports for a command
# killed by SIGPIPE (128 + 13), without Python's traceback.
EXIT_BROKEN_PIPE = 141


def exit_code_of(err: errors.BrokerError) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(err, cls):
            return code
    return 1


def _serve_arguments() -> Callable[[argparse.ArgumentParser], None] | None:
    try:
        from kvbroker.broker import server
    except ImportError:
        return None
    return server.add_serve_arguments


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if _command_of(argv) == "vllm":
        # Everything after `vllm` is vLLM's: its own parser reads it.
        from kvbroker.tools.vllm_cli import main as vllm_main

        return vllm_main(argv[argv.index("vllm") + 1 :])
    # Only `serve` needs the broker's modules: other commands start fast and work without them.
    wants_serve = _command_of(argv) == "serve"
    parser = build_parser(_serve_arguments() if wants_serve else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(out)
        return EXIT_USAGE
    if args.command == "doctor":
        return doctor.run(out)
    if args.command == "serve":
        if not wants_serve or _serve_arguments() is None:
            print("kvbroker: error: the broker is not installed (broker.server missing)", file=sys.stderr)
            return 1
        return cmd_serve(args)
    try:
        security = settings.from_args(ClientSecurity, args)
        options = keepalive.client_options(args.keepalive_ms)
        with BrokerClient(args.broker, timeout=args.timeout, options=options, security=security) as client:
            return int(args.handler(client, args, out))
    except BrokenPipeError:
        if out is sys.stdout:  # the interpreter flushes stdout at exit: point it where nobody reads
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except errors.BrokerError as err:
        print(f"kvbroker {args.command}: {_explain(err, args)}", file=sys.stderr)
        return exit_code_of(err)
    except CredentialError as err:
        print(f"kvbroker {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE


def proxy_main(argv: Sequence[str] | None = None) -> int:
    """The ``kvbroker-proxy`` command: the P/D proxy, or a clear word when its extra is missing."""
    try:
        from kvbroker.clients.proxy.__main__ import main as run_proxy
    except ImportError as exc:  # the proxy extra (aiohttp) is missing; the package says what to install
        print(f"kvbroker-proxy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run_proxy(None if argv is None else list(argv))


def _command_of(argv: Sequence[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--broker")
    pre.add_argument("--timeout")
    pre.add_argument("--keepalive-ms")
    pre.add_argument("--json", action="store_true")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    return known.command


def _explain(err: errors.BrokerError, args: argparse.Namespace) -> str:
    if isinstance(err, errors.Unavailable) and keepalive.is_too_many_pings(err.message):
        return (
            f"the broker at {args.broker} closed the connection (GOAWAY ENHANCE_YOUR_CALM "
            f'"too_many_pings"): this client pings every {args.keepalive_ms} ms, more often than the '
            "broker allows; raise --keepalive-ms or lower the broker's --keepalive-min-ping-interval-ms"
        )
    if isinstance(err, errors.Unavailable) and "goaway" in err.message.lower():
        return f"the broker at {args.broker} closed the connection ({err.message})"
    if isinstance(err, errors.Unavailable):
        return f"cannot reach the broker at {args.broker} ({err.message}); is `kvbroker serve` running there?"
    if isinstance(err, errors.DeadlineExceeded):
        return f"the broker at {args.broker} did not answer within {args.timeout:g} s"
    return str(err)


if __name__ == "__main__":
    sys.exit(main())
