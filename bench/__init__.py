"""Benchmark programs: each starts what it needs, runs a fixed workload, prints a table and writes JSON.

One room per thing measured, one shared harness:

    harness/        loops, statistics, output, checks, plots, the baselines (no programs)
    control_plane/  the broker's calls against Redis, Mooncake and gRPC floors; TLS
    data_path/      KV block reads at real layouts
    chats/          TTFT per turn: one engine, vLLM's NixlConnector P/D, our P/D
    fleet/          reclamation, idle holders, chat load, the dashboard
    scale/          one broker against replicas over Redis
    summary.py      the README's summary from bench/results/

Run a program from the repository root as ``python -m bench.<room>.<program>``, e.g.
``python -m bench.control_plane.compare --quick``. A program imports the harness and its
room's helpers, never another program (tests/test_layering.py). See docs/bench.md.
"""
