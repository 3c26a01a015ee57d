"""Async saves: stock ``async_save`` + ``FileSystemWriter`` vs ``MultiLevelWriter``'s pool.

Each variant runs in a fresh process (clean RSS), alternating stock/ours,
``--repeats`` times; the table shows medians over the repeats. In each process:
``torch.set_num_threads(1)``; a state of ``--gb`` GB (fp32 tensors of 8-64 MiB);
``--saves`` iterations of::

    blocked = time of dcp.async_save(state, storage_writer=W, checkpoint_id=<new dir>)
    while the save is in flight: training steps (timed)  # small tensor ops in Python
    future.result(); RSS; one more step; delete the checkpoint (untimed)

A training step is 100 small tensor ops from Python (like a loop launching GPU
kernels) plus an in-place update of one parameter slice, so every checkpoint
differs. Step time without a save in flight is measured before the loop and
between saves. memcpy bandwidth: ``copy_`` of 256 MiB into touched memory,
single-threaded, in the same process.

Figures: blocked time per save (median over saves after the first: the first
includes one-time costs on both sides, reported apart), staging GB/s (state
bytes / blocked time), step time in flight vs idle, RSS after the 3rd and the
last save, peak RSS. Goals (issue 6): blocked >= 3x smaller than stock; staging
>= 50% of memcpy; step slowdown in flight <= 10%; RSS flat (within 5%).

    python benchmarks/bench_async.py --gb 1.5 --saves 10 --repeats 2
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

from _disk import scratch_dir
from _measure import GB, median, rotated
from _report import verdict

VARIANTS = ("stock", "ours", "ours-budget")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(variant: str, gb: float, saves: int, root: Path, budget_gb: float) -> dict:
    """The measurement, in a fresh process: ``saves`` async saves of a ``gb`` GB state."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_multilevel import MultiLevelWriter, StagingConfig

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

    def timed_step(k: int) -> float:
        """One training step: small tensor ops from Python, then update one slice."""
        t0 = time.perf_counter()
        y = x
        for _ in range(50):
            y = y * 1.0001 + 0.0001
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

    writer = None
    if variant != "stock":
        # "ours-budget": a budget below the state's size (two waves, see docs/async.md).
        budget = int(budget_gb * GB) if variant == "ours-budget" else None
        writer = MultiLevelWriter(
            root / "unused", sync_files=True, staging=StagingConfig(budget_bytes=budget)
        )
    idle = [timed_step(k) for k in range(300)]
    blocked, inflight, rss = [], [], []
    k = 0
    for n in range(saves):
        path = root / f"{variant}-{n}"
        w = writer if writer is not None else dcp.FileSystemWriter(path, sync_files=True)
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=w, checkpoint_id=path)
        blocked.append(time.perf_counter() - t0)
        while not fut.done():
            inflight.append(timed_step(k))
            k += 1
        fut.result()
        rss.append(_rss())
        idle += [timed_step(k + j) for j in range(100)]
        k += 100
        shutil.rmtree(path)
    return {
        "variant": variant,
        "state_bytes": total,
        "memcpy_gbps": median(memcpy),
        "blocked": blocked,
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
    rss = r["rss"]
    return {
        "blocked_s": b,
        "first_blocked_s": r["blocked"][0],
        "staging_gbps": r["state_bytes"] / GB / b,
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
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--root", type=Path, default=None, help="checkpoint directory (a temp dir)")
    ap.add_argument(
        "--budget-gb",
        type=float,
        default=0.0,
        help="also run ours with StagingConfig(budget_bytes=this) (0: skip)",
    )
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None, help="write all raw figures here")
    args = ap.parse_args()
    if args.variant:  # the child process
        print(json.dumps(run_variant(args.variant, args.gb, args.saves, args.root, args.budget_gb)))
        return

    variants = list(VARIANTS if args.budget_gb else VARIANTS[:2])
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with scratch_dir(args.root, "bench-async-") as root:
        for rep in range(args.repeats):
            for v in rotated(variants, rep):
                runs[v].append(in_fresh_process(v, args, root))
                print(f"repeat {rep} {v}: done", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    s = {v: [_summary(r) for r in rs] for v, rs in runs.items()}

    def med(v: str, key: str) -> float:
        return median(x[key] for x in s[v])

    rows = [
        ("blocked per save (s)", "blocked_s", "{:.3f}"),
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
    heads = {"stock": "stock FileSystemWriter", "ours": "MultiLevelWriter"}
    heads["ours-budget"] = f"MultiLevelWriter, budget {args.budget_gb:g} GB"
    print("| figure | " + " | ".join(heads[v] for v in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for label, key, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt.format(med(v, key)) for v in variants) + " |")

    ratio = med("stock", "blocked_s") / med("ours", "blocked_s")
    share = med("ours", "staging_gbps") / med("ours", "memcpy_gbps")
    slowdown, growth = med("ours", "slowdown"), med("ours", "rss_growth")
    print()
    for text, ok in [
        (f"blocked {ratio:.1f}x smaller than stock (goal >= 3x)", ratio >= 3),
        (f"staging at {share:.0%} of memcpy (goal >= 50%)", share >= 0.5),
        (f"step slowdown in flight {slowdown:+.1%} (goal <= 10%)", slowdown <= 0.10),
        (f"RSS growth save 3 -> last {growth:+.1%} (goal within 5%)", abs(growth) <= 0.05),
    ]:
        print(f"{verdict(ok)}  {text}")


if __name__ == "__main__":
    main()
