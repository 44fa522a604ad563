"""Engines without our connector: their vLLM KV events, and the KV-indexer HTTP API over the index.

Only `broker.server` imports this wing; it builds on the broker's top level
and never on the other wings.
"""
