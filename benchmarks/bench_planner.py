"""Balanced planner vs stock DCP dedup: balance and planning time, then end to end.

Part 1, plan only (no I/O, no processes): a data-parallel BERT-large
(BertForPreTraining shapes) + AdamW state, identical on every rank, planned
for 2..1024 ranks by the coordinator of stock ``DefaultSavePlanner`` and of
``BalancedSavePlanner``. Tensors live on the meta device, so 1024 "ranks" cost
no memory. Reports max/mean bytes and items per rank, and planning time.

Part 2, end to end: 4 gloo ranks on this machine save the replicated
BERT-large model state with each planner through MultiLevelWriter; reports
per-rank bytes and seconds and wall time, stock vs ours in the same run.

    python benchmarks/bench_planner.py                 # both parts
    python benchmarks/bench_planner.py --max-ranks 64 --skip-e2e   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

sys.path.insert(0, str(Path(__file__).parent))
from _common import BertConfig, bert_pretraining_shapes, markdown_table

from dcp_multilevel import BalancedSavePlanner, MultiLevelWriter


def bert_adamw_state(device: str = "meta", scale: float = 1.0) -> dict:
    """BERT-large parameters plus AdamW state (exp_avg, exp_avg_sq, step) per parameter."""
    cfg = BertConfig(num_hidden_layers=max(1, round(24 * scale)))
    shapes = bert_pretraining_shapes(cfg)
    model = {n: torch.empty(s, device=device) for n, s in shapes.items()}
    optim = {
        n: {
            "step": torch.empty((), device=device),
            "exp_avg": torch.empty(s, device=device),
            "exp_avg_sq": torch.empty(s, device=device),
        }
        for n, s in shapes.items()
    }
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-4}]}}


def _local_plan(planner_cls, state, **kwargs):
    planner = planner_cls(**kwargs)
    planner.set_up_planner(state, None, True)
    return planner, planner.create_local_plan()


def _per_rank(global_plan) -> tuple[list[int], list[int]]:
    nbytes, items = [], []
    for plan in global_plan:
        b = 0
        for w in plan.items:
            if w.tensor_data is not None:
                sizes = w.tensor_data.chunk.sizes
                n = 1
                for s in sizes:
                    n *= s
                b += n * w.tensor_data.properties.dtype.itemsize
            elif w.bytes_io_data is not None:
                b += w.bytes_io_data.nbytes
        nbytes.append(b)
        items.append(len(plan.items))
    return nbytes, items


def _ratio(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def plan_only(world_sizes: list[int], repeat: int) -> str:
    state = bert_adamw_state()
    rows = []
    for n in world_sizes:
        results = {}
        for name, cls in [("stock", DefaultSavePlanner), ("ours", BalancedSavePlanner)]:
            planner, local = _local_plan(cls, state)
            # Data parallel: every rank's local plan is the same, and reaches the
            # coordinator unpickled (DCP's gather_object), one object tree per rank.
            blob = pickle.dumps(local)
            times = []
            for _ in range(repeat):  # median: one run at this scale is mostly noise
                planner, _ = _local_plan(cls, state)
                plans = [pickle.loads(blob) for _ in range(n)]  # noqa: S301 - our own bytes
                t0 = time.perf_counter()
                global_plan, _ = planner.create_global_plan(plans)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            nbytes, items = _per_rank(global_plan)
            results[name] = (_ratio(nbytes), _ratio(items), seconds, sum(items))
        s, o = results["stock"], results["ours"]
        rows.append(
            [
                n,
                f"{s[0]:.3f}",
                f"{o[0]:.3f}",
                f"{s[1]:.2f}",
                f"{o[1]:.2f}",
                f"{s[2]:.3f}",
                f"{o[2]:.3f}",
                s[3],
                o[3],
            ]
        )
        print(f"  planned {n} ranks", file=sys.stderr, flush=True)
    return markdown_table(
        [
            "ranks",
            "stock max/mean bytes",
            "ours max/mean bytes",
            "stock max/mean items",
            "ours max/mean items",
            "stock plan s",
            "ours plan s",
            "stock items",
            "ours items",
        ],
        rows,
    )


# ------------------------------------------------------------------ end to end


def _e2e_rank(rank: int, world: int, root: str, scale: float) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = bert_pretraining_shapes(BertConfig(num_hidden_layers=max(1, round(24 * scale))))
    state = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    out: dict = {}
    # Alternate the order and start each save with the disk flushed: otherwise the
    # second save pays for the first one's dirty-page writeback.
    for rep in range(2):
        order = ["stock", "ours"] if rep % 2 == 0 else ["ours", "stock"]
        for name in order:
            planner = DefaultSavePlanner() if name == "stock" else BalancedSavePlanner()
            path = Path(root) / f"{name}-{rep}"
            os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=MultiLevelWriter(path), planner=planner)
            rank_seconds = time.perf_counter() - t0
            dist.barrier()
            wall = time.perf_counter() - t0
            best = out.get(name)
            if best is None or wall < best["wall"]:
                out[name] = {"seconds": rank_seconds, "wall": wall, "path": str(path)}
    return out


def end_to_end(world: int, scale: float) -> str:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from _dist import run_ranks

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_ROOT")) as root:
        results = run_ranks(_e2e_rank, world, root, scale, timeout=1800)
        rows = []
        for name in ("stock", "ours"):
            manifest = json.loads((Path(results[0][name]["path"]) / "manifest.json").read_text())
            per_rank = [0] * world
            for f, size in manifest["files"].items():
                per_rank[int(f.split("/")[1].split("-")[0])] += size
            secs = [r[name]["seconds"] for r in results]
            wall = max(r[name]["wall"] for r in results)
            rows.append(
                [
                    name,
                    " / ".join(f"{b / 1e6:.0f}" for b in per_rank),
                    f"{_ratio(per_rank):.3f}",
                    " / ".join(f"{s:.2f}" for s in secs),
                    f"{wall:.2f}",
                ]
            )
    return markdown_table(
        ["planner", "MB per rank", "max/mean bytes", "dcp.save s per rank", "wall s"], rows
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-ranks", type=int, default=1024)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="plan-only runs per size (median)")
    ap.add_argument("--e2e-ranks", type=int, default=4)
    ap.add_argument("--e2e-scale", type=float, default=1.0, help="fraction of BERT-large layers")
    args = ap.parse_args()

    sizes = [2**k for k in range(1, 11) if 2**k <= args.max_ranks]
    print(
        "## Plan only: BERT-large + AdamW, data parallel (coordinator's create_global_plan, "
        f"median of {args.repeat})\n"
    )
    print(plan_only(sizes, args.repeat))
    if not args.skip_e2e:
        print(
            f"\n## End to end: {args.e2e_ranks} gloo ranks, replicated BERT-large model state "
            "(best of 2, alternating order, disk flushed before each save)\n"
        )
        print(end_to_end(args.e2e_ranks, args.e2e_scale))


if __name__ == "__main__":
    main()
