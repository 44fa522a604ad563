"""The harness every benchmark program shares (a room of helpers, no programs).

    loops       closed-loop clients (async and threads), RunResult, Figure, aggregate, med/spread,
                rss_bytes/cpu_seconds of a process
    output      tables, figures with their spread, the JSON record with the machine and its load,
                log() progress lines on stderr, RESULTS_DIR
    checks      the consistency checks every throughput figure passes (Little's law, cores, memcpy)
    plot        PNG bar charts (matplotlib optional)
    engines     engine benchmarks' common parts: workdir and tiny model, broker + P + D, turn timing
    baselines   what a benchmark compares against, defined once: vLLM's NixlConnector P/D
    nixl_quiet  the module vLLM loads for that baseline (its NIXL agent without the spinning thread)

Child processes (broker, proxy, peers) come from testkit.processes; engines from testkit.engines.
"""
