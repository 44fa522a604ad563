"""Small dense linear algebra for the online fits (the engine's cost model, the proxy's placement)."""

from __future__ import annotations


def solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``x`` with ``m x = v`` by Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    return [a[i][n] / a[i][i] for i in range(n)]
