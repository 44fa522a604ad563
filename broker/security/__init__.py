"""Who is calling and what it may do: TLS, identities, roles, tenants and quotas.

Only `broker.server` imports this wing; it builds on the broker's top level
and never on the other wings.
"""
