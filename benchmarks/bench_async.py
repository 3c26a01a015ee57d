"""Async saves: how long ``dcp.async_save`` blocks training, stock DCP against ours.

Variants, each writing with fsync:

* ``stock``: ``FileSystemWriter``, DCP's default staging (a fresh CPU copy per save);
* ``stock-best``: ``FileSystemWriter`` with one ``DefaultStager(StagingOptions(
  use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
  use_non_blocking_copy=False))`` made once and passed to every
  ``async_save(..., async_stager=...)`` (pinning and non-blocking copies need an
  accelerator), and ``DefaultSavePlanner(enable_plan_caching=True)``;
* ``ours``: ``MultiLevelWriter`` (one, reused), default staging (the copy made
  before ``async_save`` returns, into reused buffers), ``BalancedSavePlanner``;
* ``ours-overlap``: the same with ``StagingConfig(overlap=True)`` (the copy made
  behind a staging fence, as stock's best);
* ``ours-budget`` (with ``--budget-gb``): ours with a staging budget below the state.

Each variant runs in a fresh process (clean RSS), the variants in an order
rotated every round, ``--repeats`` rounds; the table shows medians over the
rounds. In each process: ``torch.set_num_threads(1)``; a state of ``--gb`` GB
(fp32 tensors of 8-64 MiB); ``--saves`` iterations of::

    blocked = time of dcp.async_save(state, storage_writer=W, checkpoint_id=<new dir>)
    while the save is in flight: training steps (timed)  # small tensor ops in Python
    future.result(); RSS; more steps; delete the checkpoint (untimed)

A training step is 50 small tensor ops from Python (like a loop launching GPU
kernels), then an in-place update of one parameter slice, so every checkpoint
differs. The update waits for the staging fence where there is one (the copy
must be taken before the weights change): that wait is *fence wait*, and
blocked + fence wait is how long the state was held. Step time without a save
in flight is measured before the loop and between saves. memcpy bandwidth:
``copy_`` of 256 MiB into touched memory, single-threaded, in the same process.

Figures: blocked time per save (median over saves after the first: the first
includes one-time costs on both sides, reported apart), the fence wait,
staging GB/s (state bytes / (blocked + fence wait)), step time in flight vs
idle, RSS after the 3rd and the last save, peak RSS. Goals: blocked >= 3x
smaller than stock's default; staging >= 50% of memcpy; step slowdown in
flight <= 10%; RSS flat (within 5%).

    python benchmarks/bench_async.py --gb 1.5 --saves 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _cli import add_results
from _disk import scratch_dir
from _measure import GB, median, rotated
from _report import Results, figure, verdict

VARIANTS = ("stock", "stock-best", "ours", "ours-overlap", "ours-budget")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(variant: str, gb: float, saves: int, root: Path, budget_gb: float) -> dict:
    """The measurement, in a fresh process: ``saves`` async saves of a ``gb`` GB state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_multilevel import BalancedSavePlanner, MultiLevelWriter, StagingConfig

    torch.set_num_threads(1)
    sizes = [8, 16, 32, 64]
    state: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    while total < gb * GB:
        n = sizes[i % 4] << 18  # fp32 elements: 8-64 MiB
        state[f"layer{i}.weight"] = torch.rand(n)
        total += n * 4
        i += 1
    x = torch.rand(64)
    keys = list(state)

    fence_wait = [0.0]

    def timed_step(k: int, fence=None) -> float:
        """One training step: small tensor ops from Python, then update one slice (once
        ``fence``, the save's staging, is done: the wait is added to ``fence_wait``)."""
        t0 = time.perf_counter()
        y = x
        for _ in range(50):
            y = y * 1.0001 + 0.0001
        if fence is not None and not fence.done():
            t1 = time.perf_counter()
            fence.result()
            fence_wait[0] += time.perf_counter() - t1
        state[keys[k % len(keys)]][:4096].add_(1e-3)
        return time.perf_counter() - t0

    src = torch.rand(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch
    memcpy = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy.append(src.numel() * 4 / GB / (time.perf_counter() - t0))
    del src, dst

    writer = stager = planner = None
    if variant.startswith("ours"):
        # "ours-budget": a budget below the state's size (two waves, see docs/async.md).
        budget = int(budget_gb * GB) if variant == "ours-budget" else None
        staging = StagingConfig(budget_bytes=budget, overlap=variant == "ours-overlap")
        writer = MultiLevelWriter(root / "unused", sync_files=True, staging=staging)
        planner = BalancedSavePlanner()
    if variant == "stock-best":  # made once, reused by every save
        stager = DefaultStager(StagingOptions(False, False, True, False))
        planner = DefaultSavePlanner(enable_plan_caching=True)
    idle = [timed_step(k) for k in range(300)]
    blocked, fenced, inflight, rss = [], [], [], []
    k = 0
    for n in range(saves):
        path = root / f"{variant}-{n}"
        w = writer if writer is not None else dcp.FileSystemWriter(path, sync_files=True)
        kwargs = {"async_stager": stager} if stager is not None else {}
        t0 = time.perf_counter()
        r = dcp.async_save(state, storage_writer=w, checkpoint_id=path, planner=planner, **kwargs)
        blocked.append(time.perf_counter() - t0)
        # A staging fence (async staging) or a plain future (staged before returning).
        fence, fut = getattr(r, "staging_completion", None), getattr(r, "upload_completion", r)
        fence_wait[0] = 0.0
        while not fut.done():
            inflight.append(timed_step(k, fence))
            k += 1
        if fence is not None:
            fence.result()
        fut.result()
        fenced.append(fence_wait[0])
        rss.append(_rss())
        idle += [timed_step(k + j) for j in range(100)]
        k += 100
        shutil.rmtree(path)
    if stager is not None:
        stager.close()
    return {
        "variant": variant,
        "state_bytes": total,
        "memcpy_gbps": median(memcpy),
        "blocked": blocked,
        "fence_wait": fenced,
        "step_idle": median(idle),
        "step_inflight": median(inflight),
        "inflight_steps": len(inflight),
        "rss": rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def in_fresh_process(variant: str, args: argparse.Namespace, root: Path) -> dict:
    """:func:`run_variant` in a new interpreter (clean RSS): this script, ``--variant``."""
    cmd = [sys.executable, __file__, "--variant", variant, "--gb", str(args.gb)]
    cmd += ["--budget-gb", str(args.budget_gb), "--saves", str(args.saves), "--root", str(root)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _summary(r: dict) -> dict:
    later = r["blocked"][1:] or r["blocked"]
    b = median(later)
    wait = median(r["fence_wait"][1:] or r["fence_wait"])
    rss = r["rss"]
    return {
        "blocked_s": b,
        "fence_wait_s": wait,
        "held_s": b + wait,
        "first_blocked_s": r["blocked"][0],
        "staging_gbps": r["state_bytes"] / GB / (b + wait),
        "memcpy_gbps": r["memcpy_gbps"],
        "step_idle_ms": r["step_idle"] * 1e3,
        "step_inflight_ms": r["step_inflight"] * 1e3,
        "slowdown": r["step_inflight"] / r["step_idle"] - 1,
        "rss3_gb": rss[min(2, len(rss) - 1)] / GB,
        "rss_last_gb": rss[-1] / GB,
        "rss_growth": rss[-1] / rss[min(2, len(rss) - 1)] - 1,
        "peak_rss_gb": r["peak_rss"] / GB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", type=Path, default=None, help="checkpoint directory (a temp dir)")
    ap.add_argument(
        "--budget-gb",
        type=float,
        default=0.0,
        help="also run ours with StagingConfig(budget_bytes=this) (0: skip)",
    )
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    add_results(ap, "async")
    args = ap.parse_args()
    if args.variant:  # the child process
        print(json.dumps(run_variant(args.variant, args.gb, args.saves, args.root, args.budget_gb)))
        return
    run = Results(__file__)

    variants = list(VARIANTS if args.budget_gb else VARIANTS[:-1])
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with scratch_dir(args.root, "bench-async-") as root:
        for rep in range(args.repeats):
            for v in rotated(variants, rep):
                runs[v].append(in_fresh_process(v, args, root))
                print(f"repeat {rep} {v}: done", file=sys.stderr)
    s = {v: [_summary(r) for r in rs] for v, rs in runs.items()}

    def med(v: str, key: str) -> float:
        return median(x[key] for x in s[v])

    rows = [
        ("blocked per save (s)", "blocked_s", "{:.4f}"),
        ("fence wait before the state may change (s)", "fence_wait_s", "{:.3f}"),
        ("held: blocked + fence wait (s)", "held_s", "{:.3f}"),
        ("first save blocked (s)", "first_blocked_s", "{:.3f}"),
        ("staging GB/s", "staging_gbps", "{:.2f}"),
        ("memcpy GB/s (same run)", "memcpy_gbps", "{:.2f}"),
        ("step idle (ms)", "step_idle_ms", "{:.3f}"),
        ("step with save in flight (ms)", "step_inflight_ms", "{:.3f}"),
        ("step slowdown in flight", "slowdown", "{:+.1%}"),
        ("RSS after save 3 (GB)", "rss3_gb", "{:.2f}"),
        (f"RSS after save {args.saves} (GB)", "rss_last_gb", "{:.2f}"),
        ("RSS growth 3 -> last", "rss_growth", "{:+.1%}"),
        ("peak RSS (GB)", "peak_rss_gb", "{:.2f}"),
    ]
    state_gb = runs["ours"][0]["state_bytes"] / GB
    print(f"\nstate {state_gb:.2f} GB, {args.saves} saves, {args.repeats} repeats (medians)\n")
    heads = {
        "stock": "stock default",
        "stock-best": "stock best (DefaultStager, reused)",
        "ours": "MultiLevelWriter",
        "ours-overlap": "MultiLevelWriter, overlap=True",
        "ours-budget": f"MultiLevelWriter, budget {args.budget_gb:g} GB",
    }
    print("| figure | " + " | ".join(heads[v] for v in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for label, key, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt.format(med(v, key)) for v in variants) + " |")

    figures = {
        f"{v}.{key}": figure((x[key] for x in s[v]), unit)
        for v in variants
        for key, unit in (
            ("blocked_s", "s"),
            ("fence_wait_s", "s"),
            ("held_s", "s"),
            ("first_blocked_s", "s"),
            ("slowdown", "share"),
            ("rss_growth", "share"),
            ("peak_rss_gb", "GB"),
        )
    }
    figures["state_bytes"] = figure([runs["ours"][0]["state_bytes"]], "B")
    run.write(args.results, figures=figures, alternated=variants, rounds=args.repeats, data=runs)

    ratio = med("stock", "blocked_s") / med("ours", "blocked_s")
    share = med("ours", "staging_gbps") / med("ours", "memcpy_gbps")
    slowdown, growth = med("ours", "slowdown"), med("ours", "rss_growth")
    print()
    for text, ok in [
        (f"blocked {ratio:.1f}x smaller than stock's default (goal >= 3x)", ratio >= 3),
        (f"staging at {share:.0%} of memcpy (goal >= 50%)", share >= 0.5),
        (f"step slowdown in flight {slowdown:+.1%} (goal <= 10%)", slowdown <= 0.10),
        (f"RSS growth save 3 -> last {growth:+.1%} (goal within 5%)", abs(growth) <= 0.05),
    ]:
        print(f"{verdict(ok)}  {text}")


if __name__ == "__main__":
    main()
