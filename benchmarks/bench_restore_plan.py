"""How long planning a restore takes at scale, and how good the plan is.

Pure planning (``restore.plan.plan_restore``), no processes, no files: the
inventories every rank would send, for ``NODES x RANKS`` (one file per rank,
1 MiB each) and these layouts:

- state: ``replicated`` (data parallel: every rank reads every file, so with
  a node-local first level every node needs every other node's files, loss
  or not) or ``sharded`` (FSDP-like: each rank reads its own file);
- level that survives a node: ``partner`` (``replicas=2``: each node's files
  also on the next node) or ``erasure`` (RS(4+2) groups of nodes);
- ``lost``: the nodes replaced by empty ones: one, or 1 % of them.

Planners, alternating in one run: ``ring`` (today's: files every node of
many needs travel around a ring, ``levels/restore_plan.py``) and ``copies`` (the
point-to-point planner the rings replaced, ``ring_nodes`` above the node count;
kept as the reference, run up to ``--copies-max-nodes``). Per row: planning
seconds (median of ``--repeat``, spread), actions listed, and up to
``--simulate-max-nodes`` the bytes the neediest node receives and the
simulated time to carry the plan out (a byte a time unit, each rank one
transfer at a time, in the plan's order) over a lower bound (the neediest
node's bytes over its ranks; twice all bytes moved over all ranks).

    python benchmarks/bench_restore_plan.py                         # the scale table
    python benchmarks/bench_restore_plan.py --nodes 16,64 --repeat 3   # quick look
"""

from __future__ import annotations

import json
import time

from _cli import add_json, parser
from _measure import median, spread
from _report import command, fmt, markdown_table
from dcp_multilevel.levels.erasure import ErasureRebuilder, group_layout
from dcp_multilevel.levels.restore_actions import Copy, Inventory, Rebuild
from dcp_multilevel.levels.restore_plan import expand_rings, plan_restore, simulated_time

URLS = ["/l1", "partner:/p", "erasure:/e"]
SIZE = 1 << 20  # bytes per file, plus the rank: files differ a little, as real ones do
DATA, PARITY = 4, 2


def lost_nodes(nodes: int, share: str) -> set[int]:
    """One node, or 1 % of them, spread out (a partner's pair is never lost together)."""
    count = 1 if share == "1" else max(1, nodes // 100)
    return {1 + i * (nodes // count) for i in range(count)}


def scenario(
    state: str, level: str, nodes: int, ranks: int, lost: set[int]
) -> tuple[dict[str, int], list[Inventory]]:
    files = {f"data/{r}-0.t.bin": SIZE + r for r in range(nodes * ranks)}
    own = {n: [f"data/{n * ranks + r}-0.t.bin" for r in range(ranks)] for n in range(nodes)}
    descs: dict[str, dict] = {}
    if level == "erasure":
        for g, (members, keepers) in enumerate(group_layout(list(range(nodes)), DATA, PARITY)):
            descs[str(g)] = {
                "group": str(g),
                "data": len(members),
                "parity": PARITY,
                "chunk": 1 << 16,
                "stripe": 1 << 17,
                "parity_nodes": keepers,
                "members": [{"node": n, "files": [[f, files[f]] for f in own[n]]} for n in members],
            }
    of_node: dict[int, tuple[list, dict, dict]] = {}
    for g, d in descs.items():
        for n in [m["node"] for m in d["members"]] + d["parity_nodes"]:
            of_node.setdefault(n, ([], {}, {}))[1][g] = d
        for j, n in enumerate(d["parity_nodes"]):
            of_node[n][0].append([g, d["data"] + j])
    invs = []
    for n in range(nodes):
        for r in range(ranks):
            rank = n * ranks + r
            needs = None if state == "replicated" else [own[n][r]]
            if n in lost:
                invs.append(Inventory(rank, n, needs))
            elif level == "partner":
                held = {0: own[n], 1: sorted(own[n] + own[(n - 1) % nodes])}
                invs.append(Inventory(rank, n, needs, files=held))
            else:
                parity, mine, _ = of_node.get(n, ([], {}, {}))
                invs.append(
                    Inventory(
                        rank,
                        n,
                        needs,
                        files={0: own[n], 2: own[n]},
                        parity={2: parity},
                        groups={2: mine},
                        placement=list(range(nodes)),
                    )
                )
    return files, invs


def received(actions, files: dict[str, int], node_of: dict[int, int]) -> int:
    """Bytes the neediest node receives."""
    got: dict[int, int] = {}
    for a in actions:
        if isinstance(a, Copy):
            got[node_of[a.dst]] = got.get(node_of[a.dst], 0) + files[a.file]
        elif isinstance(a, Rebuild):
            got[node_of[a.dst]] = got.get(node_of[a.dst], 0) + sum(files[f] for f in a.brings)
    return max(got.values(), default=0)


def bound(actions, files: dict[str, int], node_of: dict[int, int], ranks: int) -> int:
    """A lower bound: the neediest node receives its bytes over its ranks, and every
    byte moved keeps two ranks busy (a sender and a receiver)."""
    moved = sum(files[a.file] for a in actions if isinstance(a, Copy))
    return max(-(-received(actions, files, node_of) // ranks), -(-2 * moved // len(node_of)), 1)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--nodes", default="16,64,250,1000,2000", help="node counts, comma-separated")
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument(
        "--layouts", default="replicated/partner,sharded/partner,replicated/erasure,sharded/erasure"
    )
    p.add_argument("--lost", default="1,1%", help="one node, and/or 1 %% of the nodes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--copies-max-nodes", type=int, default=64)
    p.add_argument("--simulate-max-nodes", type=int, default=64)
    add_json(p)
    args = p.parse_args(argv)
    records = []
    rebuilders = {2: ErasureRebuilder()}
    rows = []
    for nodes in (int(x) for x in args.nodes.split(",")):
        for layout in args.layouts.split(","):
            state, level = layout.split("/")
            for share in args.lost.split(","):
                lost = lost_nodes(nodes, share)
                files, invs = scenario(state, level, nodes, args.ranks, lost)
                node_of = {inv.rank: inv.node for inv in invs}
                planners = {"ring": None}
                if nodes <= args.copies_max_nodes:
                    planners["copies"] = nodes + 1
                seconds: dict[str, list[float]] = {k: [] for k in planners}
                plans = {}
                for _ in range(args.repeat):  # alternating
                    for name, ring_nodes in planners.items():
                        t0 = time.perf_counter()
                        plans[name] = plan_restore(
                            7, files, invs, URLS, rebuilders=rebuilders, ring_nodes=ring_nodes
                        )
                        seconds[name].append(time.perf_counter() - t0)
                        assert plans[name].ok, plans[name].reasons
                for name, plan in plans.items():
                    quality = ["", ""]
                    if nodes <= args.simulate_max_nodes:
                        flat = expand_rings(plan.actions)
                        span = simulated_time(flat, files) / bound(flat, files, node_of, args.ranks)
                        quality = [fmt(received(flat, files, node_of) / 2**20, 1), fmt(span, 2)]
                    records.append(
                        {
                            "nodes": nodes,
                            "ranks": args.ranks,
                            "layout": layout,
                            "lost": share,
                            "planner": name,
                            "seconds": seconds[name],
                            "actions": len(plan.actions),
                            "simulated_over_bound": quality[1] or None,
                        }
                    )
                    rows.append(
                        [
                            f"{nodes} x {args.ranks}",
                            layout,
                            share,
                            name,
                            f"{fmt(median(seconds[name]), 3)} ({spread(seconds[name], 3)})",
                            len(plan.actions),
                            *quality,
                        ]
                    )
                    print(rows[-1], flush=True)
    print()
    print(
        markdown_table(
            [
                "nodes x ranks",
                "state/level",
                "lost",
                "planner",
                "planning s (spread)",
                "actions",
                "neediest node MiB",
                "simulated / bound",
            ],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"command": command(__file__), "rows": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
