"""How the ``kvbroker`` command prints: aligned tables, JSON, and one line per watch event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from kvbroker.v1 import broker_pb2 as pb

TIER_NAMES: dict[int, str] = {pb.TIER_UNSPECIFIED: "-", pb.TIER_GPU: "GPU", pb.TIER_CPU: "CPU"}


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    text_rows = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    numeric = [all(_is_number(row[i]) for row in text_rows) and bool(text_rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in text_rows)])


def _is_number(cell: str) -> bool:
    """Numbers, percentages and durations ("12", "25%", "10.0s") line up on the right."""
    try:
        float(cell.removesuffix("%").removesuffix("s"))
    except ValueError:
        return False
    return True


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def to_json(message: Message) -> dict[str, Any]:
    """The proto's own field names (snake_case, as in broker.proto), every field (zeros and
    empty lists too), enums by name, and 64-bit integers as JSON numbers (proto3's JSON
    mapping would write them as strings)."""
    out = MessageToDict(message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
    return _ints(message.DESCRIPTOR, out)


def _ints(descriptor: Any, value: dict[str, Any]) -> dict[str, Any]:
    """64-bit integer fields of ``value`` (MessageToDict's strings) back to ints, nested too."""
    for f in descriptor.fields:
        if f.name not in value:
            continue
        v = value[f.name]
        repeated = f.is_repeated
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            entry = f.message_type.fields_by_name["value"]
            if entry.type in _INT64:
                value[f.name] = {k: int(x) for k, x in v.items()}
            elif entry.message_type is not None:
                value[f.name] = {k: _ints(entry.message_type, x) for k, x in v.items() if isinstance(x, dict)}
        elif f.message_type is not None:
            if repeated:
                value[f.name] = [_ints(f.message_type, x) if isinstance(x, dict) else x for x in v]
            elif isinstance(v, dict):
                _ints(f.message_type, v)
        elif f.type in _INT64:
            value[f.name] = [int(x) for x in v] if repeated else int(v)
    return value


def print_json(value: Any, out: TextIO) -> None:
    print(json.dumps(value, indent=2, sort_keys=True), file=out)


def tier_name(t: int) -> str:
    return TIER_NAMES.get(t, str(t))


def seconds(ms: int) -> str:
    return f"{ms / 1000:.1f}s"


def lease_state(state: int) -> str:
    return pb.LeaseState.Name(state).removeprefix("LEASE_").lower()  # type: ignore[arg-type]


def cause_name(cause: int) -> str:
    if cause == pb.REVOKE_CAUSE_UNSPECIFIED:
        return "-"
    return pb.RevokeCause.Name(cause).removeprefix("REVOKE_").lower()  # type: ignore[arg-type]


def event_line(event: pb.WatchEvent) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.time_unix)) if event.time_unix else "--:--:--"
    parts = [when, f"{event.kind:<18}", event.engine_id or "-"]
    if event.lease.lease_id:
        lease = event.lease
        parts.append(
            f"lease={lease.lease_id} {lease.holder_engine_id}->{lease.reader_engine_id or '?'} "
            f"blocks={len(lease.block_hashes)}"
        )
    if event.blocks:
        parts.append(f"blocks={event.blocks} tier={tier_name(event.tier)}")
    if event.detail:
        parts.append(event.detail)
    return "  ".join(parts)
