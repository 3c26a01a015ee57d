"""First-level deltas under a partner level, against full checkpoints.

4 ranks on 2 simulated nodes (``DCP_ML_NODE``, a directory per node), the
state replicated on every rank (as with DDP): the real all-MiniLM-L6-v2
weights fine-tuned for real (``_minilm.py``), fp32 or bf16, a save every
step, ``--saves`` saves per round. Two configurations alternate in every
round, each a new job:

- **full**: first level with ``codec="bytegroup"``, every save whole;
- **delta**: the same with ``keyframe_every=--saves`` (the first save of
  the round whole, the others deltas against it);

each with a partner level (``replicas=2``, every save) on the nodes' own
directories. Per save: the first level's bytes, the bytes sent to partners
(every rank's ``bytes_sent``), ``save()`` seconds (blocked; the copy runs in
the background) and the copy's seconds. Then node 1 is lost (its directory
deleted; the survivors' files evicted from the page cache) and a new job's
``load_latest`` restores the newest step: seconds (the slowest rank), bytes
brought onto the replaced node, bit-exact or not. A delta's restore brings
its keyframe as well.

    python benchmarks/bench_nodeloss_delta.py [--repeat 3] [--saves 4] [--dtype fp32,bf16] \
        [--copies 1]
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from _cli import names, parser, quiet_dcp_warnings
from _disk import evict_tree, remove_tree, scratch_dir, tree_nbytes
from _measure import median, rounds, spread
from _minilm import finetune_states
from _nodeloss_jobs import WORLD, load_phases, new_job
from _report import REPO, fmt, machine_info, markdown_table
from dcp_multilevel import CheckpointManager, Level
from tests._dist import run_ranks

CONFIGS = ("full", "delta")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PER_NODE = 2
LOST = 1


def levels_for(base: Path, config: str, saves: int) -> list[Level]:
    deltas = {"keyframe_every": saves} if config == "delta" else {}
    return [
        Level(f"{base}/n{{node}}/l1", keep=saves, codec="bytegroup", **deltas),
        Level(f"partner:{base}/n{{node}}/partner", keep=2, replicas=2),
    ]


def run_round(
    rank: int, config: str, rep: int, dtype: str, states: list[dict], args: dict
) -> dict[str, Any]:
    """One configuration, one round, on this rank: the saves, then the restore."""
    import torch.distributed as dist

    os.environ["DCP_ML_NODE"] = str(rank // PER_NODE)
    name = f"{config}-{dtype}-r{rep}"
    base = Path(args["root"]) / name
    levels = levels_for(base, config, len(states))
    new_job(rank, f"{name}-saves", args)
    mgr = CheckpointManager(levels, drain_policy="wait")
    saves = []
    for step, state in enumerate(states, 1):
        dist.barrier()
        t0 = time.perf_counter()
        metrics = mgr.save(state, step=step)
        call = time.perf_counter() - t0
        mgr.wait()
        (copy,) = [r for r in mgr.drain_results if r.step == step and r.committed]
        sent = copy.details.get("bytes_sent", 0)
        saves.append(
            {
                "step": step,
                "save_s": call,
                "l1_bytes": metrics.bytes_written,
                "sent": sent,
                "copy_s": copy.seconds,
            }
        )
    mgr.close()
    dist.barrier()
    if rank == 0:
        remove_tree(base / f"n{LOST}")  # the node is lost with its disk
        evict_tree(base)
    dist.barrier()
    new_job(rank, f"{name}-restore", args)
    records: list[dict[str, Any]] = []
    mgr = CheckpointManager(levels, on_metrics=records.append)
    dest = {k: torch.zeros_like(v) for k, v in states[-1].items()}
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.load_latest(dest)
    load_s = time.perf_counter() - t0
    mgr.close()  # the copies the lost node held are made again: not timed
    exact = step == len(states) and all(
        torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8)) for k, v in states[-1].items()
    )
    report = mgr.last_restore
    # Everything on the replaced node's first level came with the restore.
    brought = tree_nbytes(base / f"n{LOST}" / "l1")[0] if rank == LOST * PER_NODE else 0
    dist.barrier()
    if rank == 0:
        remove_tree(base)
    return {
        "config": config,
        "dtype": dtype,
        "round": rep,
        "rank": rank,
        "saves": saves,
        "load_s": load_s,
        "restore_s": report.seconds if report else 0.0,
        "brought": brought,
        "phases": load_phases(records),
        # Files brought onto the replaced node (its ranks report the same count).
        "received": sum(report.received.values()) if report and brought else 0,
        "exact": exact,
    }


def rank_main(rank: int, world: int, args: dict) -> list[dict[str, Any]]:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_dcp_warnings()
    out = []
    for dtype in args["dtypes"]:
        # --copies: the weights several times over under other keys (a bigger state
        # whose every copy changes as the real fine-tuning changed it).
        states = [
            {
                f"{c}.{k}": v.to(DTYPES[dtype])
                for c in range(args["copies"])
                for k, v in load_file(path).items()
            }
            for path in args["states"]
        ]
        for rep, config in rounds(list(CONFIGS), args["repeat"]):
            out.append(run_round(rank, config, rep, dtype, states, args))
    return out


def per_save(records: list[dict], key: str, over_ranks: Any) -> list[float]:
    """Per round and save after the first (the deltas, in the delta configuration):
    ``over_ranks`` (sum, max) of every rank's ``key``, for one configuration's records."""
    saves = len(records[0]["saves"])
    return [
        over_ranks(r["saves"][i][key] for r in records if r["round"] == n)
        for n in sorted({r["round"] for r in records})
        for i in range(1, saves)
    ]


def summarize(records: list[dict], dtype: str) -> list[list[object]]:
    rows = []
    full_bytes = None
    for config in CONFIGS:
        mine = [r for r in records if r["config"] == config and r["dtype"] == dtype]
        rounds_ = sorted({r["round"] for r in mine})
        l1, sent = per_save(mine, "l1_bytes", sum), per_save(mine, "sent", sum)
        save_s, copy_s = per_save(mine, "save_s", max), per_save(mine, "copy_s", max)
        load_s = [max(r["load_s"] for r in mine if r["round"] == n) for n in rounds_]
        slowest = [
            max((r for r in mine if r["round"] == n), key=lambda r: r["load_s"]) for n in rounds_
        ]
        phases = "/".join(
            fmt(median(r["phases"].get(k, 0.0) for r in slowest), 2)
            for k in ("plan", "bring", "read")
        )
        got = [sum(r["received"] for r in mine if r["round"] == n) for n in rounds_]
        brought = [sum(r["brought"] for r in mine if r["round"] == n) for n in rounds_]
        exact = all(r["exact"] for r in mine)
        if full_bytes is None:
            full_bytes = median(l1)
        rows.append(
            [
                config,
                f"{median(l1) / 1e6:.1f}",
                fmt(median(l1) / full_bytes),
                f"{median(sent) / 1e6:.1f}",
                f"{fmt(median(save_s), 3)} ({spread(save_s, 3)})",
                f"{fmt(median(copy_s), 3)} ({spread(copy_s, 3)})",
                f"{fmt(median(load_s), 2)} ({spread(load_s, 2)})",
                phases,
                f"{median(got):.0f} / {median(brought) / 1e6:.1f}",
                "bit-exact" if exact else "FAILED",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=3, help="rounds over the configurations; 3")
    p.add_argument("--saves", type=int, default=4, help="saves per round (a chain); 4")
    p.add_argument("--dtype", default="fp32,bf16", help="fp32, bf16 or both (default)")
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="scratch directory (default: bench_out/, on the disk)",
    )
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="the weights this many times over, under other keys (a bigger state); 1",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    dtypes = names(p, args.dtype, list(DTYPES), "dtype")
    quiet_dcp_warnings()
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        (REPO / "bench_out").mkdir(exist_ok=True)
        root = stack.enter_context(
            scratch_dir(args.root, "bench-nodeloss-delta-", parent=REPO / "bench_out")
        )
        info = machine_info(root)
        (root / "jobs").mkdir(exist_ok=True)
        paths = []
        for i, state in enumerate(finetune_states(args.saves - 1)):
            path = root / f"state-{i}.safetensors"
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
            paths.append(str(path))
        payload = {
            "root": str(root),
            "states": paths,
            "dtypes": dtypes,
            "repeat": args.repeat,
            "copies": args.copies,
            "timeout": args.timeout,
        }
        per_rank = run_ranks(rank_main, WORLD, payload, timeout=args.timeout)
        shutil.rmtree(root / "jobs", ignore_errors=True)
    records = [r for rank in per_rank for r in rank]
    print()
    print("## First-level deltas under a partner level")
    print()
    for k, v in info.items():
        print(f"- {k}: {v}")
    print(
        f"- {WORLD} ranks on 2 nodes, MiniLM fine-tuned for real, a save every step, "
        f"{args.saves} saves per round (delta: keyframe_every={args.saves}), "
        f"the weights {args.copies} time(s) over, "
        f"{args.repeat} rounds alternating; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; {time.perf_counter() - t_start:.0f} s"
    )
    headers = [
        "config",
        "L1 MB per save",
        "/ full",
        "MB sent to partners per save",
        "save() s (spread)",
        "copy s (spread)",
        "restore after losing node 1 s",
        "of it: plan / bring / read s",
        "files / MB brought to node 1",
        "restored",
    ]
    for dtype in dtypes:
        print()
        print(f"### {dtype} (saves 2..{args.saves} of each round; the restore: slowest rank)")
        print()
        print(markdown_table(headers, summarize(records, dtype)))
    return 0 if all(r["exact"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
