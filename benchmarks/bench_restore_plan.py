"""Issue 14: how long planning a restore takes at scale, and how good the plan is.

Pure planning (``restore_plan.plan_restore``), no processes, no files: the
inventories every rank would send. Scenarios, each ``NODES x RANKS``:

- ``replicated``: a node-local first level, replicated state (DDP), every
  rank's one file on its own node, and every node needs every file (a load
  with no loss: ``nodes x ranks x (nodes - 1)`` copies);
- ``partner``: the same after losing node 1 (replaced, empty), with a partner
  level (``replicas=2``) holding each node's files on the next node too.

Per scenario: planning seconds (median of ``--repeat``, spread), the number
of actions, the simulated time to carry the plan out (a byte a time unit,
each rank one transfer at a time, in the plan's order) against a lower bound
(the bytes the neediest node receives, over its ranks; the bytes all copies
keep ranks busy, sender and receiver, over all ranks), and a hash of the plan
(equal hashes: identical plans, to compare two versions of the planner).

    python benchmarks/bench_restore_plan.py [--shapes 16x8,64x8] [--repeat 3]
"""

from __future__ import annotations

import hashlib
import time

from _cli import parser
from _measure import median, spread
from _report import fmt, markdown_table
from dcp_multilevel.restore.plan import Inventory, plan_restore, simulated_time

URLS = ["/l1", "partner:/p"]
SIZE = 1 << 20  # bytes per file, plus the rank: files differ a little, as real ones do


def scenario(kind: str, nodes: int, ranks: int) -> tuple[dict[str, int], list[Inventory]]:
    files = {
        f"data/{n * ranks + r}-0.t.bin": SIZE + n * ranks + r
        for n in range(nodes)
        for r in range(ranks)
    }
    own = {n: [f"data/{n * ranks + r}-0.t.bin" for r in range(ranks)] for n in range(nodes)}
    invs = []
    for n in range(nodes):
        for r in range(ranks):
            rank = n * ranks + r
            if kind == "replicated":
                held = {0: own[n]}
            elif n == 1:  # replaced: an empty disk
                held = {}
            else:  # partner copies of the node before
                held = {0: own[n], 1: sorted(own[n] + own[(n - 1) % nodes])}
            invs.append(Inventory(rank, n, None, files=held))
    return files, invs


def bound(files: dict[str, int], invs: list[Inventory], ranks: int) -> int:
    """A lower bound: the node missing the most bytes receives them over its ranks, and
    every copy keeps two ranks busy (a sender and a receiver) for its bytes."""
    nodes = {inv.node for inv in invs}
    worst, moved = 0, 0
    for n in nodes:
        held = {f for inv in invs if inv.node == n for fs in inv.files.values() for f in fs}
        missing = sum(size for f, size in files.items() if f not in held)
        moved += missing
        worst = max(worst, -(-missing // ranks))
    return max(worst, -(-2 * moved // len(invs)))


def digest(actions) -> str:
    return hashlib.sha256(repr(list(actions)).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--shapes", default="16x8,32x8,64x8", help="NODESxRANKS, comma-separated")
    p.add_argument("--kinds", default="replicated,partner")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        nodes, ranks = (int(x) for x in shape.split("x"))
        for kind in args.kinds.split(","):
            files, invs = scenario(kind, nodes, ranks)
            seconds, plan = [], None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                plan = plan_restore(7, files, invs, URLS)
                seconds.append(time.perf_counter() - t0)
            assert plan is not None and plan.ok, plan.reasons if plan else None
            span, low = simulated_time(plan.actions, files), bound(files, invs, ranks)
            rows.append([f"{nodes} x {ranks}", kind, len(plan.actions),
                         f"{fmt(median(seconds), 3)} ({spread(seconds, 3)})",
                         fmt(span / low, 2), digest(plan.actions)])  # fmt: skip
            print(rows[-1], flush=True)
    print()
    print(markdown_table(["nodes x ranks", "scenario", "actions", "planning s (spread)",
                          "simulated time / bound", "plan hash"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
