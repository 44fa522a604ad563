"""The sampling fields a P/D request is checked for before P prefills it.

vLLM refuses these too, but only D sees the client's value (P gets max_tokens 1,
pd_bodies.py): without this check an invalid request costs P a full prefill, and
a hold that must be declined, before the 400. Only what is certainly invalid
for every vLLM engine is refused here; everything else is left to the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# field -> (smallest allowed, the phrase of the message); null or absent: the engine's default.
_AT_LEAST_ONE = ("max_tokens", "max_completion_tokens", "n")
_NON_NEGATIVE = ("temperature", "min_tokens")


class InvalidRequest(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_sampling(body: Mapping[str, Any]) -> None:
    """Raise InvalidRequest (with the offending field) for a value no engine accepts."""
    for key in _AT_LEAST_ONE:
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidRequest(key, f"{key} must be an integer of at least 1, got {value!r}")
    for key in _NON_NEGATIVE:
        value = body.get(key)
        if value is not None and (not _is_number(value) or value < 0):
            raise InvalidRequest(key, f"{key} must be a number of at least 0, got {value!r}")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise InvalidRequest("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream", f"stream must be true or false, got {stream!r}")
