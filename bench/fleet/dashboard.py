"""Draw the Grafana dashboard (deploy/grafana/kvbroker.json) from a real run, without Grafana.

    python -m bench.fleet.dashboard                        # run the stack, chat, scrape, draw docs/dashboard.png
    python -m bench.fleet.dashboard --from-samples FILE    # draw again from a run's saved samples

What it does:

1. starts a real stack on the tiny model: the broker (with /metrics), a prefill
   and a decode vLLM engine with our connector (vLLM's stats on, so their
   /metrics carry the vllm:* and vllm:kvbroker_* series), the P/D proxy, and a
   third vLLM engine WITHOUT our connector that the broker follows by its KV
   cache events (``--kv-events``);
2. scrapes the broker's, the three engines' and the proxy's /metrics every
   second, labelling each sample with ``job`` (broker, prefill, decode,
   events, proxy) as deploy/prometheus.yml does;
3. runs waves of multi-turn chats through the proxy (conversations at once,
   one turn after another; a pause between waves, in which D's holds end) and
   a few prompts straight to the event-fed engine;
4. evaluates every panel's PromQL, read from the dashboard JSON (bench/fleet/promql.py),
   at each second of the run, and draws the panels in the dashboard's order
   and titles into one PNG; writes the raw samples next to it
   (bench/results/dashboard_samples.json) so the picture can be redrawn.

Needs the engine-side extra (vLLM), matplotlib (the ``bench`` extra) and
pyzmq/msgspec (installed with vLLM).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.fleet.promql import Samples, evaluate, legend, metric_names, parse

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvbroker.json"
OUT = ROOT / "docs" / "dashboard.png"
SAMPLES_OUT = ROOT / "bench" / "results" / "dashboard_samples.json"
SCALE = {
    "GBs": "GB/s",
    "bytes": "bytes",
    "s": "seconds",
    "ops": "per second",
    "reqps": "requests/s",
    "short": "",
}


@dataclass
class Panel:
    title: str
    unit: str
    targets: list[tuple[str, str]]  # (expr, legend format)


def load_panels(path: Path = DASHBOARD) -> list[Panel]:
    """The dashboard's panels in order, each with its queries as Grafana reads them."""
    dash = json.loads(path.read_text())
    panels = sorted(dash["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    return [
        Panel(
            p["title"],
            p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
            [(t["expr"], t.get("legendFormat", "")) for t in p["targets"]],
        )
        for p in panels
    ]


class Scraper:
    """Scrapes /metrics of each job every `interval` seconds on a thread, into `samples`."""

    def __init__(self, targets: dict[str, str], interval: float = 1.0) -> None:
        self.targets = targets
        self.interval = interval
        self.samples = Samples()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def start(self) -> Scraper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def scrape_once(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        now = time.time()
        for job, url in self.targets.items():
            try:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                continue  # down for a moment (starting, or a chat in flight starved it): a gap
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    self.samples.add(now, s.name, {**s.labels, "job": job}, float(s.value))

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.scrape_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))


def queried(panels: list[Panel]) -> set[str]:
    """Every series name the panels read."""
    return {name for p in panels for expr, _ in p.targets for name in metric_names(parse(expr))}


def save_samples(samples: Samples, path: Path, names: set[str], note: str = "") -> None:
    """The samples of the series in `names` (what the panels read), as JSON, with the run's note."""
    rows = [
        [name, dict(labels), points] for (name, labels), points in samples.series.items() if name in names
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"note": note, "series": rows}))


def load_samples(path: Path) -> tuple[Samples, str]:
    samples = Samples()
    saved = json.loads(path.read_text())
    for name, labels, points in saved["series"]:
        for t, v in points:
            samples.add(t, name, labels, v)
    return samples, str(saved.get("note", ""))


def render(panels: list[Panel], samples: Samples, out: Path, *, step: float = 2.0, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = sorted({t for points in samples.series.values() for t, _ in points})
    if not times:
        raise SystemExit("no samples: nothing was scraped")
    t0, t1 = times[0], times[-1]
    grid = [t0 + i * step for i in range(int((t1 - t0) / step) + 1)]
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(16, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        lines: dict[str, tuple[list[float], list[float]]] = {}
        for expr, fmt in panel.targets:
            node = parse(expr)
            for t in grid:
                for labels, value in evaluate(node, samples, t).items():
                    xs, ys = lines.setdefault(legend(fmt, labels), ([], []))
                    xs.append(t - t0)
                    ys.append(value)
        for name, (xs, ys) in sorted(lines.items()):
            ax.plot(xs, ys, label=name, linewidth=1.4)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel(SCALE.get(panel.unit, panel.unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run", fontsize=8)
    fig.suptitle(
        "kvbroker dashboard (deploy/grafana/kvbroker.json), drawn from a real run" + note, fontsize=12
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def run(args: argparse.Namespace) -> Samples:
    """Start the stack, scrape it while chats run, stop it; returns the samples."""
    from bench.fleet.dashboard_stack import DashboardStack

    with DashboardStack(Path(args.workdir)) as stack:
        scraper = Scraper(stack.targets(), interval=1.0).start()
        try:
            stack.workload(
                conversations=args.conversations,
                turns=args.turns,
                max_tokens=args.max_tokens,
                waves=args.waves,
                pause_s=args.pause_s,
            )
            time.sleep(args.tail_s)  # let rates settle and holds end
        finally:
            scraper.stop()
    return scraper.samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="the PNG to write")
    parser.add_argument("--samples", default=str(SAMPLES_OUT), help="where the run's samples go (JSON)")
    parser.add_argument("--from-samples", default="", help="draw from saved samples instead of running")
    parser.add_argument("--workdir", default="/tmp/kvbroker-dashboard", help="logs and the tiny model")
    parser.add_argument("--conversations", type=int, default=6, help="conversations at once, per wave")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--waves", type=int, default=3, help="rounds of conversations")
    parser.add_argument("--pause-s", type=float, default=20.0, help="seconds between waves")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--tail-s", type=float, default=20.0, help="seconds to keep scraping after the chats")
    args = parser.parse_args(argv)
    panels = load_panels()
    for panel in panels:  # fail before a long run if a query is outside what we can draw
        for expr, _ in panel.targets:
            parse(expr)
    if args.from_samples:
        samples, note = load_samples(Path(args.from_samples))
    else:
        samples = run(args)
        note = f": {args.waves} waves of {args.conversations} chats x {args.turns} turns through the proxy"
        save_samples(samples, Path(args.samples), queried(panels), note)
    render(panels, samples, Path(args.out), note=note)
    print(f"wrote {args.out} ({len(samples.series)} series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
