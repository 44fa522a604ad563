"""Read a broker's Prometheus /metrics as numbers."""

from __future__ import annotations

import urllib.request


def scrape(port: int, prefix: str, timeout: float = 10.0) -> dict[str, float]:
    """Every series whose line starts with `prefix` (labels included in the name), by value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith(prefix) and " " in line
        for name, value in [line.rsplit(" ", 1)]
    }
