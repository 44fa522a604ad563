"""Data path: KV blocks read between two processes at real KV layouts (adapter, raw NIXL, one
contiguous read, memcpy). Program: reads. docs/data_path.md."""
