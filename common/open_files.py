"""Raise this process's limit of open files to what the system allows, for the servers.

Each client connection costs a server one descriptor. Many systems start programs with a soft
limit of 1,024 under a hard limit of hundreds of thousands; at the soft limit a gRPC server stops
accepting connections (it logs "File descriptor limit reached" and retries), so a fleet of engines
and routers, or one client that opens many connections, locks every newcomer out. Servers such as
vLLM's raise the soft limit at start; the broker and the proxy do the same. A process may raise its
soft limit up to its hard limit without privileges; the hard limit stays the operator's.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("kvbroker.open_files")
# Where the hard limit is "unlimited", the soft limit goes this far (the kernel's usual ceiling).
UNLIMITED_CAP = 1 << 20


def raise_open_files_limit() -> tuple[int, int]:
    """Set the soft RLIMIT_NOFILE to the hard one; returns (before, after). Never raises: a system
    that refuses keeps its limit, and the server runs as it would have."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = UNLIMITED_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as err:
            log.warning("open files stay limited to %d (could not raise to %d: %s)", soft, wanted, err)
            return soft, soft
        log.info("open files limit raised from %d to %d", soft, wanted)
        return soft, wanted
    return soft, soft
