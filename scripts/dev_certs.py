"""Development certificates for a broker with mutual TLS (docker compose, trying it out).

    python scripts/dev_certs.py deploy/certs [--tenant dev] [--name broker --name localhost]

Writes into the folder: ca.pem (and ca.key), broker.pem/.key for the broker's
names, and one client certificate per identity: prefill and decode
(kvbroker://TENANT/engine/...), proxy (router), health (router, for health
checks), admin (kvbroker://*/operator/admin) and prometheus (an operator of
every tenant, for the broker's /metrics over HTTPS). Needs the `cryptography`
package (the dev extra). For development only: the CA key lies next to what it
signed, and the keys are readable by every user so that containers running as
another user can read them. Never commit them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The certificate helper lives in the source tree's test kit (not in the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from testkit.certs import LOCAL_NAMES, CertificateAuthority


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tenant", default="dev", help="tenant of the engines and the proxy (default: dev)")
    parser.add_argument(
        "--name",
        action="append",
        help="a name of the broker's certificate (repeatable; default: broker, broker-a, broker-b, localhost)",
    )
    args = parser.parse_args(argv)
    names = tuple(args.name or ("broker", "broker-a", "broker-b", *LOCAL_NAMES))
    ca = CertificateAuthority.create(args.folder)
    ca.server("broker", names)
    identities = {
        "prefill": f"kvbroker://{args.tenant}/engine/prefill",
        "decode": f"kvbroker://{args.tenant}/engine/decode",
        "proxy": f"kvbroker://{args.tenant}/router/proxy",
        "health": f"kvbroker://{args.tenant}/router/health",
        "admin": "kvbroker://*/operator/admin",
        "prometheus": "kvbroker://*/operator/prometheus",  # scrapes the broker's /metrics over mutual TLS
    }
    for stem, identity in identities.items():
        ca.client(stem, identity)
    for key in args.folder.glob("*.key"):
        os.chmod(key, 0o644)  # dev only: containers run as other users
    print(
        f"dev certificates in {args.folder}: ca.pem, broker.pem ({', '.join(names)}), "
        + ", ".join(identities)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
