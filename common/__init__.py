"""The bottom layer beside the generated API: vocabulary both the broker and its clients speak.

- `layout`: layout ids and the topology rules (which engines may read each other's blocks).
- `hashing`: vLLM's chained block hashes, computed from token ids.
- `model`: small value types (tiers, lease states, namespaces).
- `index`: the prefix index (the broker's table, and a client's local mirror of it).
- `scoring`: how holders of a prefix are ranked.
- `causes`: why the broker refused or ended something (ErrorInfo reasons, SessionError.cause).
- `error_details`: those causes on the wire, as gRPC's rich error model (google.rpc.Status).

Nothing here imports from `kvbroker.broker`, `kvbroker.clients` or above.
"""
