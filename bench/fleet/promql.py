"""The part of PromQL the kvbroker dashboard uses, evaluated over scraped samples.

No Prometheus or Grafana runs where the dashboard's picture is made, so
bench/fleet/dashboard.py scrapes the real /metrics endpoints itself and evaluates
each panel's query (read from deploy/grafana/kvbroker.json) with this module.
A query outside the subset raises `Unsupported`, so the dashboard cannot use
what the picture would not show.

Supported: ``name{label="v",label!="v",label=~"re"}``; ``rate(sel[1m])`` and
``increase(sel[5m])``; ``sum|max|min|avg [by (l, ...)] (expr)``;
``histogram_quantile(q, expr)``; ``expr / number`` and ``expr * number``.
Range windows take ``s``, ``m`` and ``h``. Instant selectors look back 5 minutes.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]
LOOKBACK_S = 300.0

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?![\w:])|(?P<dur>\d+[smh])|(?P<name>[A-Za-z_:][\w:]*)"
    r'|(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>=~|!=|[{}()\[\],=/*]))'
)


class Unsupported(ValueError):
    """A query outside the subset this module evaluates."""


@dataclass
class Samples:
    """Scraped samples: (metric name, labels) -> [(time, value), ...] in time order."""

    series: dict[tuple[str, Labels], list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def add(self, t: float, name: str, labels: dict[str, str], value: float) -> None:
        self.series[(name, frozenset(labels.items()))].append((t, value))

    def names(self) -> set[str]:
        return {name for name, _ in self.series}


def _tokens(query: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(query.rstrip()):
        m = _TOKEN.match(query, pos)
        if m is None or m.end() == pos:
            raise Unsupported(f"cannot read {query[pos : pos + 20]!r} in {query!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _seconds(d: str) -> float:
    return float(d[:-1]) * {"s": 1, "m": 60, "h": 3600}[d[-1]]


@dataclass
class Node:
    kind: str  # select, range, agg, quantile, scale
    args: dict[str, object]


class _Parser:
    def __init__(self, query: str) -> None:
        self.query = query
        self.toks = _tokens(query)
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        k, v = self.peek()
        if (value is not None and v != value) or (kind is not None and k != kind):
            raise Unsupported(f"expected {value or kind} at {v!r} in {self.query!r}")
        self.i += 1
        return v

    def parse(self) -> Node:
        node = self.expr()
        if self.peek()[0] != "end":
            raise Unsupported(f"unexpected {self.peek()[1]!r} in {self.query!r}")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.peek()[1] in ("/", "*"):
            op = self.take()
            factor = float(self.take(kind="num"))
            node = Node("scale", {"of": node, "by": 1 / factor if op == "/" else factor})
        return node

    def term(self) -> Node:
        kind, value = self.peek()
        if kind != "name":
            raise Unsupported(f"expected a metric or function at {value!r} in {self.query!r}")
        if value in ("sum", "max", "min", "avg"):
            self.take()
            by: list[str] = []
            if self.peek()[1] == "by":
                self.take()
                by = self.names()
            self.take("(")
            inner = self.expr()
            self.take(")")
            return Node("agg", {"op": value, "by": by, "of": inner})
        if value in ("rate", "increase"):
            self.take()
            self.take("(")
            sel = self.selector()
            self.take("[")
            window = _seconds(self.take(kind="dur"))
            self.take("]")
            self.take(")")
            return Node("range", {"fn": value, "sel": sel, "window": window})
        if value == "histogram_quantile":
            self.take()
            self.take("(")
            q = float(self.take(kind="num"))
            self.take(",")
            inner = self.expr()
            self.take(")")
            return Node("quantile", {"q": q, "of": inner})
        if self.toks[self.i + 1 : self.i + 2] == [("op", "(")]:
            raise Unsupported(f"function {value!r} is not supported ({self.query!r})")
        return self.selector()

    def names(self) -> list[str]:
        self.take("(")
        out = [self.take(kind="name")]
        while self.peek()[1] == ",":
            self.take()
            out.append(self.take(kind="name"))
        self.take(")")
        return out

    def selector(self) -> Node:
        name = self.take(kind="name")
        matchers: list[tuple[str, str, str]] = []
        if self.peek()[1] == "{":
            self.take()
            while self.peek()[1] != "}":
                label = self.take(kind="name")
                op = self.take()
                if op not in ("=", "!=", "=~"):
                    raise Unsupported(f"matcher {op!r} in {self.query!r}")
                matchers.append((label, op, self.take(kind="str")[1:-1]))
                if self.peek()[1] == ",":
                    self.take()
            self.take("}")
        return Node("select", {"name": name, "matchers": matchers})


def parse(query: str) -> Node:
    return _Parser(query).parse()


def metric_names(node: Node) -> set[str]:
    """Every metric a query reads (a histogram's ``_bucket`` series by its full name)."""
    if node.kind == "select":
        return {str(node.args["name"])}
    if node.kind == "range":
        return metric_names(node.args["sel"])  # type: ignore[arg-type]
    return metric_names(node.args["of"])  # type: ignore[arg-type]


def _matches(labels: Labels, matchers: list[tuple[str, str, str]]) -> bool:
    d = dict(labels)
    for label, op, value in matchers:
        have = d.get(label, "")
        if (op == "=" and have != value) or (op == "!=" and have == value):
            return False
        if op == "=~" and not re.fullmatch(value, have):
            return False
    return True


def _selected(samples: Samples, node: Node) -> list[tuple[Labels, list[tuple[float, float]]]]:
    name, matchers = node.args["name"], node.args["matchers"]
    return [
        (labels, points)
        for (n, labels), points in samples.series.items()
        if n == name and _matches(labels, matchers)  # type: ignore[arg-type]
    ]


def evaluate(node: Node, samples: Samples, t: float) -> Vector:
    if node.kind == "select":
        out: Vector = {}
        for labels, points in _selected(samples, node):
            recent = [v for ts, v in points if t - LOOKBACK_S <= ts <= t]
            if recent:
                out[labels] = recent[-1]
        return out
    if node.kind == "range":
        window = float(node.args["window"])  # type: ignore[arg-type]
        out = {}
        for labels, points in _selected(samples, node.args["sel"]):  # type: ignore[arg-type]
            inside = [(ts, v) for ts, v in points if t - window <= ts <= t]
            if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                continue
            delta = 0.0
            for (_, a), (_, b) in itertools.pairwise(inside):
                delta += b - a if b >= a else b  # a counter reset starts again from 0
            span = inside[-1][0] - inside[0][0]
            out[labels] = delta / span if node.args["fn"] == "rate" else delta * window / span
        return out
    if node.kind == "scale":
        by = float(node.args["by"])  # type: ignore[arg-type]
        return {k: v * by for k, v in evaluate(node.args["of"], samples, t).items()}  # type: ignore[arg-type]
    if node.kind == "agg":
        groups: dict[Labels, list[float]] = defaultdict(list)
        keep = set(node.args["by"])  # type: ignore[call-overload]
        for labels, value in evaluate(node.args["of"], samples, t).items():  # type: ignore[arg-type]
            groups[frozenset((k, v) for k, v in labels if k in keep)].append(value)
        op = {"sum": sum, "max": max, "min": min, "avg": lambda xs: sum(xs) / len(xs)}[str(node.args["op"])]
        return {k: float(op(vs)) for k, vs in groups.items()}  # type: ignore[operator]
    if node.kind == "quantile":
        return _quantile(float(node.args["q"]), evaluate(node.args["of"], samples, t))  # type: ignore[arg-type]
    raise Unsupported(node.kind)


def _quantile(q: float, vector: Vector) -> Vector:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket that holds rank q."""
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, count in vector.items():
        d = dict(labels)
        le = d.pop("le", None)
        if le is not None:
            groups[frozenset(d.items())].append((math.inf if le == "+Inf" else float(le), count))
    out: Vector = {}
    for labels, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1] if buckets else 0.0
        if total <= 0 or buckets[-1][0] != math.inf:
            continue
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if bound == math.inf:
                    out[labels] = lower_bound
                elif count == lower_count:
                    out[labels] = bound
                else:
                    out[labels] = lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                        count - lower_count
                    )
                break
            lower_bound, lower_count = bound, count
    return out


def legend(template: str, labels: Labels) -> str:
    """Grafana's ``{{label}}`` legend format."""
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), template) or "value"
