"""How much any convergence-aware schedule can gain on a loss curve (the exploratory goal).

Under COCI's accounting (docs/schedule.md "Three accountings") the best interval
at progress rate ``w`` is Young/Daly's divided by ``sqrt(w)``, and no schedule
can cost less than ``mean(sqrt(w))`` times Young/Daly's, to first order
(``LossCurve.coci_bound``). The goal is 40 % below Young/Daly, i.e. a
bound under 0.60. This prints the bound for:

* the simulator's Chinchilla-shaped curve (``sim/measured.py`` ``LOSS``, the
  one ``bench_schedule.py`` uses), over its 72 h of 6 s steps and shorter runs;
* a real loss curve: all-MiniLM-L6-v2 fine-tuned for ``--steps`` steps
  (``_minilm.finetune_states``: real text, AdamW lr 2e-5), stretched over the
  simulated run (the shape, not the step count, is what the bound reads). Its
  per-batch training losses are noisy, and the value counts the best loss so
  far: raw, they make a staircase whose rises look like bursts of progress
  that no schedule could foresee. So the expected curve is fitted by least
  squares, ``a + b * exp(-k s)`` and ``a + b * (s + o) ** -c`` (grids over
  ``k``, ``c`` and ``o``; ``a``, ``b`` solved), and, for comparison, smoothed
  by a moving average of each ``--windows`` steps (the less smoothing, the
  more noise counts as progress).

    python benchmarks/bench_progress_bound.py                  # ~9 min here (the fine-tuning)
    python benchmarks/bench_progress_bound.py --losses old.json  # the losses of an earlier --json
    python benchmarks/bench_progress_bound.py --steps 0        # the Chinchilla rows alone
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from _cli import add_json, args_record, parser
from _report import markdown_table
from sim import Recorded
from sim import measured as m

#: Steps of the simulated runs: bench_schedule.py's 72 h of 6 s steps, and shorter.
RUNS = {"72 h": 43_200, "24 h": 14_400, "12 h": 7_200}
GOAL = 0.60  # 40 % below Young/Daly


def over_run(values: np.ndarray, steps: int) -> Recorded:
    """``values`` (one per recorded step) stretched evenly over a run of ``steps``."""
    return Recorded(tuple(np.linspace(0, steps, len(values))), tuple(values))


def fits(losses: np.ndarray, steps: int) -> list[tuple[str, Recorded]]:
    """Least-squares fits of the expected loss, each stretched over a run of ``steps``
    (labelled with its rms error), best fit first."""
    s = np.arange(1, len(losses) + 1, dtype=np.float64)
    out = []
    shapes = {
        "fit a + b exp(-k s)": [np.exp(-k * s) for k in np.geomspace(1e-4, 1.0, 200)],
        "fit a + b (s + o)^-c": [
            (s + o) ** -c
            for c in np.linspace(0.05, 3.0, 60)
            for o in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400)
        ],
    }
    for how, candidates in shapes.items():
        best: tuple[float, np.ndarray] | None = None
        for x in candidates:
            design = np.stack([np.ones_like(x), x], axis=1)
            (a, b), *_ = np.linalg.lstsq(design, losses, rcond=None)
            fitted = a + b * x
            err = float(np.sum((fitted - losses) ** 2))
            if b > 0 and (best is None or err < best[0]):  # a loss that falls
                best = (err, fitted)
        if best is not None:
            rms = (best[0] / len(losses)) ** 0.5
            out.append((rms, f"{how} (rms {rms:.3f})", over_run(best[1], steps)))
    return [(label, curve) for _, label, curve in sorted(out, key=lambda f: f[0])]


def smoothed(losses: np.ndarray, windows: list[int], steps: int) -> list[tuple[str, Recorded]]:
    """Moving averages of the losses over each of ``windows`` steps, each stretched over
    a run of ``steps``."""
    return [
        (
            f"moving average, {w} steps",
            over_run(np.convolve(losses, np.ones(w) / w, "valid"), steps),
        )
        for w in windows
    ]


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=400, help="MiniLM fine-tuning steps; 400")
    p.add_argument("--windows", default="10,25,50", help="moving-average windows; 10,25,50")
    p.add_argument(
        "--losses",
        type=Path,
        default=None,
        help="read the fine-tuning losses from an earlier run's --json instead",
    )
    add_json(p)
    args = p.parse_args()
    windows = [int(w) for w in args.windows.split(",") if w]
    rows = []
    for run, steps in RUNS.items():
        b = m.LOSS.coci_bound(steps)
        rows.append(["Chinchilla-shaped (bench_schedule.py)", "-", run, f"{b:.3f}", f"{1 - b:.0%}"])
    losses: list[float] = []
    seconds = 0.0
    if args.losses:
        losses = json.loads(args.losses.read_text())["losses"]
    elif args.steps:
        from _minilm import finetune_states

        t0 = time.perf_counter()
        for _ in finetune_states(args.steps, losses=losses):
            pass
        seconds = time.perf_counter() - t0
    if losses:
        name = f"MiniLM fine-tuning, {len(losses)} steps"
        # Stretched over the run, the bound does not depend on the run's length.
        steps = RUNS["72 h"]
        recorded = np.asarray(losses)
        for how, curve in [*fits(recorded, steps), *smoothed(recorded, windows, steps)]:
            b = curve.coci_bound(steps)
            rows.append([name, how, "72 h", f"{b:.3f}", f"{1 - b:.0%}"])
    print("## The least cost of any schedule against Young/Daly, COCI's accounting\n")
    if losses:
        first, last = np.mean(losses[:10]), np.mean(losses[-10:])
        took = f"in {seconds:.0f} s" if seconds else f"read from {args.losses}"
        print(
            f"- MiniLM fine-tuning: {len(losses)} steps {took}, training loss "
            f"{first:.3f} (first 10) -> {last:.3f} (last 10)"
        )
    print(f"- goal: 40 % below Young/Daly, a bound under {GOAL:.2f}\n")
    head = ["curve", "expected curve", "run", "mean(sqrt(w))", "best possible below Y/D"]
    print(markdown_table(head, rows))
    if args.json:
        record = {"args": args_record(args), "losses": losses, "rows": rows}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
