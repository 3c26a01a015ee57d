"""What the load's collectives send and receive per rank, at scale.

No processes: for ``R`` ranks on ``N = R / n`` nodes (``n`` ranks each), every
rank's inputs are built as a load takes them, encoded as the collective
encodes them, and counted; the pure parts are timed. One data file per rank
(``F = R``), names as a save writes them. Layouts, ``STATE/LEVEL``:

- state ``replicated``: a balanced save (each rank's file holds 1/R of the
  items) loaded whole by every rank: every rank needs every file;
- state ``sharded``: FSDP-like, each rank reads its own file and, from
  ``--spread`` files, a replicated value another rank stored (a few bytes:
  byte ranges);
- level ``partner``: a node-local first level and a partner level (each node
  holds its files and the node before's);
- level ``erasure``: a node-local first level and an erasure level (data=4,
  parity=2: each node holds its group's description and, for 2 groups, a
  parity block and their descriptions, one checksum per 4 MiB chunk).

Rows, one per layout and ``R``:

- inventories, before: every rank's inventory all-gathered as pickles
  (``all_gather_object`` pads each to the largest: ``8R + R x max``);
- inventories, after: by node (``restore.inventory.gather_inventories``),
  what every rank receives, what rank 0 receives, the most a node's lowest
  rank sends rank 0, the most a rank sends that rank;
- views (``restore.agreement.gather_views``): ``8R + R x max`` (unchanged).

"model" is the formula of ``docs/scale.md``, with its constants (bytes per
name, per range, per description, per placement entry) measured on one
encoded inventory; "measured" encodes every rank's. Seconds: building the
records at the node's lowest rank (all nodes, divided by N), joining them at
rank 0, expanding them on every rank, and before, unpickling every rank's
inventory (a node's, times N); the agreement's decision from every view.

    python benchmarks/bench_collectives.py [--ranks 1024,4096,16384] [--per-node 8]
"""

from __future__ import annotations

import gc
import json
import pickle
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

from _cli import parser
from _report import REPO, markdown_table, print_header
from dcp_multilevel import _dist
from dcp_multilevel.levels.restore import Views, _manifest_sources
from dcp_multilevel.levels.restore_actions import Inventory
from dcp_multilevel.levels.restore_inventory import (
    _inventory,
    expand_records,
    join_records,
    needs_message,
    node_record,
    placement_senders,
    simulate_exchange,
)
from dcp_multilevel.levels.restore_plan import merge_node_needs

TOKEN = "5f0c2a9e41d7b386"  # a save's token, as in every data file's name
CHUNK = 4 << 20  # the erasure level's chunk (one parity checksum each)
DATA, PARITY = 4, 2
STEP = 120_000
STORE_STEPS = range(STEP - 4000, STEP + 1, 1000)


def name(rank: int) -> str:
    return f"data/{rank}-0.{TOKEN}.bin"


@dataclass(frozen=True)
class Layout:
    state: str
    level: str
    ranks: int
    per_node: int
    spread: int
    rank_bytes: int

    @property
    def nodes(self) -> int:
        return self.ranks // self.per_node

    def own(self, node: int) -> list[str]:
        return [name(node * self.per_node + i) for i in range(self.per_node)]

    def needs(self, rank: int) -> tuple[list[str] | None, dict[str, list[list[int]]] | None]:
        """A rank's needs and ranges, as ``split_needs`` gives them."""
        if self.state == "replicated":
            return None, {}
        step = max(1, self.ranks // self.spread)
        others = {name(r): [[4096, 4096 + 96]] for r in range(0, self.ranks, step) if r != rank}
        return sorted({name(rank), *others}), others

    def groups(self) -> list[tuple[list[int], list[int]]]:
        out = []
        for start in range(0, self.nodes, DATA):
            members = list(range(start, min(start + DATA, self.nodes)))
            end = start + len(members)
            out.append((members, [(end + j) % self.nodes for j in range(PARITY)]))
        return out

    def description(self, g: int, members: list[int], parity_nodes: list[int]) -> dict:
        """A group's description, as ``ErasureLevel.groups`` and the drain write it."""
        described = [
            {"node": m, "files": [[f, self.rank_bytes] for f in self.own(m)]} for m in members
        ]
        stripe = -(-self.per_node * self.rank_bytes // CHUNK) * CHUNK
        return {
            "group": str(g),
            "data": len(members),
            "parity": PARITY,
            "chunk": CHUNK,
            "coder": "zfec",
            "stripe": stripe,
            "members": described,
            "parity_nodes": parity_nodes,
            "save_id": TOKEN,
            "checksums": {
                str(len(members) + j): [
                    f"xxh3:{g:08x}{j:02x}{c:06x}" for c in range(stripe // CHUNK)
                ]
                for j in range(PARITY)
            },
        }

    def placement(self) -> list[int]:
        return [r // self.per_node for r in range(self.ranks)]

    def taken(self) -> list[Inventory]:
        """Every rank's inventory as ``take_inventory`` takes it (before the exchange)."""
        placement = self.placement()
        held: dict[int, tuple[dict, dict, dict]] = {}  # node -> files, parity, groups
        for n in range(self.nodes):
            if self.level == "partner":
                files = {0: self.own(n), 1: sorted(self.own(n) + self.own((n - 1) % self.nodes))}
                held[n] = (files, {}, {})
            else:
                held[n] = ({0: self.own(n), 1: self.own(n)}, {1: []}, {1: {}})
        if self.level == "erasure":
            for g, (members, parity_nodes) in enumerate(self.groups()):
                desc = self.description(g, members, parity_nodes)
                for m in members:
                    held[m][2][1][str(g)] = desc
                for j, p in enumerate(parity_nodes):
                    held[p][1][1].append([str(g), len(members) + j])
                    held[p][2][1][str(g)] = desc
        out = []
        for r in range(self.ranks):
            n = r // self.per_node
            files, parity, groups = held[n]
            needs, ranges = self.needs(r)
            out.append(
                Inventory(
                    r,
                    n,
                    needs,
                    ranges,
                    parts=True,
                    files=files,
                    whole=[],
                    parity=parity,
                    groups=groups,
                    placement=placement,
                )
            )
        return out


def views(layout: Layout) -> list[dict[int, list[int]]]:
    """Every rank's view: 3 steps on the first level, 2 on the node-local one, 5 on a
    store level (a job keeping a few of each)."""
    mine = {0: [STEP - 200, STEP - 100, STEP], 1: [STEP - 1000, STEP], 2: list(STORE_STEPS)}
    return [{k: list(v) for k, v in mine.items()} for _ in range(layout.ranks)]


def old_sent(taken: list[Inventory], per_node: int) -> list[Inventory]:
    """What each rank all-gathered before: the node's lowest rank its node's needs
    merged in, the others theirs emptied (``merged``)."""
    out = []
    for start in range(0, len(taken), per_node):
        node = taken[start : start + per_node]
        out.append(merge_node_needs(node) if len(node) > 1 else node[0])
        out += [replace(inv, needs=[], ranges={}, merged=True) for inv in node[1:]]
    return out


def sampled_nodes(nodes: int) -> list[int]:
    """Nodes alike but for their names' digits, and the erasure ring's ends: the largest
    of these is the largest of all."""
    return sorted({0, 1, nodes // 2, nodes - 2, nodes - 1})


def per_item(size, one: Inventory, two: Inventory) -> float:
    """Bytes ``size`` gives one more item: inventory ``two`` has one more than ``one``."""
    return size(two) - size(one)


def constants(layout: Layout, size) -> dict[str, float]:
    """The model's constants for an encoding ``size(inv)``: an empty inventory (k), a
    name (a), a range entry of a needed file (b), a group description (d), a
    placement entry (p). Distinct objects each, but a range's name is its need's
    (``split_needs``): pickle refers back to an object it has sent, JSON repeats it."""
    a, b, c = (name(layout.ranks - i) for i in (1, 2, 3))
    empty = Inventory(layout.ranks - 1, layout.nodes - 1, [], {}, parts=True)
    desc = layout.description(0, list(range(DATA)), [DATA, DATA + 1])
    copy = json.loads(json.dumps(desc))
    needs = replace(empty, needs=[a, b, c])
    span = [[4096, 4192]]
    ranges = {a: span, b: list(span)}
    return {
        "k": size(empty),
        "a": per_item(
            size, replace(empty, files={0: [a, b]}), replace(empty, files={0: [a, b, c]})
        ),
        "b": per_item(
            size, replace(needs, ranges=ranges), replace(needs, ranges={**ranges, c: list(span)})
        ),
        "d": per_item(
            size,
            replace(empty, groups={1: {"0": desc}}),
            replace(empty, groups={1: {"0": desc, "1": copy}}),
        ),
        "p": (size(replace(empty, placement=layout.placement())) - size(empty)) / layout.ranks,
    }


def pickled(inv: Inventory) -> int:
    return _dist.pickled_size(asdict(inv))


def jsoned(inv: Inventory) -> int:
    return len(json.dumps(asdict(inv)))


def node_counts(layout: Layout) -> dict[str, float]:
    """Per node: files held on every level (h), names in its merged needs (q), range
    entries (rho), group descriptions (g); groups in all (G)."""
    invs = layout.taken()[: layout.per_node]
    merged = merge_node_needs(invs)
    return {
        "h": sum(len(fs) for fs in invs[0].files.values()),
        "q": len(merged.needs or ()),
        "rho": len(merged.ranges or {}),
        "g": len(invs[0].groups.get(1, {})),
        "G": len(layout.groups()) if layout.level == "erasure" else 0,
    }


def model(layout: Layout) -> dict[str, float]:
    """The formulas of docs/scale.md, in bytes per rank."""
    R, N, n = layout.ranks, layout.nodes, layout.per_node
    c = node_counts(layout)
    old, new = constants(layout, pickled), constants(layout, jsoned)
    w = len(json.dumps([R - 1, []])) + 2  # a rank of the node in its record
    inv = lambda k: k["k"] + k["a"] * (c["h"] + c["q"]) + k["b"] * c["rho"]  # noqa: E731
    before = 8 * R + R * (inv(old) + old["d"] * c["g"] + old["p"] * R)
    after = N * (inv(new) + w * (n - 1)) + new["d"] * c["G"] + new["p"] * R
    return {"before": before, "after": after}


def views_row(layout: Layout) -> tuple[int, float]:
    """Bytes every rank receives for the views, and seconds for the decision."""
    everyone = views(layout)
    received = 8 * layout.ranks + layout.ranks * max(_dist.pickled_size(v) for v in everyone)
    drivers = [SimpleNamespace(node_local=k) for k in (True, True, False)]
    t0 = time.perf_counter()
    v = Views(everyone[0], everyone)
    for step in reversed(v.candidates()):  # the newest one every rank can read
        next(_manifest_sources(step, drivers, v), None)  # the first holder, as a load asks
        if v.on_a_store(step, drivers):  # type: ignore[arg-type]
            break
    return received, time.perf_counter() - t0


def measure(layout: Layout) -> dict[str, float]:
    """Bytes and seconds for one layout, timed without the garbage collector (as
    ``timeit`` does: the simulation holds every rank's objects, a rank only its own)."""
    gc.collect()
    gc.disable()
    try:
        return _measure(layout)
    finally:
        gc.enable()


def _measure(layout: Layout) -> dict[str, float]:
    taken = layout.taken()
    sent = old_sent(taken, layout.per_node)
    largest = max(
        pickled(inv)
        for n in sampled_nodes(layout.nodes)
        for inv in sent[n * layout.per_node : (n + 1) * layout.per_node]
    )
    # Before: every rank unpickles every rank's inventory (a node's, times N).
    node = [pickle.dumps(asdict(inv)) for inv in sent[: layout.per_node]]
    t0 = time.perf_counter()
    for raw in node:
        _inventory(pickle.loads(raw))  # noqa: S301 - our own bytes
    unpickle = (time.perf_counter() - t0) * layout.nodes
    # After: the records at the nodes' lowest ranks, joined at rank 0, expanded on all.
    t0 = time.perf_counter()
    n = layout.per_node
    records = [
        node_record(taken[i], [(m.rank, needs_message(m)) for m in taken[i + 1 : i + n]])
        for i in range(0, layout.ranks, n)
    ]
    leader_s = (time.perf_counter() - t0) / layout.nodes
    placements = {d: taken[r].placement for d, r in placement_senders(records).items()}
    t0 = time.perf_counter()
    joined = join_records(records, placements)  # type: ignore[arg-type]
    join_s = time.perf_counter() - t0
    _, moved = simulate_exchange(taken)
    t0 = time.perf_counter()
    expanded = expand_records(joined)
    expand_s = time.perf_counter() - t0
    assert len(expanded) == layout.ranks
    view_bytes, view_s = views_row(layout)
    return {
        "before": 8 * layout.ranks + layout.ranks * largest,
        "after": moved.everyone,
        "root": moved.at_root,
        "record": moved.record,
        "to_leader": moved.to_leader,
        "unpickle_s": unpickle,
        "leader_s": leader_s,
        "join_s": join_s,
        "expand_s": expand_s,
        "views": view_bytes,
        "views_s": view_s,
    }


def mib(x: float) -> str:
    return f"{x / (1 << 20):.2f}"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--ranks", default="1024,4096,16384", help="rank counts, comma-separated")
    p.add_argument("--per-node", type=int, default=8, help="ranks per node")
    p.add_argument(
        "--layouts", default="replicated/partner,sharded/partner,replicated/erasure,sharded/erasure"
    )
    p.add_argument(
        "--spread",
        type=int,
        default=256,
        help="sharded: files each rank reads a replicated value from",
    )
    p.add_argument("--rank-mib", type=int, default=64, help="bytes per rank's file, MiB")
    args = p.parse_args(argv)
    print_header(__file__, REPO)
    rows, times, view_rows = [], [], []
    for ranks in (int(x) for x in args.ranks.split(",")):
        for spec in args.layouts.split(","):
            state, level = spec.split("/")
            layout = Layout(state, level, ranks, args.per_node, args.spread, args.rank_mib << 20)
            m, f = measure(layout), model(layout)
            rows.append(
                [
                    spec,
                    ranks,
                    layout.nodes,
                    mib(f["before"]),
                    mib(m["before"]),
                    mib(f["after"]),
                    mib(m["after"]),
                    f"{m['before'] / m['after']:.0f}x",
                    mib(m["root"]),
                    f"{m['record'] / 1024:.1f}",
                    f"{m['to_leader']:,.0f}",
                ]
            )
            times.append(
                [
                    spec,
                    ranks,
                    f"{m['unpickle_s']:.3f}",
                    f"{m['leader_s'] * 1e3:.2f}",
                    f"{m['join_s']:.3f}",
                    f"{m['expand_s']:.3f}",
                ]
            )
            if spec == args.layouts.split(",")[0]:
                view_rows.append([ranks, f"{m['views'] / 1024:.0f}", f"{m['views_s'] * 1e3:.1f}"])
    print()
    print("Inventories: MiB every rank receives (model | measured), before and after;")
    print("after: MiB rank 0 receives, KiB a node's lowest rank sends it, bytes a rank")
    print("sends its node's lowest rank.\n")
    print(
        markdown_table(
            "layout | R | N | before, model | before | after, model | after | less | rank 0 "
            "| record KiB | to leader B",
            rows,
        )
    )
    print("\nSeconds: before, every rank unpickles every inventory; after, one node's lowest")
    print("rank builds its record (ms), rank 0 joins them, every rank expands them.\n")
    print(markdown_table("layout | R | before: unpickle s | record ms | join s | expand s", times))
    print("\nViews (gather_views, unchanged): KiB every rank receives, ms for the decision.\n")
    print(markdown_table("R | KiB | decision ms", view_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
