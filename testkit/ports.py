"""A free TCP port: the product's own helper (kvbroker.tools.launch), the one copy."""

from __future__ import annotations

from kvbroker.tools.launch import free_port

__all__ = ["free_port"]
