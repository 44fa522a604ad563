"""The installed kvbroker version, for every program's ``--version``."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "kvbroker"


def version() -> str:
    """The installed distribution's version; "unknown" when run from a tree that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def version_text(program: str) -> str:
    """What ``PROGRAM --version`` prints."""
    return f"{program} {version()}"
