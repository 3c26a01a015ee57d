"""How long ``dcp.async_save`` blocks the training thread: ours against stock's best.

The GPU goal: blocked time per save no more than stock's best staging.
What blocks is per-tensor Python, not bytes, so the state here is the
``thin`` model of ``_gpt.py``: GPT-2-medium's tensors and AdamW state (as
many tensors, same names), tiny sizes. Methods as in ``gpu_check.py``
(``_gpu_bench.Method``): ours (default staging), ours with
``StagingConfig(overlap=True)``, stock's default, and stock's best
(``DefaultStager`` with async staging, plus pinned memory and non-blocking
copies on CUDA; ``DefaultSavePlanner(enable_plan_caching=True)``). Each
method keeps its writer or stager across its saves, as a training run does.

One round saves ``--saves`` times with each method, in rotated order; each
save is timed from the call until ``async_save`` returns. Then the training
thread runs Python-bound steps (small CPU tensor ops, as launching kernels
is) until the save is durable, and at least three: *steal* is the time those
steps took beyond the same steps without a save, the training time the
save's own threads take through the GIL (the "async staging made steps
slower" complaint). Reported: medians and quartiles over all saves but each
method's first (its one-time costs), the ratios to stock's best, the mean
steal, and the full collections of Python's cyclic garbage collector per save
(any thread, from the call until the save settled): a full collection walks
the whole heap holding the GIL (170 ms here), and shows in the steal's tail
and mean, not its median.

    python benchmarks/bench_blocked.py --rounds 5 --saves 8
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from _disk import scratch_dir
from _gpu_bench import Method, Trainer, _settle, _sync
from _measure import PythonSteps, rotated
from _report import markdown_table, print_header
from dcp_multilevel.staging.buffers import iter_tensors

METHODS = ("ours", "ours-overlap", "stock", "stock-best")


def run(
    device: torch.device, root: Path, rounds: int, saves: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[int]]]:
    tr = Trainer("thin", device)
    methods = {name: Method(name, root / name) for name in METHODS}
    blocked: dict[str, list[float]] = {name: [] for name in METHODS}
    steal: dict[str, list[float]] = {name: [] for name in METHODS}
    full_gcs: dict[str, list[int]] = {name: [] for name in METHODS}
    steps = PythonSteps()
    collections = [0]

    def count_full(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            collections[0] += 1

    gc.callbacks.append(count_full)
    try:
        for r in range(rounds):
            steps.baseline()  # the machine's pace now
            for name in rotated(METHODS, r):
                for _ in range(saves):
                    state = tr.state()
                    _sync(device)
                    before = collections[0]
                    t0 = time.perf_counter()
                    fence, fut = methods[name].save(state)
                    blocked[name].append(time.perf_counter() - t0)
                    # At least three steps, until the save is durable.
                    done = [f for f in (fence, fut) if f is not None]
                    steal[name].append(steps.until(lambda d=done: all(f.done() for f in d), 3))
                    _settle(fence, fut)
                    full_gcs[name].append(collections[0] - before)
                shutil.rmtree(root / name, ignore_errors=True)
    finally:
        gc.callbacks.remove(count_full)
        for m in methods.values():
            m.close()
    return tuple({n: xs[1:] for n, xs in d.items()} for d in (blocked, steal, full_gcs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--saves", type=int, default=8, help="saves per method and round")
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint directory (a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write every sample here")
    args = ap.parse_args(argv)
    # One process, no process group: DCP saves as a single rank (and says so, once).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    device = torch.device(args.device)
    with scratch_dir(args.dir, "bench-blocked-") as root:
        print_header(__file__, root)
        tensors = len(iter_tensors(Trainer("thin", torch.device("cpu")).state()))
        blocked, steal, full_gcs = run(device, root, args.rounds, args.saves)
    rows = []
    for name in METHODS:
        row = [name]
        for xs, best in (
            (blocked[name], blocked["stock-best"]),
            (steal[name], steal["stock-best"]),
        ):
            q1, med, q3 = statistics.quantiles(xs, n=4)
            ratio = med / statistics.median(best)
            row += [f"{1e3 * med:.2f}", f"{1e3 * q1:.2f}..{1e3 * q3:.2f}", f"{ratio:.2f}x"]
        row.insert(-1, f"{1e3 * statistics.mean(steal[name]):.2f}")
        row.append(f"{sum(full_gcs[name]) / len(full_gcs[name]):.2f}")
        rows.append(row)
    print(
        f"\n{device.type}: {args.rounds} rounds x {args.saves} saves per method, "
        f"{tensors} tensors (parameters, AdamW moments and steps)\n"
    )
    head = ["method", "blocked ms", "quartiles", "vs stock best"]
    head += ["steal ms", "quartiles", "mean", "vs stock best", "full GCs per save"]
    print(markdown_table(head, rows))
    if args.json:
        out = {"device": str(device), "blocked_s": blocked, "steal_s": steal}
        out["full_gcs"] = full_gcs
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
