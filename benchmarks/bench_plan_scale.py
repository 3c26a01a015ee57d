"""Save planning at 1k..16k ranks: replicated and FSDP-sharded BERT-large + AdamW, plan caching.

Plan only, as part 1 of ``bench_planner.py``: no processes and no I/O. The
local plans of N ranks are built here and handed to the coordinator's
``create_global_plan`` of stock ``DefaultSavePlanner`` and of
``BalancedSavePlanner``, interleaved, medians of ``--repeat``. Timed: the
coordinator's ``create_global_plan`` only (not the ranks' ``create_local_plan``,
which run in parallel, one per rank, and are the same for both planners).

States (``--states``):

- ``replicated``: data parallel, every rank holds the whole BERT-large + AdamW
  state (the local plan of ``bench_planner.py``);
- ``fsdp``: as ``fully_shard`` leaves it: every parameter and its ``exp_avg`` /
  ``exp_avg_sq`` a DTensor sharded on dim 0 over all N ranks (``torch.chunk``
  sizes; a rank past the last row holds an empty shard at offset ``dim 0``,
  as DTensor reports it), the optimizer's ``step`` scalars and ``param_groups``
  plain values on every rank;
- ``hsdp<G>``: the same sharded over groups of G ranks, replicated across the
  N/G groups (rank r holds shard ``r % G``).

The coordinator of a real job unpickles N separate copies of these plans
(``gather_object``): 2.3 MB each here, 36 GB at 16,384 ranks, more than this
machine has. So the plans share their objects: rank r reuses the objects of
copy ``r % --distinct`` (separately unpickled copies) wherever its items equal
that copy's, and only the shards unique to one rank are objects of their own.
Sharing makes the planners' input reads more cache-friendly than in a real job
(stock gains more from it: 5.6 s instead of 6.8 s at 1,024 ranks, one probe); the
"gathered plans" column estimates what the unshared plans would take.

Columns:

- plan s: wall seconds of ``create_global_plan`` on the first save (median;
  the CPU seconds beside it), with ``enable_plan_caching=True`` for both
  planners (the first save also fills DCP's plan cache: a few dict stores);
- max/mean bytes per rank, and the best any planner can do for the state (the
  busiest rank's bytes that only it holds, or the mean);
- peak MB: how far the coordinator's resident memory rises above the
  gathered plans during ``create_global_plan`` (sampled every 5 ms; the
  highest of the runs), the final plan and Metadata included;
- cached ms: the second save's ``create_global_plan`` when no local plan changed
  (DCP's caching protocol: every rank sends ``SavePlan([], usable=False)``);
- gathered plans MB (est.): the N local plans as the coordinator would hold
  them, each unpickled on its own (both planners; and DCP's plan cache keeps
  them between saves).

    python benchmarks/bench_plan_scale.py                        # 1k, 4k; replicated, fsdp
    python benchmarks/bench_plan_scale.py --ranks 16384 --repeat 2
    python benchmarks/bench_plan_scale.py --ranks 4096 --states hsdp64
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pickle
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from _data import bert_adamw_meta_state, bert_config
from _measure import cpu_snapshot, median, other_cpu_fraction, rotated
from _report import command, markdown_table, verdict
from bench_planner import _per_rank, _ratio
from dcp_multilevel import BalancedSavePlanner
from dcp_multilevel.plugin.planner import drop_cached_plans, write_item_nbytes

PLANNERS = {"stock": DefaultSavePlanner, "ours": BalancedSavePlanner}
MB = 1e6


# ------------------------------------------------------------------ the ranks' local plans


def _template() -> tuple[dict, bytes]:
    """The replicated state on the meta device and its local plan, pickled (as gathered)."""
    state = bert_adamw_meta_state(bert_config())
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, True)
    return state, pickle.dumps(planner.create_local_plan())


def _copies(blob: bytes, count: int) -> list[SavePlan]:
    return [pickle.loads(blob) for _ in range(count)]  # noqa: S301 - our own bytes


def replicated_plans(blob: bytes, ranks: int, distinct: int) -> list[SavePlan]:
    """Every rank's plan: copy ``r % distinct`` of the one local plan."""
    copies = _copies(blob, min(distinct, ranks))
    return [copies[r % len(copies)] for r in range(ranks)]


def _shard(rows: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, rows) of shard ``index`` of ``parts`` on dim 0, as DTensor's ``Shard(0)``.

    ``torch.chunk`` sizes; an empty shard reports offset ``rows`` (DTensor's
    ``compute_local_shape_and_global_offset``).
    """
    full = -(-rows // parts)
    start = full * index
    size = max(0, min(full, rows - start))
    return (start, size) if size else (rows, 0)


def _shard_item(w: WriteItem, offset: int, rows: int) -> WriteItem:
    td = w.tensor_data
    assert td is not None
    offsets = torch.Size([offset] + [0] * (len(td.size) - 1))
    sizes = torch.Size([rows, *td.size[1:]])
    return WriteItem(
        index=MetadataIndex(w.index.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=td.properties,
            size=td.size,
        ),
    )


def sharded_plans(blob: bytes, ranks: int, distinct: int, group: int) -> list[SavePlan]:
    """Every rank's plan when tensors are sharded on dim 0 over ``group`` ranks (FSDP: all).

    Rank r holds shard ``r % group``. Items equal on several ranks (scalars,
    bytes, empty shards, a shard's replicas under HSDP) are the objects of copy
    ``r % distinct``; a shard only one rank holds is an object of its own.
    """
    copies = _copies(blob, min(distinct, ranks))
    shared: dict[tuple[int, str, int], WriteItem] = {}
    plans = []
    for r in range(ranks):
        c = r % len(copies)
        copy = copies[c]
        g = r % group
        items = []
        for w in copy.items:
            td = w.tensor_data
            if td is None or not td.size:  # param_groups bytes, AdamW's step scalars
                items.append(w)
                continue
            offset, rows = _shard(td.size[0], group, g)
            if rows and group == ranks:  # this rank's alone
                items.append(_shard_item(w, offset, rows))
                continue
            key = (c, w.index.fqn, offset)
            item = shared.get(key)
            if item is None:
                item = shared[key] = _shard_item(w, offset, rows)
            items.append(item)
        plans.append(SavePlan(items, planner_data=copy.planner_data))
    return plans


def build(state: str, blob: bytes, ranks: int, distinct: int) -> list[SavePlan]:
    """The ranks' local plans of ``state`` (see the module docstring)."""
    if state == "replicated":
        return replicated_plans(blob, ranks, distinct)
    if state == "fsdp":
        return sharded_plans(blob, ranks, distinct, ranks)
    if state.startswith("hsdp"):
        return sharded_plans(blob, ranks, distinct, int(state[4:]))
    raise SystemExit(f"unknown state {state!r}: replicated, fsdp or hsdp<G>")


def best_balance(plans: list[SavePlan]) -> float:
    """The lowest max/mean bytes any planner can reach: items held by one rank stay there."""
    holders: dict[tuple, list[int]] = {}
    nbytes: dict[tuple, int] = {}
    for r, plan in enumerate(plans):
        for w in plan.items:
            key = (w.index.fqn, w.index.offset)
            if key not in nbytes:
                nbytes[key] = write_item_nbytes(w)
                holders[key] = []
            if len(holders[key]) < 2:
                holders[key].append(r)
    owned = [0] * len(plans)
    for key, h in holders.items():
        if len(h) == 1:
            owned[h[0]] += nbytes[key]
    mean = sum(nbytes.values()) / len(plans)
    return max(*owned, mean) / mean if mean else 1.0


def gathered_mb(plans: list[SavePlan]) -> float:
    """Estimated MB of the plans unpickled one by one (first, middle and last rank's, scaled)."""
    sample = sorted({0, len(plans) // 2, len(plans) - 1})
    total = 0
    for r in sample:
        blob = pickle.dumps(plans[r])
        tracemalloc.start()
        plan = pickle.loads(blob)  # noqa: S301 - our own bytes
        total += tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del plan
    return total / len(sample) * len(plans) / MB


# ------------------------------------------------------------------ planning


def _drop_cache(planner: SavePlanner) -> None:
    """Forget DCP's class-level plan cache entries of ``planner``."""
    drop_cached_plans(planner._cached_plans_key)


def _planner(name: str, state: dict) -> SavePlanner:
    planner = PLANNERS[name](enable_plan_caching=True)
    _drop_cache(planner)
    planner.set_up_planner(state, None, True)
    return planner


def _rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Highest resident memory above the start, sampled every ``interval`` s by a thread.

    Before the start, memory that earlier runs freed goes back to the OS
    (``malloc_trim``), so this run's growth shows instead of reusing it.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss() - self.start)

    def __enter__(self) -> RssPeak:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.start = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, _rss() - self.start)
        self._stop.set()
        self._thread.join()


def run_once(name: str, state: dict, plans: list[SavePlan]) -> dict:
    """One first save and one cached second save of planner ``name``: time, balance, memory."""
    planner = _planner(name, state)
    with RssPeak() as rss:
        before = cpu_snapshot()
        t0, c0 = time.perf_counter(), time.process_time()
        planner.create_global_plan(plans)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        others = other_cpu_fraction(before, cpu_snapshot())
    nbytes, _ = _per_rank(planner.global_plan)
    unchanged = [SavePlan([], usable=False)] * len(plans)
    t0 = time.perf_counter()
    planner.create_global_plan(unchanged)
    cached = time.perf_counter() - t0
    # The second save must have reused the first one's plan, not planned again.
    assert planner.global_plan is SavePlanner._cached_global_plan[planner._cached_plans_key]
    _drop_cache(planner)
    return {
        "wall": wall,
        "cpu": cpu,
        "others": others,
        "cached": cached,
        "bytes": nbytes,
        "peak_mb": rss.peak / MB,
    }


def measure(state_name: str, ranks: int, args, state: dict, blob: bytes) -> dict:
    """Every figure of one (state, ranks) row."""
    gc.disable()
    t0 = time.perf_counter()
    plans = build(state_name, blob, ranks, args.distinct)
    # As in bench_planner.py: in DCP these objects age into the oldest generation
    # while gather_object unpickles them, before planning starts.
    gc.freeze()
    gc.enable()
    print(f"  {state_name} x {ranks}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    row: dict = {
        "state": state_name,
        "ranks": ranks,
        "items_x_ranks": sum(len(p.items) for p in plans),
        "best_balance": best_balance(plans),
        "gathered_mb_est": gathered_mb(plans),
    }
    runs: dict[str, list[dict]] = {name: [] for name in PLANNERS}
    for rep in range(args.repeat):  # alternate who goes first: neither always on a warmer heap
        for name in rotated(list(PLANNERS), rep):
            runs[name].append(run_once(name, state, plans))
            print(f"  {name}: {runs[name][-1]['wall']:.2f} s", file=sys.stderr, flush=True)
    for name, rs in runs.items():
        row[name] = {
            "plan_s": median(r["wall"] for r in rs),
            "plan_s_samples": [round(r["wall"], 3) for r in rs],
            "plan_cpu_s": median(r["cpu"] for r in rs),
            "others_cpu_share_max": max(r["others"] for r in rs),
            "cached_s": median(r["cached"] for r in rs),
            "balance": _ratio(rs[0]["bytes"]),
            "peak_mb": max(r["peak_mb"] for r in rs),
        }
    gc.unfreeze()
    del plans
    gc.collect()
    return row


# ------------------------------------------------------------------ report


def table(rows: list[dict]) -> str:
    """One row per (state, ranks): both planners side by side."""
    out = []
    for row in rows:
        s, o = row["stock"], row["ours"]
        out.append(
            [
                row["state"],
                row["ranks"],
                row["items_x_ranks"],
                f"{s['plan_s']:.2f} ({s['plan_cpu_s']:.2f})",
                f"{o['plan_s']:.2f} ({o['plan_cpu_s']:.2f})",
                f"{o['plan_s'] / s['plan_s']:.2f}",
                f"{s['balance']:.3f}",
                f"{o['balance']:.3f}",
                f"{row['best_balance']:.3f}",
                f"{s['peak_mb']:.0f}",
                f"{o['peak_mb']:.0f}",
                f"{s['cached_s'] * 1e3:.2f}",
                f"{o['cached_s'] * 1e3:.2f}",
                f"{row['gathered_mb_est']:.0f}",
                f"{max(s['others_cpu_share_max'], o['others_cpu_share_max']):.0%}",
            ]
        )
    headers = (
        "state | ranks | items x ranks | stock plan s (CPU) | ours plan s (CPU) | ours/stock | "
        "stock max/mean bytes | ours max/mean bytes | best possible | stock peak MB | "
        "ours peak MB | stock cached ms | ours cached ms | gathered plans MB (est.) | "
        "others' CPU, max"
    )
    return markdown_table(headers, out)


def goals(rows: list[dict]) -> list[str]:
    """PASS/MISS per goal of save planning at scale."""
    lines = []
    for state in dict.fromkeys(r["state"] for r in rows):
        rs = [r for r in rows if r["state"] == state]
        worst = max(rs, key=lambda r: r["ours"]["balance"] - r["best_balance"])
        ok = all(r["ours"]["balance"] <= max(1.02, r["best_balance"] + 0.001) for r in rs)
        lines.append(
            f"{state}: max/mean bytes <= 1.02 (or the state's best where that is higher) at every "
            f"size: {verdict(ok)} (ours {worst['ours']['balance']:.3f}, best "
            f"{worst['best_balance']:.3f} at {worst['ranks']} ranks)"
        )
        ratio = max(r["ours"]["plan_s"] / r["stock"]["plan_s"] for r in rs)
        lines.append(
            f"{state}: wall time <= half of stock's at every size: {verdict(ratio <= 0.5)} "
            f"(worst ours/stock {ratio:.2f})"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--states", nargs="+", default=["replicated", "fsdp"])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per planner (median)")
    ap.add_argument("--distinct", type=int, default=256, help="separately unpickled plan copies")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    state, blob = _template()
    rows = [measure(s, n, args, state, blob) for s in args.states for n in args.ranks]
    print(
        f"## Save planning at scale: coordinator's create_global_plan, median of {args.repeat} "
        f"(plans share objects across {args.distinct} copies)\n"
    )
    print(table(rows))
    print("\nGoals (save planning at scale):\n")
    print("\n".join(f"- {line}" for line in goals(rows)))
    if args.json:
        args.json.write_text(json.dumps({"command": command(__file__), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
