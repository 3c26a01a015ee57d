"""A real training run paced by a schedule: is blocked time kept under its bound?

The real-run goal: the demo model (``examples/train_demo.py``: a
~650K-parameter MLP, DDP on gloo, AdamW) trained on 2 spawned ranks for
``--seconds`` of wall time, ``mgr.step(state, step=s, loss=l)`` after every
step, with two levels (the first on local disk, a second local directory
standing in for a store level). Schedules, alternating across ``--repeat``
rounds:

* ``auto``: ``Schedule.auto(mtbf_hours=--mtbf-hours, overhead=--overhead)``:
  Young/Daly per level, convergence-aware, the first level kept under
  ``--overhead`` of the training time (CheckFreq). The default MTBF is tiny on
  purpose, so that Young/Daly alone would save more often than the bound allows;
* ``every-10``: ``FixedInterval`` with the first level's ``every=10`` (a fixed
  cadence, as torchtitan's ``interval``).

Reported per schedule (medians of the rounds, spread): saves, seconds blocked
in saves (what ``mgr.step`` spent saving), wall seconds, the blocked fraction,
and, for ``auto``, which rules fired. Goal: the ``auto`` blocked fraction at
most the bound. ``--json`` keeps every run's losses too (the mean over the
ranks, per step): ``bench_schedule.py --losses`` values progress by them.

    python benchmarks/bench_schedule_real.py                  # 3 rounds of 40 s each
    python benchmarks/bench_schedule_real.py --seconds 10 --repeat 1   # quick
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _cli import add_json, add_root, parser
from _measure import median, rounds, spread
from _report import REPO, goal_line, markdown_table, print_header
from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.schedule import FixedInterval, Schedule

sys.path.insert(0, str(REPO / "examples"))
demo = importlib.import_module("train_demo")  # the demo's model, data and step

SCHEDULES = ("auto", "every-10")


def _rank(rank: int, world: int, store_path: str, root: str, name: str, args: dict, out: str):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        model, optim = demo.build(0, 1e-3)
        if name == "auto":
            schedule = Schedule.auto(mtbf_hours=args["mtbf_hours"], overhead=args["overhead"])
            first = Level(f"{root}/l1", keep=2)
        else:
            schedule = FixedInterval()
            first = Level(f"{root}/l1", keep=2, every=10)
        records: list[dict] = []
        mgr = CheckpointManager(
            [first, Level(f"{root}/remote", keep=2, every=10)],
            schedule=schedule,
            on_metrics=records.append,
        )
        blocked = 0.0
        saves = 0
        losses: list[float] = []
        start = time.perf_counter()
        step = 0
        while True:
            loss = demo.train_step(model, optim, step)
            losses.append(float(f"{loss:.7g}"))
            t0 = time.perf_counter()
            metrics = mgr.step(
                {"model": model.module.state_dict(), "optim": optim.state_dict()},
                step=step,
                loss=loss,
            )
            if metrics is not None:
                saves += 1
                blocked += time.perf_counter() - t0
            step += 1
            # Every rank stops at the same step: rank 0's clock decides, all-reduced.
            done = torch.tensor([time.perf_counter() - start >= args["seconds"]], dtype=torch.int)
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
        wall = time.perf_counter() - start
        mgr.close()
        rules = Counter(r["policy"] for r in records if r["kind"] == "decision")
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "saves": saves,
                        "blocked": blocked,
                        "wall": wall,
                        "steps": step,
                        "rules": dict(rules),
                        "losses": losses,
                    }
                )
            )
    except BaseException:  # noqa: BLE001 - any failure must end this rank with a code
        traceback.print_exc()
        os._exit(1)  # the parent's spawn reports it
    dist.destroy_process_group()
    # Leave without tearing DDP down: destroying its Reducer joins gloo's worker,
    # which can wait for the GIL this thread holds (a hang seen here, in torch).
    os._exit(0)


def run_once(name: str, args, scratch: Path) -> dict:
    root = scratch / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = root / "result.json"
    with tempfile.TemporaryDirectory() as tmp:
        settings = {
            "mtbf_hours": args.mtbf_hours,
            "overhead": args.overhead,
            "seconds": args.seconds,
        }
        mp.spawn(_rank, args=(2, f"{tmp}/store", str(root), name, settings, str(out)), nprocs=2)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_root(p, "scratch directory")
    add_json(p)
    p.add_argument("--seconds", type=float, default=40.0, help="training wall time per run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--mtbf-hours", type=float, default=0.001)
    p.add_argument("--overhead", type=float, default=0.035)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print_header("bench_schedule_real", args.root)
    samples: dict[str, list[dict]] = {name: [] for name in SCHEDULES}
    load_before = os.getloadavg()
    for _, name in rounds(SCHEDULES, args.repeat):
        samples[name].append(run_once(name, args, args.root / "schedule_real"))
    load_after = os.getloadavg()
    rows = []
    for name in SCHEDULES:
        runs = samples[name]
        fractions = [r["blocked"] / r["wall"] for r in runs]
        rules = Counter()
        for r in runs:
            rules.update(r["rules"])
        rows.append(
            [
                name,
                f"{median([r['saves'] for r in runs]):.0f}",
                f"{median([r['steps'] for r in runs]):.0f}",
                f"{median([r['blocked'] for r in runs]):.2f}",
                f"{median([r['wall'] for r in runs]):.1f}",
                f"{100 * median(fractions):.2f} %",
                spread([100 * f for f in fractions]),
                ", ".join(f"{k}: {v}" for k, v in sorted(rules.items())),
            ]
        )
    print(f"\n### 2 ranks, demo MLP, {args.seconds:.0f} s per run, {args.repeat} rounds\n")
    print(
        markdown_table(
            ["schedule", "saves", "steps", "blocked s", "wall s", "blocked", "spread (%)", "rules"],
            rows,
        )
    )
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    auto = median([r["blocked"] / r["wall"] for r in samples["auto"]])
    print(
        goal_line(
            auto <= args.overhead,
            "auto keeps blocked time under its bound",
            f"{100 * auto:.2f} % vs {100 * args.overhead:.1f} %",
        )
    )
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
