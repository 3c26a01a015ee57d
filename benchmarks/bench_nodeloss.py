"""Levels between nodes: what partner copies and erasure parity cost per save,
and how fast they bring back a lost node, against a remote-only setup.

Four real ranks (spawned processes, gloo; ``tests/_dist.run_ranks``) on one
machine hold the same replicated state: BERT-large shapes with ``--scale`` of
the 24 encoder layers (3 by default: every tensor of the full model but 21
encoder layers; the embeddings and the untied MLM decoder alone are 0.26 GB)
plus AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32, random values with a fixed
seed): 1.23 GB at the default scale. Simulated nodes are directories
(``DCP_ML_NODE`` per rank, ``{node}`` in the level paths); losing a node is
deleting its directory. Configurations, each its own set of levels:

* ``remote-2n``: ``[L1 n{node}/l1, remote]`` on 2 nodes (2 ranks each);
* ``partner-2n``: ``[L1, partner: replicas=2, remote]`` on 2 nodes;
* ``remote-4n``: ``[L1, remote]`` on 4 nodes (1 rank each);
* ``erasure-4n``: ``[L1, erasure: data=2 parity=1, remote]`` on 4 nodes (an
  erasure group and its parity need ``data + parity`` nodes: 2 groups of 2,
  each group's parity on a node of the other group).

Each remote-only configuration is the baseline of the node-local one in the
same topology. The remote is ``throttled:///<dir>`` (``_remotes.py``; in
/dev/shm by default): each simulated node reaches it through a link of its
own, ``--remote-mbps`` (200) MB/s per direction shared by the node's ranks.
Node-to-node transfers (the partner and erasure drains, restores) go over
gloo on loopback, unthrottled: the network between nodes is taken to be far
faster than the link to the remote. L1 and the node-local levels share the
scratch directory (``--root``, the disk; node-local levels hard-link the
first level's files, so they need the same file system). On a machine with
one disk every simulated node writes to it: this VM writes new files at about
400 MB/s, 100 MB/s per node of 4, half of each node's link to the remote,
where real nodes each have their own NVMe; ``--root /dev/shm/...`` gives the
nodes storage faster than their remote link (the nodes' files then live in
memory, beside the ranks'). The node-local levels keep 2 checkpoints, the
remote 1, and L1 every save of a round (no L1 retention: with two ranks per
node it races, each rank deleting the node's same step directory).

The ranks run every configuration in turn, in an order rotated every round
(``--repeat`` rounds): the machine is noisy, so configurations alternate and
the tables show medians with their spread. The saves of a configuration, and
each restore, run in a process group of their own, as a new job would (two
managers in one process group would read each other's drain keys in its c10d
store: ``new_job``). Per configuration and round:

1. **Saves**: ``--saves`` times: nudge every tensor (so saves differ), all
   ranks start ``mgr.save`` together (``CheckpointManager(levels,
   drain_policy="wait")``); *blocked* = the ``save`` call, slowest rank; then
   a training step (``--step-seconds`` of sleep: four ranks share two cores,
   so no rank computes; the drains run meanwhile); then ``mgr.wait()``. Each
   manager's first save carries one-time costs (DCP's plan cache, first use of
   the gloo groups) and is left out of the medians. Per level and save:
   ``DrainResult.bytes_stored`` (new bytes this rank put on the level) and
   ``bytes_sent`` (bytes sent to
   other ranks) summed over ranks, drain seconds of the slowest rank. After
   the last save, the bytes on disk: the node-local level's files that are
   not hard links to L1 (partner copies; erasure parity blocks).
2. **Load, no node lost** (for reference): every file evicted from the page
   cache, a new job's manager on every rank calls ``load_latest`` into zeroed
   tensors; the slowest rank's ``load_latest``. The state is replicated, so
   every rank reads every byte: with a node-local L1 each node lacks the files
   the other nodes wrote, and a load brings them into its L1 first (from the
   node-local level or other nodes' L1 over gloo), or reads them from the
   remote (remote only). The tree is put back as it was after the saves
   (a hard-link snapshot) before:
3. **Restore after losing a node**: node ``--lose-node``'s directory (its L1,
   its node-local part, its spool) is deleted, the rest evicted, and the same
   timed ``load_latest`` (*restore*). With a node-local level, the lost
   node's files come from partner copies or erasure rebuilds over gloo;
   without, from the remote. Every rank checks that what it loaded (in 2 and
   3) is bit-exact.

Then, in this process on one thread (``torch.set_num_threads(1)``), the
coder on ``--code-mb`` MiB of the same state's bytes (split into ``data``
members, 4 MiB chunks, the entries alternating, medians of
``--code-repeat``): ``ErasureCode.encode_chunk`` / ``decode_chunk`` (what the
level's drain and rebuild call) against the library's own
``zfec.Encoder.encode`` / ``zfec.Decoder.decode`` on the same pieces, and
the drain's per-chunk work (encode plus an xxh3 checksum per parity chunk).
GB/s count member bytes per second on one core; ours / zfec is the median
of the per-round ratios (measurements seconds apart: this machine's speed
drifts by 1.5x within a minute).

``--state sharded`` gives each rank its own shard instead of the whole state
(every tensor flattened and cut in 4, rank ``r`` holding piece ``r`` under
``rank<r>.<name>``; the same bytes in all, a quarter per rank): each rank
saves and loads only its own file, so a load with no node lost copies
nothing, and a restore brings only the lost node's files. The restore table
gives the slowest rank's seconds in each phase (plan, bring, read), and
``--profile DIR`` writes a cProfile of each restore per rank.

``--state fsdp`` is the sharded state plus what sharded training also
saves: a value every rank holds, here AdamW's step count per parameter (a
0-dim tensor, as FSDP's optimizer state dicts hold it), which the balanced
planner spreads over the ranks' files. Every rank reads all of them, so
every node needs a few bytes of every other node's file. The configuration
``erasure-4n-whole`` is ``erasure-4n`` with restores that copy such files
whole (``CheckpointManager(restore_whole_files=True)``: the restore as it was
before partial copies), to compare in the same run.

Goals: blocked time per save unchanged by adding the level
(within 10 %, this machine's noise); restore after one node loss at least 3x
faster than from the remote alone; erasure storage exactly (k+m)/k of the
checkpoint plus padding under 1 % of it; encode throughput at least that of
zfec itself on the same bytes (within 5 %).

    python benchmarks/bench_nodeloss.py --json /tmp/nodeloss.json   # ~9 min
    python benchmarks/bench_nodeloss.py --quick                     # tiny state, one round
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

# Measure this checkout's dcp_multilevel whatever is installed; tests/_dist.py runs the ranks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _remotes  # noqa: F401 - registers throttled:// with fsspec (in every rank too)
from _cli import add_results, add_seed, args_record, names, parser, quiet_dcp_warnings
from _data import (
    bert_config,
)
from _disk import scratch_dir
from _measure import GB, rotated
from _nodeloss_jobs import (
    CONFIGS,
    DEFAULT_CONFIGS,
    STATES,
    WORLD,
    measure_coder,
    rank_main,
)
from _nodeloss_report import report, summarize
from _report import REPO, Results, figure, machine_info
from tests._dist import run_ranks

# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--scale",
        type=float,
        default=0.125,
        help="fraction of the 24 BERT layers; 0.125 (3 layers: 1.23 GB with AdamW)",
    )
    p.add_argument(
        "--state",
        choices=STATES,
        default="replicated",
        help="replicated: every rank holds (and loads) the whole state; sharded: "
        "each rank a quarter of every tensor under keys of its own "
        "(rank<r>.<name>), saved and loaded by it alone; fsdp: sharded plus "
        "AdamW's step count per parameter on every rank; replicated",
    )
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"subset of: {', '.join(CONFIGS)}; '' for the coder alone; "
        f"default: {','.join(DEFAULT_CONFIGS)}",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds over the configs; 3")
    p.add_argument(
        "--saves",
        type=int,
        default=3,
        help="saves per config and round (the first is not counted); 3",
    )
    p.add_argument(
        "--step-seconds", type=float, default=2.0, help="training step (sleep) after each save; 2.0"
    )
    p.add_argument("--lose-node", type=int, default=1, help="the node lost before the restore; 1")
    p.add_argument(
        "--remote-mbps",
        type=float,
        default=200.0,
        help="each node's link to the throttled remote, MB/s per direction; 200",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="scratch directory for L1 and the node-local levels (default: a new "
        "temporary directory under bench_out/, removed afterwards)",
    )
    p.add_argument(
        "--remote-dir",
        type=Path,
        default=None,
        help="where the throttled remote keeps its objects (default: a new "
        "directory in /dev/shm if there is one, else under --root)",
    )
    p.add_argument("--code-mb", type=int, default=256, help="MiB coded per coder entry; 256")
    p.add_argument("--code-repeat", type=int, default=9, help="coder measurements (median); 9")
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds for the ranks' whole run (and their collective timeout)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write a cProfile of every restore's load_latest, per rank, into "
        "this directory (<config>-r<round>-restore-rank<r>.prof; pstats reads "
        "them); adds a little time to the restores",
    )
    add_seed(p)
    add_results(p, "nodeloss")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny BERT, one round, 2 saves, 0.3 s steps, 16 MiB coded",
    )
    args = p.parse_args(argv)
    args.configs = names(p, args.configs, list(CONFIGS), "config")
    if args.quick:
        args.repeat, args.saves, args.step_seconds = 1, 2, 0.3
        args.code_mb, args.code_repeat = 16, 3
    if args.repeat < 1 or args.saves < 2 or args.scale <= 0 or args.remote_mbps <= 0:
        p.error("--repeat must be >= 1, --saves >= 2, --scale and --remote-mbps > 0")
    nodes = {CONFIGS[c].nodes for c in args.configs} or {WORLD}
    if not 0 <= args.lose_node < min(nodes):
        p.error(f"--lose-node must name a node of every config (0 to {min(nodes) - 1})")
    erasure = CONFIGS["erasure-4n"].options
    args.code_k, args.code_m = erasure["data"], erasure["parity"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    quiet_dcp_warnings()
    run = Results(__file__)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    cfg = bert_config(args.scale, tiny=args.quick)
    shm = Path("/dev/shm")
    shm_ok = args.remote_dir is None and shm.is_dir() and os.access(shm, os.W_OK)
    with contextlib.ExitStack() as stack:
        (REPO / "bench_out").mkdir(exist_ok=True)
        root = stack.enter_context(
            scratch_dir(args.root, "bench-nodeloss-", parent=REPO / "bench_out")
        )
        info = machine_info(root)
        (root / "jobs").mkdir(exist_ok=True)  # the c10d stores of new_job
        remote_dir = args.remote_dir or root / "remote"
        if shm_ok:
            remote_dir = stack.enter_context(
                scratch_dir(None, "bench-nodeloss-remote-", parent=shm)
            )
        order = [c for r in range(args.repeat) for c in rotated(args.configs, r)]
        print(
            f"{WORLD} ranks, {cfg.num_hidden_layers} BERT layers + AdamW; order: {order}",
            flush=True,
        )
        payload = {
            "root": str(root),
            "remote_dir": str(remote_dir),
            "scale": args.scale,
            "quick": args.quick,
            "seed": args.seed,
            "configs": args.configs,
            "repeat": args.repeat,
            "saves": args.saves,
            "step_seconds": args.step_seconds,
            "lose_node": args.lose_node,
            "remote_mbps": args.remote_mbps,
            "timeout": args.timeout,
            "state": args.state,
            "profile": str(args.profile) if args.profile else None,
        }
        t0 = time.perf_counter()
        per_rank = run_ranks(rank_main, WORLD, payload, timeout=args.timeout) if order else []
        ranks_s = time.perf_counter() - t0
    load_ranks = os.getloadavg()
    records = [r for rank in per_rank for r in rank]

    torch.set_num_threads(1)
    coder = measure_coder(args.code_k, args.code_m, args)
    load_after = os.getloadavg()

    state_bytes = sum(
        s["l1_bytes"]
        for r in records
        for s in r["saves"]
        if r["config"] == args.configs[0] and r["round"] == 0 and s["step"] == 1
    )
    sums = {c: summarize(records, CONFIGS[c], args.lose_node) for c in args.configs}
    body, goals = report(sums, coder, args, state_bytes)
    print()
    print("## Node loss: partner and erasure levels against the remote alone")
    print()
    for k, v in info.items():
        print(f"- {k}: {v}")
    held = (
        f"replicated on {WORLD} ranks"
        if args.state == "replicated"
        else f"sharded over {WORLD} ranks (each a 1/{WORLD} of every tensor, keys of its own)"
        + (
            ", plus AdamW's step count per parameter (0-dim, on every rank)"
            if args.state == "fsdp"
            else ""
        )
    )
    print(
        f"- state: BertForPreTraining shapes, {cfg.num_hidden_layers} of 24 encoder layers, "
        f"+ AdamW exp_avg and exp_avg_sq, fp32, {state_bytes / GB:.3f} GB, {held}"
        + (" (tiny config, --quick)" if args.quick else f" (--scale {args.scale})")
    )
    print(
        f"- remote: throttled, {args.remote_mbps:g} MB/s per node and direction, objects in "
        f"{remote_dir}; L1 and node-local levels in {root}"
    )
    loads = [load_before, load_ranks, load_after]
    total = time.perf_counter() - t_start
    print(
        "- load average (1/5/15 min) before / after the ranks / after the coder: "
        + " | ".join(" / ".join(f"{x:.2f}" for x in la) for la in loads)
        + f"; ranks {ranks_s:.0f} s, total runtime {total:.0f} s"
    )
    print()
    print(body)
    print("### Goals")
    print()
    print("\n".join(goals))
    figures = {}
    for c, sm in sums.items():
        for key in ("blocked", "restore", "load"):
            if getattr(sm, key):
                figures[f"{c}.{key}_s"] = figure(getattr(sm, key), "s")
    figures["state_bytes"] = figure([state_bytes], "B")
    run.write(
        args.results,
        figures=figures,
        alternated=args.configs,
        rounds=args.repeat,
        data={
            "args": args_record(args),
            "load": {"after_ranks": load_ranks},
            "records": records,
            "coder": coder,
        },
    )
    return 0 if all(e == "bit-exact" for s in sums.values() for e in s.exact) else 1


if __name__ == "__main__":
    raise SystemExit(main())
