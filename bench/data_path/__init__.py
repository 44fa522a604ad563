"""Data path: KV blocks read between two processes at real KV layouts (adapter, raw NIXL, one
contiguous read, memcpy), and the same on a GPU. Programs: reads, gpu_check (its holder:
gpu_check_holder). docs/data_path.md."""
