"""The Redis/Valkey fleet: broker state in a shared store, served by any number of replicas.

Only `broker.server` imports this wing, and builds a replica with one constructor
(`replica.Replica`); it builds on the broker's top level (core, registry, leases,
channels) and never on the other wings.
"""
