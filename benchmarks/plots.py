"""The summary's plots, drawn from the benchmarks' results files (``make plots``).

Each plot reads one file of ``benchmarks/results/`` (written by the benchmark:
``_report.Results``, with its command, commit and date) and writes one PNG to
``docs/img/``, the commit and date it was measured at in its title. A missing
results file skips its plot with a line saying which command makes it.
Medians, as in the benchmarks' own tables; whiskers span the samples.

    python benchmarks/plots.py [--results benchmarks/results] [--out docs/img]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or a server
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
STOCK, OURS, OTHER = "#8c8c8c", "#1f77b4", "#ff7f0e"


def _gbps(nbytes: int, seconds: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest GB/s of ``seconds`` samples (zeros when none)."""
    rates = [nbytes / 1e9 / s for s in seconds if s > 0]
    if not rates:
        return 0.0, 0.0, 0.0
    return statistics.median(rates), min(rates), max(rates)


def _bars(
    ax, labels: list[str], series: dict[str, list[tuple[float, float, float]]], colors: list[str]
) -> None:
    """Grouped bars with whiskers from the lowest to the highest sample."""
    width = 0.8 / len(series)
    for k, ((name, values), color) in enumerate(zip(series.items(), colors, strict=True)):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        mids = [v[0] for v in values]
        err = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
        ax.bar(xs, mids, width, label=name, color=color, yerr=err, capsize=3)
    ax.set_xticks(range(len(labels)), labels)


def stamp(doc: dict) -> str:
    """Where a plot's figures come from: ``measured at abc1234, 2026-01-31``."""
    if "commit" not in doc:
        return "(its results file records no commit)"
    return f"measured at {doc['commit'][:7]}, {doc['date'][:10]}"


def _title(ax, doc: dict, text: str) -> None:
    ax.set_title(f"{text}\n{stamp(doc)}", fontsize=10)


def save_load(doc: dict, out: Path) -> None:
    """GB/s of save, warm load and cold load per method (bench_save_load.py)."""
    full, doc = doc, doc["data"]
    nbytes = doc["state_bytes"]
    names = [n for n in doc["samples"] if "random" not in n]
    kinds = {"save": "save_s", "warm load": "warm_s", "cold load": "cold_s"}
    series = {
        kind: [_gbps(nbytes, doc["samples"][n][key]) for n in names] for kind, key in kinds.items()
    }
    fig, ax = plt.subplots(figsize=(9, 4.2))
    _bars(ax, names, series, ["#2ca02c", OURS, "#9467bd"])
    ax.set_ylabel("GB/s (higher is better)")
    _title(ax, full, f"dcp.save / dcp.load of BERT-large ({nbytes / 1e9:.2f} GB fp32), one process")
    ax.legend()
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def planner(doc: dict, out: Path) -> None:
    """Largest rank's bytes per save against the world size (bench_planner.py)."""
    full, doc = doc, doc["data"]
    rows = doc["plan_only"]
    ranks = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, color, label in (
        ("stock", STOCK, "stock DefaultSavePlanner"),
        ("ours", OURS, "BalancedSavePlanner"),
    ):
        ax.plot(
            ranks,
            [r[name]["rank_bytes_max"] / 1e9 for r in rows],
            "o-",
            color=color,
            label=f"{label}: busiest rank",
        )
    ax.plot(
        ranks,
        [r["ours"]["rank_bytes_mean"] / 1e9 for r in rows],
        ":",
        color="k",
        label="mean per rank (the ideal)",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (data parallel, state replicated on every rank)")
    ax.set_ylabel("GB written by the busiest rank")
    _title(ax, full, f"Who writes what: {doc.get('state', 'replicated state')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def codecs(doc: dict, out: Path) -> None:
    """Compression ratio against two-thread compression speed, per codec and data set
    (bench_codecs.py)."""
    full, doc = doc, doc["data"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    markers = dict(zip(doc["codecs"], "osD^v<>", strict=False))
    colors = {"stock-zstd": STOCK, "zipnn": OTHER, "ours-bytegroup": OURS, "ours-zstd": "#17becf"}
    seen: set[str] = set()
    for data_set, per in doc["codecs"].items():
        for name, r in per.items():
            secs = r["comp_s"].get("2") or next(iter(r["comp_s"].values()), None)
            if not secs:
                continue
            speed = r["raw_bytes"] / 1e6 / statistics.median(secs)
            ratio = r["comp_bytes"] / r["raw_bytes"]
            ax.scatter(
                speed,
                ratio,
                marker=markers[data_set],
                color=colors.get(name, "k"),
                s=60,
                label=None if name in seen else name,
            )
            seen.add(name)
    for data_set, marker in markers.items():
        ax.scatter([], [], marker=marker, color="k", label=data_set)
    ax.set_xlabel("compression MB/s, two threads (right is better)")
    ax.set_ylabel("stored / raw bytes (lower is better)")
    _title(ax, full, "Codecs on real weights and optimizer state")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def async_blocked(doc: dict, out: Path) -> None:
    """Training time blocked by each dcp.async_save, stock against ours (bench_async.py)."""
    full, doc = doc, doc["data"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant, color, style in (
        ("stock", STOCK, "o--"),
        ("stock-best", STOCK, "s-"),
        ("ours", OURS, "o--"),
        ("ours-overlap", OURS, "s-"),
    ):
        for k, run in enumerate(doc.get(variant) or []):
            saves = range(1, len(run["blocked"]) + 1)
            ax.plot(
                saves,
                run["blocked"],
                style,
                color=color,
                alpha=0.8,
                label=f"{variant} (a process per line)" if k == 0 else None,
            )
    ax.set_xlabel("save number (save 1 includes one-time set-up on both sides)")
    ax.set_ylabel("seconds training is blocked (log)")
    ax.set_yscale("log")
    some = next(iter(doc.values()))[0]
    _title(ax, full, f"dcp.async_save of {some['state_bytes'] / 1e9:.2f} GB, blocked per save")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def restore_scale(doc: dict, out: Path) -> None:
    """Restore planning seconds against nodes, log-log, per layout: rings (today)
    and the point-to-point copies planner they replaced (bench_restore_plan.py)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colors = {
        "replicated/partner": OURS,
        "replicated/erasure": "#17becf",
        "sharded/partner": "#2ca02c",
        "sharded/erasure": "#9467bd",
    }
    for planner, style in (("ring", "o-"), ("copies", "s--")):
        for layout, color in colors.items():
            rows = [
                r
                for r in doc["rows"]
                if (r["planner"], r["layout"], r["lost"]) == (planner, layout, "1")
            ]
            if not rows:
                continue
            nodes = [r["nodes"] for r in rows]
            med = [statistics.median(r["seconds"]) for r in rows]
            label = f"{layout}, {'today' if planner == 'ring' else 'copies (before)'}"
            alpha = 1 if planner == "ring" else 0.6
            ax.plot(nodes, med, style, color=color, label=label, alpha=alpha)
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="goal at 2,000 nodes: 1 s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes (x {doc['rows'][0]['ranks']} ranks), one node lost")
    ax.set_ylabel("seconds to plan the restore (every rank)")
    _title(ax, doc, "Restore planning against job size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def save_plan_scale(doc: dict, out: Path) -> None:
    """Coordinator planning seconds against ranks, log-log, ours against stock's
    DefaultSavePlanner, per state (bench_plan_scale.py)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for state, marker in (("replicated", "o"), ("fsdp", "s")):
        rows = sorted((r for r in doc["rows"] if r["state"] == state), key=lambda r: r["ranks"])
        if not rows:
            continue
        ranks = [r["ranks"] for r in rows]
        for name, color, label in (
            ("stock", STOCK, "stock DefaultSavePlanner"),
            ("ours", OURS, "BalancedSavePlanner"),
        ):
            ax.plot(
                ranks,
                [r[name]["plan_s"] for r in rows],
                f"{marker}-",
                color=color,
                label=f"{label}, {state}",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (BERT-large + AdamW; replicated, or FSDP row shards)")
    ax.set_ylabel("seconds to plan a save (the coordinator)")
    _title(ax, doc, "Save planning against job size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


#: results file -> (plot, PNG name, the benchmark and options that write the results file).
PLOTS: dict[str, tuple[Callable[[dict, Path], None], str, str]] = {
    "save_load.json": (save_load, "save_load.png", "bench_save_load.py"),
    "planner.json": (planner, "planner_balance.png", "bench_planner.py --skip-e2e"),
    "codecs.json": (codecs, "codecs.png", "bench_codecs.py"),
    "async.json": (async_blocked, "async_blocked.png", "bench_async.py"),
    "restore_plan.json": (restore_scale, "scale_restore.png", "bench_restore_plan.py"),
    "plan_scale.json": (save_plan_scale, "scale_save_plan.png", "bench_plan_scale.py"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs" / "img")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (plot, png, cmd) in PLOTS.items():
        src = args.results / name
        if not src.exists():
            print(f"skipped {png}: no {src} (made by: python benchmarks/{cmd})")
            continue
        plot(json.loads(src.read_text()), args.out / png)
        plt.close("all")
        print(f"wrote {args.out / png} from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
