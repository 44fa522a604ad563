"""Control plane: the broker's calls (resolve, inventory, mirror, TLS) against what a user would
pick instead (grpc.aio floors, Redis, Mooncake's master), on loopback. Programs: compare, broker,
tls; child programs: grpc_echo, index_memory. docs/bench.md."""
