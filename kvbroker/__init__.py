"""kvbroker: a KV cache broker for disaggregated vLLM inference.

One import namespace; each part has its own layer (docs/architecture.md):

- `kvbroker.v1`: the generated gRPC API (proto/kvbroker/v1/broker.proto).
- `kvbroker.common`: layouts, topology rules, block hashing, the prefix index and ranking.
- `kvbroker.broker`: the broker service (leases, index, sessions, gRPC servicer).
- `kvbroker.clients`: Python clients (unary, engine sessions, index mirror) and the P/D proxy.
- `kvbroker.engine_adapter`: the vLLM KV connector plugin and its NIXL data path.
- `kvbroker.tools`: the `kvbroker` command, the demo, the vLLM launcher, the tiny test model.
"""
