"""`python -m kvbroker.broker`: the same as `kvbroker serve`."""

from __future__ import annotations

import argparse
import sys

from kvbroker.broker.server import add_serve_arguments, serve_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.broker",
        description="KV cache broker: who holds which KV blocks, and who may read them until when.",
    )
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
