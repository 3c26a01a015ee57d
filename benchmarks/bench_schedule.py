"""Simulated fault-tolerance overhead of save policies, with measured costs.

A simulation, not a measurement: ``benchmarks/sim`` plays training runs
with failures and counts what each save policy costs (time blocked saving,
progress lost and computed again, restores). The costs per save and restore
come from this project's benchmarks (``benchmarks/sim/measured.py`` says
which); the failure rates from
the published reports (``FailureModel.for_gpus``: Meta 2024, Llama 3).

Scenarios: 1,024 and 16,384 GPUs; one level (every save straight to the
remote, blocking) or three (node-local first level, partner copies, remote
drained in the background); the whole run, or exploratory runs stopped early
with probability 0.5. Each run is ``--hours`` of failure-free training
(6 s steps) valued by a Chinchilla-shaped loss curve (``sim/loss.py``), or,
with ``--losses``, by a recorded one: the losses of the demo's real run
(``bench_schedule_real.py --json``), stretched over the run and smoothed by
the least-squares fit (exponential or power law) that fits them best.

Policies:

* **fixed 500 steps**: torchtitan's default cadence (``Checkpoint.interval =
  500`` steps, torchtitan/config/job_config.py), every save on every level;
* **Young/Daly, one interval**: Daly's interval for the first level's cost
  and the job's mean time between failures (all classes), every save on
  every level (the textbook schedule, the levels treated as one);
* **Young/Daly per level**: ``schedule.YoungDaly`` (each level's interval
  from the failures it is the lowest to survive);
* **ours: Schedule.auto**: ``Schedule.auto(mtbf_hours=...)``: Young/Daly per
  level, the first level under 3.5 % of the training time (``OverheadBound``);
  asked at every step (no look-ahead);
* **ours: convergence=True**: the same with ``convergence=True``: Young/Daly's
  intervals divided by the root of the progress rate estimated from the
  losses (``ProgressValue``, horizon 24 h), COCI's optimum;
* **ConvergenceAware (first try)**: ``OverheadBound(ConvergenceAware(YoungDaly))``,
  intervals scaled by the recent over the mean loss decrease so far;
* **brute-force best**: the best ``FixedSeconds`` intervals per level over a
  grid around Young/Daly's (searched on ``--search-seeds`` other seeds, then
  run on the table's seeds, so the search's luck does not flatter it); the
  best under plain time, and, from the same search, the best under COCI's
  accounting;
* **ProgressValue, best horizon** (exploratory scenarios): ``convergence=True``
  with the ``horizon_hours`` of a grid that does best under COCI's
  accounting on the search seeds (its one parameter, searched like the
  fixed intervals).

Every policy runs on the same seeds (the same failures). Means over
``--seeds`` runs with 95 % confidence intervals (mean ± 1.96 sd / sqrt(n));
the overhead is a share of the failure-free time of the steps reached
(value-weighted: each second weighted by the value of the progress it delays
or discards, ``sim/loss.py``; progress at risk: COCI's accounting, seconds
blocked and restoring plus the value of the progress lost, docs/schedule.md
"Three accountings"); "vs best" divides it by the brute-force best's.

Goal (exploratory scenarios): ``convergence=True`` at least 40 %
below the best Young/Daly row under COCI's accounting.

    python benchmarks/bench_schedule.py            # ~23 minutes on one core
    python benchmarks/bench_schedule.py --quick    # fewer seeds, shorter runs
    python benchmarks/bench_schedule.py --losses benchmarks/results/schedule_real_demo.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from _cli import parser
from _report import goal_line, markdown_table
from bench_progress_bound import fits
from dcp_multilevel.schedule import (
    ConvergenceAware,
    FailureModel,
    Observation,
    OverheadBound,
    Schedule,
    YoungDaly,
    daly_interval,
)
from sim import (
    Estimate,
    EverySteps,
    FixedSeconds,
    Job,
    Summary,
    YoungDalyAhead,
    best_fixed,
    evaluate,
)
from sim import measured as m

GPUS = (1024, 16384)
# The brute-force grid, around Young/Daly's interval per level: the first level's own
# interval matters only below the others' (above, it never fires alone); the store level
# covers 1 % of failures (a flat optimum).
FIRST_FACTORS = (0.5, 0.7, 1.0, 1.4)
FACTORS = (0.5, 0.6, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0)
STORE_FACTORS = (0.5, 1.0, 2.0, 4.0)
# ProgressValue's one parameter, the assumed run length (hours), searched in the
# exploratory scenarios.
HORIZONS = (6.0, 24.0, 72.0, 240.0)
#: The goal: COCI's 40 % below Young/Daly in the exploratory scenarios.
COCI_GOAL = 0.40


def young_daly_intervals(job: Job) -> tuple[float, ...]:
    """``YoungDaly``'s interval per level at the measured costs (seconds)."""
    policy = YoungDalyAhead(job.failures, job.kinds)
    states = job.level_states()
    intervals, _ = policy.intervals(Observation(0, 0.0, tuple(states), job.step_seconds))
    return tuple(intervals[s.index].seconds for s in states)


def grids(job: Job) -> list[list[float]]:
    out = []
    for i, interval in enumerate(young_daly_intervals(job)):
        factors = FACTORS
        if i > 0 and job.levels[i].kind == "store":
            factors = STORE_FACTORS
        elif i == 0 and len(job.levels) > 1:
            factors = FIRST_FACTORS
        out.append([interval * f for f in factors] if math.isfinite(interval) else [math.inf])
    return out


def progress(s: Summary) -> float:
    return s.progress_fraction.mean


def policies(job: Job, search_seeds: range, early: bool) -> list[tuple[str, object, str]]:
    n = len(job.levels)
    every = m.TORCHTITAN_INTERVAL_STEPS
    mtbf = job.failures.mtbf_hours
    one = daly_interval(job.levels[0].cost_seconds, mtbf * 3600.0)
    searched = best_fixed(job, grids(job), search_seeds)
    by_progress = min(searched.tried, key=lambda c: progress(searched.tried[c]))
    yd = young_daly_intervals(job)
    out = [
        (
            f"fixed {every} steps (torchtitan)",
            EverySteps((every,) * n),
            f"{every * job.step_seconds:.0f} s",
        ),
        ("Young/Daly, one interval", FixedSeconds((one,) * n), f"{one:.0f} s"),
        ("Young/Daly per level", YoungDalyAhead(job.failures, job.kinds), show(yd)),
        ("ours: Schedule.auto", Schedule.auto(mtbf_hours=mtbf), "adaptive"),
        (
            "ours: convergence=True",
            Schedule.auto(mtbf_hours=mtbf, convergence=True),
            "adaptive, 24 h",
        ),
        (
            "ConvergenceAware (first try)",
            OverheadBound(ConvergenceAware(YoungDaly(FailureModel(mtbf)))),
            "adaptive",
        ),
        (
            f"brute-force best ({len(searched.tried)} tried)",
            FixedSeconds(searched.best),
            show(searched.best),
        ),
        ("brute-force best, COCI's accounting", FixedSeconds(by_progress), show(by_progress)),
    ]
    if early:
        tried = {
            h: evaluate(
                job, Schedule.auto(mtbf_hours=mtbf, convergence=True, horizon_hours=h), search_seeds
            )
            for h in HORIZONS
        }
        h = min(tried, key=lambda x: progress(tried[x]))
        out.append(
            (
                f"convergence=True, best horizon ({len(HORIZONS)} tried)",
                Schedule.auto(mtbf_hours=mtbf, convergence=True, horizon_hours=h),
                f"adaptive, {h:g} h",
            )
        )
    return out


def show(intervals: tuple[float, ...]) -> str:
    return " / ".join("never" if math.isinf(x) else f"{x:.0f} s" for x in intervals)


def pct(e: Estimate) -> str:
    return f"{100 * e.mean:.2f} ± {100 * e.half_width:.2f}"


def row(name: str, intervals: str, s: Summary) -> list[str]:
    runs = s.runs
    return [
        name,
        intervals,
        pct(s.fraction),
        pct(s.value_fraction),
        pct(s.progress_fraction),
        f"{s.blocked.mean:.0f}",
        f"{s.lost.mean:.0f}",
        f"{s.restore.mean:.0f}",
        f"{sum(len(r.failures) for r in runs) / len(runs):.1f}",
    ]


def run_scenario(gpus: int, levels: str, early: bool, args: argparse.Namespace) -> dict:
    chosen = m.one_level() if levels == "one" else m.three_levels()
    job = m.scenario(gpus, chosen, early_stop=early, hours=args.hours)
    if args.curve is not None:
        job = dataclasses.replace(job, loss=args.curve)
    seeds = range(args.seeds)
    search = range(10_000, 10_000 + args.search_seeds)
    t0 = time.perf_counter()
    rows, raw, summaries = [], [], {}
    for name, policy, intervals in policies(job, search, early):
        s = evaluate(job, policy, seeds)  # type: ignore[arg-type]
        summaries[name] = s
        rows.append(row(name, intervals, s))
        raw.append(
            {
                "policy": name,
                "intervals": intervals,
                "fraction": [s.fraction.mean, s.fraction.half_width],
                "value_fraction": [s.value_fraction.mean, s.value_fraction.half_width],
                "progress_fraction": [s.progress_fraction.mean, s.progress_fraction.half_width],
                "blocked_s": s.blocked.mean,
                "lost_s": s.lost.mean,
                "restore_s": s.restore.mean,
            }
        )
    title = (
        f"### {gpus:,} GPUs (MTBF {job.failures.mtbf_hours:.2f} h), "
        f"{'one level (remote only)' if levels == 'one' else 'three levels'}, "
        f"{'exploratory (stopped early with p = 0.5)' if early else 'whole run'}"
    )
    best = next(s for name, s in summaries.items() if name.startswith("brute-force best ("))
    for r, s in zip(rows, summaries.values(), strict=True):
        r.insert(3, f"{s.fraction.mean / best.fraction.mean:.2f}x")
    headers = (
        "policy | intervals (per level) | overhead % | vs best | value-weighted % | "
        "progress at risk % | blocked s | lost s | restore s | failures"
    )
    text = f"{title}\n\n{markdown_table(headers, rows)}\n"
    goal = None
    if early:
        # The goal compares under COCI's accounting; plain time shows what it costs.
        ours = summaries["ours: convergence=True"]
        yd_name, yd = min(
            ((n, s) for n, s in summaries.items() if n.startswith("Young/Daly")),
            key=lambda item: progress(item[1]),
        )
        below = 1.0 - progress(ours) / progress(yd)
        plain = ours.fraction.mean / yd.fraction.mean - 1.0
        goal = {"below": below, "plain_more": plain, "young_daly": yd_name}
        goal["line"] = goal_line(
            below >= COCI_GOAL,
            f"{gpus:,} GPUs, {levels} level{'s' if levels == 'three' else ''}, exploratory: "
            f"convergence=True >= {100 * COCI_GOAL:.0f} % below the best Young/Daly "
            "(COCI's accounting)",
            f"{pct(ours.progress_fraction)} % vs {pct(yd.progress_fraction)} % ({yd_name}): "
            f"{100 * below:.1f} % below; plain overhead {pct(ours.fraction)} % vs "
            f"{pct(yd.fraction)} % ({100 * plain:+.1f} %)",
        )
        text += f"\n{goal['line']}\n"
    text += f"\n({time.perf_counter() - t0:.0f} s)\n"
    print(text, flush=True)
    return {"gpus": gpus, "levels": levels, "early_stop": early, "rows": raw, "goal": goal}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, default=40, help="runs per policy and scenario; 40")
    p.add_argument(
        "--search-seeds",
        type=int,
        default=24,
        help="runs per grid point of the brute-force search (other seeds); 24",
    )
    p.add_argument(
        "--hours", type=float, default=72.0, help="failure-free length of a run, hours; 72"
    )
    p.add_argument("--quick", action="store_true", help="8 seeds, 4 search seeds, 24 h runs")
    p.add_argument(
        "--losses",
        type=Path,
        default=None,
        help="value progress by the losses of bench_schedule_real.py --json's first auto run "
        "(default: the Chinchilla-shaped curve)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.search_seeds, args.hours = 8, 4, 24.0
    three = m.three_levels()
    print("## Simulated fault-tolerance overhead (benchmarks/sim)\n")
    args.curve = None
    total = round(args.hours * 3600 / m.STEP_SECONDS)
    if args.losses is not None:
        losses = np.asarray(json.loads(args.losses.read_text())["auto"][0]["losses"])
        # The fit that fits best: a recorded curve's best-loss-so-far would count
        # its batches' scatter as progress (docs/schedule.md "Three accountings").
        name, args.curve = fits(losses, total)[0]
        print(
            f"- loss curve: the {len(losses)} losses of {args.losses} ({losses[:10].mean():.4f} "
            f"-> {losses[-10:].mean():.4f}), {name}, stretched over the run; "
            f"coci_bound {args.curve.coci_bound(total):.3f}"
        )
    else:
        print(
            f"- loss curve: Chinchilla-shaped (sim/measured.py); coci_bound "
            f"{m.LOSS.coci_bound(total):.3f}"
        )
    print(
        f"- step {m.STEP_SECONDS} s, {args.hours:g} h failure-free per run, "
        f"{args.seeds} seeds per policy ({args.search_seeds} other seeds per grid point "
        "for the brute-force search)"
    )
    print(
        f"- one level: direct save to the remote blocks {m.DIRECT_SAVE_S} s, restore "
        f"{m.STORE_RESTORE_S} s"
    )
    print(
        "- three levels (cost = blocked s for the first, drain s above; restore s): "
        + "; ".join(f"{lv.kind} {lv.cost_seconds} / {lv.restore_seconds}" for lv in three)
        + " (node level: the remote's scaled by bench_nodeloss's partner ratios)"
    )
    print(
        "- failure classes: "
        + ", ".join(
            f"{c.name} {100 * c.share:.0f} % (survived by {c.survived_by})"
            for c in m.scenario(1024, three).failures.classes
        )
        + "\n"
    )
    results = []
    t0 = time.perf_counter()
    for early in (False, True):
        for levels in ("one", "three"):
            for gpus in GPUS:
                results.append(run_scenario(gpus, levels, early, args))
    print("## Goal: exploratory runs, COCI's accounting\n")
    for r in results:
        if r["goal"] is not None:
            print(r["goal"]["line"])
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
