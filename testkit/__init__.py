"""Scaffolding for tests and benchmarks: one home that both tests/ and bench/ import.

The top layer: it may import any part of kvbroker, and no part of the product
imports it (tests/test_layering.py checks both). It is not in the kvbroker
wheel: it runs from the source tree, where pytest and `python -m bench.*` find it.

    builders   fingerprint(), engine_info(): the wire shapes an engine registers with
    clock      FakeClock: a clock that moves only when told (now(), advance(), sleep(), call)
    ports      free_port()
    waiting    wait_for() (sync) and until() (async): poll a predicate within a deadline
    broker     running_broker(): a broker in this process, as an async context manager
    processes  BrokerProcess: `python -m kvbroker.broker` (or `kvbroker serve`) as a child
    engines    vLLM engines with our connector, and request helpers (needs the engine extra to run)
"""
