"""Benchmark programs: each starts what it needs, runs a fixed workload, prints a table and writes JSON.

Run them from the repository root, e.g. ``python -m bench.control_plane --quick``.
See docs/bench.md.
"""
