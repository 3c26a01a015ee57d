"""Restore planning, pure: which files each node must receive, and from where.

Every rank computes the same :class:`RestorePlan` from every rank's
:class:`Inventory` (what its ranks need, what its node holds on every level;
``restore_inventory.py`` takes and exchanges them). For each node, for each file its
ranks need and its first level lacks, in order:

1. a :class:`Link` from another level of the same node (a hard link: no bytes move);
2. a :class:`Copy` from another node holding it, or from a node an earlier
   action of the plan brings it to (:class:`TransferOrder`, below,
   then picks, per copy, the source that can send it soonest, forwarding
   files from node to node). When the node's
   ranks need only a small part of the file (at most :data:`PART_SHARE` of
   its bytes: a value every rank holds that one rank's file stores, next to
   that rank's own shards) and its first level can take them, only their
   items' byte ranges are copied (``Copy.ranges``), into the step's
   ``.parts`` copy (``restore_execute.py``), never into the first level's files;
3. a :class:`Rebuild` of the group member it belongs to, on a level whose
   kind rebuilds (erasure: every member of the group the node lacks, in one
   pass, from any ``data`` intact blocks), once, on the first node that needs
   it; the kind chooses (``levels/base.py``, ``LevelDriver.rebuilder``);
4. a store level holding the whole step (the reader reads it there);
5. else the step cannot be restored, and :attr:`RestorePlan.reasons` names
   the nodes, levels and groups.

Nodes whose ranks read every file whole (replicated state) lack most of
them when a node-local first level spread them over the nodes: from
:data:`RING_NODES` such nodes on, they get them around a :class:`Ring`
(below), one entry per file, after the actions that bring the files no
ring node holds (or would send more than its share) onto one (steps 2-5).
Sources found damaged in an earlier round are left out (``bad``). No I/O,
no torch.distributed.

**The order** of a restore's transfers (:class:`TransferOrder`): every rank busy, each
copy from a source free to send it.

Every rank carries out its own actions in list order and waits only on its
partners (blocking sends), so actions that share no rank overlap, and any
one total order cannot deadlock (the earliest unfinished action always has
all of its ranks waiting on it). :class:`TransferOrder` simulates those
transfers, a byte per time unit: links and rebuilds first (their ranks are
fixed; a rebuilt member can be forwarded once it ends), then copies, event
by event. Whenever ranks fall idle, the node with the most bytes still to
receive first (its receives are the longest chain), each idle rank of that
node takes one of the node's next :data:`LOOKAHEAD` copies that an idle
source can send now: any rank of the node receives a whole file (it lands
in the node's first level, which all of them read), so a node's ranks
receive side by side; byte ranges go to the plan's receiving rank (a
node's parts copy has one writer). A source is a node holding the file
intact, or the *receiving rank* of a node an earlier copy or rebuild
brought it to (forwarded: with replicated state every node needs every
file, and a file's one holder need not send it to every other node). The
copy taken is the file on the fewest nodes so far (rarest first: it spreads
what later copies forward), then from the lowest level, a copy held before
the restore, the lowest rank. The list is then sorted by start (stable: the
same on every rank). A forwarded copy starts after the action that brings
the file ends, on the same rank, so that rank holds it by then.

Call order::

    ordered = TransferOrder(files, inventories, held, bad).order(actions)   once per plan

**The ring** (:func:`build_ring`): files that every node of many needs, passed around a
ring: plans O(files), not O(nodes x files).

With replicated (data-parallel) state that the balanced planner spread over
every rank, a node-local first level holds a different part of each
checkpoint on each node, and every node needs every file: as point-to-point
copies that is ``nodes x files`` actions (32 million at 2,000 nodes of 8
ranks), which no planner lists in a second. A :class:`~.restore_actions.Ring` names
each file once, with where it starts (its *origin*) and on which *lane* (the
node's ``j``-th rank, on every node), and every rank derives its own hops:

- file ``f`` travels ``origin -> origin + 1 -> ... -> origin + hops``
  (positions in ring order, modulo its length), each hop from the lane's rank
  of one node to the lane's rank of the next; a node that holds ``f``
  already (another level, a partner copy) is not sent it and sends its own
  copy on;
- hop ``k`` belongs to round ``k - 1``; all hops are ordered by round, then
  by the sender's *phase* (even positions first, then odd ones, then, in a
  ring of odd length, the last position alone), then position and file: the
  transfers of a phase pair disjoint ranks, so they run side by side, and in
  each round every rank of a lane sends one file and receives one. In the
  one-transfer-at-a-time model of :func:`simulated_time` that is the lower
  bound for replicated state (``2 (nodes - 1) x`` a lane's bytes per node).

Every rank carries out the global order restricted to its own hops, so the
argument of :class:`TransferOrder` holds: the earliest unfinished hop has both its
ranks waiting on it (no deadlock). The origin of a file several ring nodes
hold is the least loaded of them; lanes are filled by bytes.

Pure: no I/O, no torch.distributed. Call order::

    origins, entries = ring_origins(held, files)      # plan_restore: entries are planned first
    ring = build_ring(ranks, held, files, origins, landed)   # once those are ordered
    hops(ring)  /  my_hops(ring, rank)                # simulation / the executor
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from .base import RebuildChoice, Rebuilder
from .config import PART_SHARE
from .restore_actions import (
    BlockFault,
    Copy,
    CopyFault,
    Fault,
    Inventory,
    Link,
    Rebuild,
    Ring,
    RingFile,
    participants,
)

__all__ = [
    "LOOKAHEAD",
    "PART_SHARE",
    "RING_NODES",
    "RING_SURE",
    "Hop",
    "RestorePlan",
    "TransferOrder",
    "build_ring",
    "expand_rings",
    "group_descriptions",
    "hops",
    "lane_rank",
    "merge_node_needs",
    "merge_ranges",
    "my_hops",
    "plan_restore",
    "rebuilders",
    "received_around",
    "ring_nodes_from_env",
    "ring_origins",
    "simulated_time",
]


#: At least this many nodes that need every file may receive them around a ring
#: (``ring.py``); from ``RING_SURE`` nodes on, they do (the ring's simulated time is
#: lower than the copies' from 32 nodes of 8 ranks on: ``bench_restore_plan.py``).
RING_NODES = 3
RING_SURE = 32


@dataclass(frozen=True)
class RestorePlan:
    """Every rank's part of a restore (the same on every rank); a re-plan is a new one."""

    step: int
    actions: tuple[Link | Copy | Rebuild | Ring, ...] = ()
    reasons: tuple[str, ...] = ()  # why it cannot work; empty: it can

    @property
    def ok(self) -> bool:
        """True when every rank can read every file it needs."""
        return not self.reasons


def plan_restore(
    step: int,
    files: dict[str, int],
    inventories: Sequence[Inventory],
    level_urls: Sequence[str],
    bad: Collection[Fault] = frozenset(),
    transfers: bool = True,
    part_share: float = PART_SHARE,
    rebuilders: Mapping[int, Rebuilder] | None = None,
    ring_nodes: int | None = None,
) -> RestorePlan:
    """How every node gets the files its ranks need (pure; see the module docstring).

    ``part_share``: a file whose needed byte ranges are at most this share of it
    is brought in parts (0: always whole files). ``rebuilders``: level -> how that
    level's kind rebuilds a lost file (``LevelDriver.rebuilder``); none: no rebuilds.

    ``bad`` holds the sources found damaged in earlier rounds:
    :class:`~dcp_multilevel.levels.restore_plan.CopyFault` and
    :class:`~dcp_multilevel.levels.restore_plan.BlockFault` (``actions.py``).
    With ``transfers=False`` (no group to move bytes over) only store levels help.
    ``ring_nodes``: at least this many nodes that need every file receive them
    around a :class:`~.actions.Ring` (``ring.py``). Default: from
    :data:`RING_NODES` nodes on; below :data:`RING_SURE` nodes, only where its
    simulated time beats the copies' (small rings pay more for their entries).
    The environment variable ``DCP_ML_RING_NODES`` sets it for a job (every rank
    must see the same value; ``0``: rings from 2 nodes on; a large one: no ring).
    """
    if ring_nodes is None:
        ring_nodes = ring_nodes_from_env()
    if ring_nodes is None:
        args = (step, files, inventories, level_urls, bad, transfers, part_share, rebuilders)
        plan = plan_restore(*args, ring_nodes=RING_NODES)
        if len(plan.actions) == 0 or not isinstance(plan.actions[-1], Ring):
            return plan
        if len(plan.actions[-1].nodes) >= RING_SURE:
            return plan
        copies = plan_restore(*args, ring_nodes=len(inventories) + 1)
        faster = simulated_time(plan.actions, files) < simulated_time(copies.actions, files)
        return plan if faster else copies
    actions: list[Link | Copy | Rebuild] = []
    reasons: list[str] = []
    nodes: dict[int, list[Inventory]] = {}
    for inv in inventories:
        nodes.setdefault(inv.node, []).append(inv)
    ring = {n for n, invs in nodes.items() if _needs_everything(invs, files, part_share)}
    if len(ring) < ring_nodes or not transfers:
        ring = set()
    groups = group_descriptions(inventories)
    lacking: list[str] = []  # one line per node that lacks files (first in the reasons)
    arrived: dict[int, tuple[int, set[str]]] = {}  # node -> (receiving rank, rebuilt files)
    todo: list[_NodeNeeds] = []
    ring_held: dict[int, dict[str, int]] = {}  # ring node -> file -> lowest level there
    wanted: set[str] = set()  # the files some node outside the ring lacks
    for node, invs in sorted(nodes.items()):
        dst = min(inv.rank for inv in invs)
        # Copies on this node found damaged (and what a restore linked to them).
        spoiled = {f.file for f in bad if isinstance(f, CopyFault) and f.node == node}
        lowest: dict[str, int] = {}
        for inv in invs:
            for level, fs in inv.files.items():
                for f in fs:
                    if f not in spoiled and lowest.get(f, level) >= level:
                        lowest[f] = level
        needed = lowest.keys() if node in ring else _needed(invs, files)
        for file in sorted(f for f in needed if lowest.get(f, 0) > 0):  # another level here
            actions.append(Link(file, lowest[file], dst))
        if node in ring:  # the ring brings the rest (below)
            ring_held[node] = lowest
            continue
        missing = sorted(f for f in needed if f not in lowest)
        wanted.update(missing)
        parts = {f: _part_of(f, files[f], invs, dst, part_share) for f in missing}
        todo.append(_NodeNeeds(node, invs, dst, parts, any(inv.whole for inv in invs)))
    origins, entering = ring_origins(ring_held, files) if ring else ({}, {})
    for node, enter in sorted(entering.items()):  # onto a ring node first (ring.py)
        wanted.update(enter)
        todo.append(
            _NodeNeeds(
                node,
                nodes[node],
                min(inv.rank for inv in nodes[node]),
                dict.fromkeys(enter),
                all(inv.whole for n in ring for inv in nodes[n]),
            )
        )
    held = _holders(inventories, bad, wanted)
    # Files needed whole first: a lost member is then rebuilt on a node that needs
    # it whole, and the nodes that need a few of its items take them from there.
    for partly in (False, True):
        for need in todo:
            wanted = {f for f, r in need.parts.items() if (r is not None) == partly}
            for file in sorted(wanted):
                if file in need.rebuilt:
                    continue
                source = _copy_source(file, need.node, held, bad, arrived) if transfers else None
                if source is not None:
                    actions.append(Copy(file, *source, need.dst, need.parts[file]))
                    continue
                action = (
                    _rebuild_for(
                        file,
                        need.node,
                        wanted,
                        groups,
                        rebuilders or {},
                        inventories,
                        held,
                        bad,
                        need.dst,
                        level_urls,
                        step,
                    )
                    if transfers
                    else None
                )
                if isinstance(action, Rebuild):
                    actions.append(action)
                    need.rebuilt |= set(action.brings)
                    arrived.setdefault(need.node, (need.dst, set()))[1].update(need.rebuilt)
                    continue
                if not need.covered:
                    need.unmet.append(file)
                    if isinstance(action, str):
                        reasons.append(action)
    for need in todo:
        if need.unmet:
            ranks = sorted(inv.rank for inv in need.invs)
            lacking.append(
                f"node {need.node} (ranks {ranks}) lacks {len(need.unmet)} file(s) of step {step} "
                f"that no node holds and no level can rebuild (e.g. {need.unmet[0]})"
            )
            copying = sorted({i for inv in inventories for i in inv.files if i > 0} - set(groups))
            for i in copying:
                reasons.append(f"{level_urls[i]}: no node here holds a copy of {need.unmet[0]}")
    reasons[:0] = lacking
    if reasons:
        lost = _lost_nodes(inventories)
        if lost:
            reasons.append(
                f"nodes that held step {step} and hold none of it now (lost or replaced): {lost}"
            )
        return RestorePlan(step, (), tuple(dict.fromkeys(reasons)))
    ordered: list[Link | Copy | Rebuild | Ring] = []
    ordered += TransferOrder(files, inventories, held, bad).order(actions)
    if ring:
        # Where each entering file landed: the rank that sends it around first.
        enter = {(node, f) for node, fs in entering.items() for f in fs}
        node_of = {inv.rank: inv.node for inv in inventories}
        landed = {
            f: a.dst
            for a in ordered
            if isinstance(a, (Copy, Rebuild))
            for f in ((a.file,) if isinstance(a, Copy) else a.brings)
            if (node_of[a.dst], f) in enter
        }
        built = build_ring(
            {n: [inv.rank for inv in nodes[n]] for n in ring}, ring_held, files, origins, landed
        )
        if built.files:
            ordered.append(built)
    return RestorePlan(step, tuple(ordered))


@dataclass
class _NodeNeeds:
    """What one node lacks, while a plan is made: per file, the byte ranges to copy
    (None: the whole file); the files rebuilt on it and those no source has."""

    node: int
    invs: list[Inventory]
    dst: int
    parts: dict[str, tuple[tuple[int, int], ...] | None]
    covered: bool  # a store level holding the whole step serves what no node has
    rebuilt: set[str] = field(default_factory=set)
    unmet: list[str] = field(default_factory=list)


def _needed(invs: Sequence[Inventory], files: Collection[str]) -> Collection[str]:
    """The files a node's ranks ``invs`` read (all of them, unless every rank says)."""
    if all(inv.needs is not None for inv in invs):
        return {f for inv in invs for f in inv.needs or ()}
    return files


def _needs_everything(invs: Sequence[Inventory], files: dict[str, int], part_share: float) -> bool:
    """Whether a node's ranks read every file whole (a ring may bring them)."""
    if len(_needed(invs, files)) != len(files):
        return False
    dst = min(inv.rank for inv in invs)
    partly = {f for inv in invs for f in inv.ranges or {}}  # only these may come in parts
    return all(_part_of(f, files[f], invs, dst, part_share) is None for f in partly)


def merge_ranges(ranges: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(offset, end)`` ranges sorted, with overlapping and touching ones merged."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def merge_node_needs(invs: Sequence[Inventory]) -> Inventory:
    """The inventory of a node's receiving rank, ``invs[0]`` (the node's lowest rank;
    ``invs``: all of the node's), carrying what every rank of the node reads: the
    union of their needs, and ranges for the files none of them reads mostly whole
    (the union of their ranges). The others then send none (``merged``): a plan
    made from these is the one made from every rank's own (``_part_of``), and the
    ranges every rank gathers are one set per node, not per rank."""
    first = invs[0]
    needs = None
    if all(inv.needs is not None for inv in invs):
        needs = sorted({f for inv in invs for f in inv.needs or ()})
    ranges = None
    if all(inv.ranges is not None for inv in invs):
        partly = {f for inv in invs for f in inv.ranges or {}}
        whole = {
            f
            for f in partly
            for inv in invs
            if f not in (inv.ranges or {}) and (inv.needs is None or f in inv.needs)
        }
        ranges = {
            f: [list(r) for r in merge_ranges([r for inv in invs for r in inv.ranges.get(f, ())])]  # type: ignore[union-attr]
            for f in sorted(partly - whole)
        }
    return replace(first, needs=needs, ranges=ranges, merged=False)


def _part_of(
    file: str, size: int, invs: Sequence[Inventory], dst: int, part_share: float
) -> tuple[tuple[int, int], ...] | None:
    """The byte ranges of ``file`` a node's ranks ``invs`` read, when that is a small
    part (at most ``part_share`` of ``size``) and the receiving rank ``dst`` can take
    parts; None: copy the whole file."""
    receiver = next(inv for inv in invs if inv.rank == dst)
    if not receiver.parts or any(inv.ranges is None for inv in invs):
        return None
    if any(
        file not in (inv.ranges or {}) and (inv.needs is None or file in inv.needs) for inv in invs
    ):
        return None  # a rank of the node reads most of it
    wanted = merge_ranges([r for inv in invs for r in (inv.ranges or {}).get(file, ())])
    if not wanted or sum(end - start for start, end in wanted) > part_share * size:
        return None
    return tuple(wanted)


def group_descriptions(inventories: Sequence[Inventory]) -> dict[int, dict[str, dict[str, Any]]]:
    """Every group any rank's node described (a rebuilding kind's ``holdings``):
    level -> group -> description
    (a replaced node holds none: it takes them from the others)."""
    groups: dict[int, dict[str, dict[str, Any]]] = {}
    for inv in inventories:
        for level, descs in inv.groups.items():
            for g, desc in descs.items():
                groups.setdefault(level, {}).setdefault(g, desc)
    return groups


def rebuilders(drivers: Sequence[Any]) -> dict[int, Rebuilder]:
    """level -> its kind's rebuilder, for the levels whose kind rebuilds (``drivers``:
    the job's ``LevelDriver`` s, in level order)."""
    return {i: d.rebuilder for i, d in enumerate(drivers) if d.rebuilder is not None}


def _lost_nodes(inventories: Sequence[Inventory]) -> list[int]:
    """Nodes of the saving job (its placement) on which no rank holds the step now."""
    placement = next((inv.placement for inv in inventories if inv.placement), None)
    if not placement:
        return []
    holding = {inv.node for inv in inventories if any(fs for fs in inv.files.values())}
    return sorted(set(placement) - holding)


def _holders(
    inventories: Sequence[Inventory], bad: Collection[Fault], only: Collection[str]
) -> dict[str, list[tuple[int, int, int]]]:
    """file -> the intact copies the nodes hold before the restore, as sorted
    ``(level, rank, node)`` (every rank of a node lists the node's files), for the
    files ``only`` (those some node receives by a copy)."""
    held: dict[str, list[tuple[int, int, int]]] = {}
    if not only:
        return held
    for inv in inventories:
        for level, fs in inv.files.items():
            for f in fs:
                if f in only and CopyFault(inv.node, f) not in bad:
                    held.setdefault(f, []).append((level, inv.rank, inv.node))
    for copies in held.values():
        copies.sort()
    return held


def _copy_source(
    file: str,
    node: int,
    held: dict[str, list[tuple[int, int, int]]],
    bad: Collection[Fault],
    arrived: dict[int, tuple[int, set[str]]] | None = None,
) -> tuple[int, int] | None:
    """(level, rank) of the first intact copy of ``file`` on another node (``held``:
    :func:`_holders`), lowest level first; else a node that an earlier action of the
    plan brings it to (``arrived``: node -> (its receiving rank, files)), so a lost
    member is rebuilt once, then copied."""
    for level, rank, other in held.get(file, ()):
        if other != node:
            return level, rank
    for other, (rank, files) in sorted((arrived or {}).items()):
        if other != node and file in files and CopyFault(other, file) not in bad:
            return 0, rank
    return None


def _rebuild_for(
    file: str,
    node: int,
    wanted: set[str],
    groups: dict[int, dict[str, dict[str, Any]]],
    rebuilders: Mapping[int, Rebuilder],
    inventories: Sequence[Inventory],
    held: dict[str, list[tuple[int, int, int]]],
    bad: Collection[Fault],
    dst: int,
    level_urls: Sequence[str],
    step: int,
) -> Rebuild | str | None:
    """A rebuild that yields ``file`` on ``node`` (asked of each level kind that
    rebuilds, ``levels/base.py``), or why none can (None: no group has it)."""
    reason: str | None = None
    for level, descs in sorted(groups.items()):
        rebuilder = rebuilders.get(level)
        if rebuilder is None:
            continue
        choice = rebuilder.plan(
            level,
            file,
            wanted,
            descs,
            inventories,
            copyable=lambda f: _copy_source(f, node, held, bad) is not None,
            block_damaged=lambda g, b, r, level=level: BlockFault(level, g, b, r) in bad,
        )
        if isinstance(choice, RebuildChoice):
            return Rebuild(level, choice.group, choice.members, choice.sources, dst, choice.brings)
        if choice is not None:
            reason = f"{level_urls[level]}: step {step}: {choice}"
    return reason


def expand_rings(actions: Sequence[Link | Copy | Rebuild | Ring]) -> list[Link | Copy | Rebuild]:
    """``actions`` with each ring as the copies of its hops, in their order (to check or
    simulate a plan at small sizes)."""
    out: list[Link | Copy | Rebuild] = []
    for action in actions:
        if isinstance(action, Ring):
            out += [Copy(action.files[h.index].file, h.level, h.src, h.dst) for h in hops(action)]
        else:
            out.append(action)
    return out


def simulated_time(actions: Sequence[Link | Copy | Rebuild | Ring], files: dict[str, int]) -> int:
    """How long carrying ``actions`` out takes, a byte a time unit: each rank takes its
    own in list order, each action once all its ranks are free (blocking transfers).
    A copy moves its whole file; a rebuild reads its largest file from each source;
    a ring is its hops, in order (``ring.py``: ``nodes x files`` of them).
    For tests and benchmarks (to compare plans), not used by the planner."""
    free: dict[int, int] = {}
    end = 0
    for action in expand_rings(actions):
        if isinstance(action, Copy):
            length = files[action.file]
        elif isinstance(action, Rebuild):
            length = max(files[f] for f in action.brings) * len(action.sources)
        else:
            length = 0
        ranks = participants(action)
        start = max((free.get(r, 0) for r in ranks), default=0)
        for r in ranks:
            free[r] = start + length
        end = max(end, start + length)
    return end


#: Copies of one receiving node weighed at a time.
LOOKAHEAD = 8

Action = Link | Copy | Rebuild


class TransferOrder:
    """Orders one plan's actions (see the module docstring); use each instance once.

    Args:
        files: every file's size in bytes.
        inventories: every rank's inventory (which node each rank is on).
        held: file -> the intact copies the nodes hold before the restore, as
            sorted ``(level, rank, node)`` (``plan.py``'s ``_holders``).
        bad: sources found damaged in an earlier round.
    """

    def __init__(
        self,
        files: dict[str, int],
        inventories: Sequence[Inventory],
        held: dict[str, list[tuple[int, int, int]]],
        bad: Collection[Fault] = frozenset(),
    ) -> None:
        self.files = files
        self.held = held
        self.bad = bad
        self.nodes = {inv.rank: inv.node for inv in inventories}  # rank -> node
        self.ranks_of: dict[int, list[int]] = {}  # node -> its ranks
        for inv in sorted(inventories, key=lambda i: i.rank):
            self.ranks_of.setdefault(inv.node, []).append(inv.rank)
        # The simulation's clock and what it has placed.
        self.now = 0
        self.free: dict[int, int] = {}  # rank -> when its last action ends
        self.starts: list[int] = []
        self.placed: list[Action] = []
        self.ends: list[int] = []  # a heap of the times a transfer ends (the events)
        self.ending: dict[int, set[int]] = {}  # time -> ranks whose last transfer ends then
        # What is left to place, and who can send what from when.
        self.copies: dict[int, list[Copy]] = {}  # receiving node -> its copies, plan order
        self.left: dict[int, int] = {}  # receiving node -> bytes still to receive
        self.forwards: dict[str, list[tuple[int, int, int]]] = {}  # file -> [(ready, rank, node)]
        self.holding: dict[str, int] = {}  # file -> nodes holding it before the restore
        self.can_send: dict[int, set[str]] = {}  # rank -> files it holds or forwards
        self.ready: dict[int, set[str]] = {}  # time -> files forwardable from then on
        self.ready_at: list[int] = []  # a heap of ready's times
        # Only nodes whose options may have changed are scanned at an event: those
        # with a rank that fell idle (``rescan``), and those waiting (idle ranks, no
        # source) on a file that a rank that fell idle can send or that became
        # forwardable (``woken``; scanned only while one of those ranks is still
        # idle when its turn comes). The others would find what they found before
        # (nothing): the order is the one a scan of every node makes.
        self.waiting: dict[str, set[int]] = {}  # file -> nodes that found no source for it
        self.rescan: set[int] = set()
        self.woken: set[int] = set()
        self.fresh: set[int] = set()  # the ranks that woke nodes at this event

    def order(self, actions: Sequence[Action]) -> list[Action]:
        """``actions`` in one total order (see the module docstring)."""
        self._place_fixed(actions)
        self._index()
        while any(self.copies.values()):
            self._assign_idle_ranks()
            if not any(self.copies.values()):
                break  # the last ones were empty files: no transfer ends to wait for
            if self._next_event():
                continue
            # Nothing busy and nothing sendable (the plan's own source is always among
            # the candidates, so this does not happen): the plan's choice, at the end.
            node = next(n for n, cs in self.copies.items() if cs)
            first = self.copies[node][0]
            self._send(node, 0, first.dst, first.level, first.src)
            self.rescan = {n for n, cs in self.copies.items() if cs}
        order = sorted(range(len(self.placed)), key=lambda i: (self.starts[i], i))
        return [self.placed[i] for i in order]

    # ------------------------------------------------------------------ steps

    def _place(self, action: Action, start: int, length: int) -> None:
        if length:
            end = start + length
            for r in participants(action):
                self.free[r] = end
            if end not in self.ending:
                heapq.heappush(self.ends, end)
            self.ending.setdefault(end, set()).update(participants(action))
        self.starts.append(start)
        self.placed.append(action)

    def _place_fixed(self, actions: Sequence[Action]) -> None:
        """Links and rebuilds where they must run; copies grouped by receiving node."""
        for action in actions:
            if isinstance(action, Copy):
                self.copies.setdefault(self.nodes[action.dst], []).append(action)
            elif isinstance(action, Link):
                self._place(action, 0, 0)  # no transfer: the file is on the node already
            else:
                members = max(1, len(action.members))
                length = (
                    sum(self.files.get(f, 0) for f in action.brings)
                    // members
                    * sum(1 for _, r in action.sources if r != action.dst)
                )
                start = max(self.free.get(r, 0) for r in participants(action))
                self._place(action, start, length)
                for f in action.brings:
                    entry = (start + length, action.dst, self.nodes[action.dst])
                    self.forwards.setdefault(f, []).append(entry)

    def _index(self) -> None:
        """What each node still receives, who holds and forwards what, from when."""
        self.left = {node: sum(map(self._length, cs)) for node, cs in self.copies.items()}
        self.holding = {f: len({node for _, _, node in hs}) for f, hs in self.held.items()}
        for f, hs in self.held.items():
            for _, rank, _ in hs:
                self.can_send.setdefault(rank, set()).add(f)
        for f, entries in self.forwards.items():
            for at, rank, _ in entries:
                self.can_send.setdefault(rank, set()).add(f)
                self._ready_when(at, f)
        self.rescan = {n for n, cs in self.copies.items() if cs}

    def _assign_idle_ranks(self) -> None:
        """At ``now``: each idle rank of each node to scan takes the best copy it can."""
        scan, self.rescan = self.rescan, set()
        wake, self.woken = self.woken, set()
        order = sorted(
            (n for n in scan | wake if self.copies.get(n)), key=lambda n: (-self.left[n], n)
        )
        for node in order:
            if node not in scan and not any(self.free.get(r, 0) <= self.now for r in self.fresh):
                # Nodes before it took what woke it: it waits on as it did.
                for copy in self.copies[node][:LOOKAHEAD]:
                    self.waiting.setdefault(copy.file, set()).add(node)
                continue
            self._assign_node(node)

    def _assign_node(self, node: int) -> None:
        for dst in self.ranks_of[node]:
            if self.free.get(dst, 0) > self.now or not self.copies[node]:
                continue  # busy (or became a source in this pass)
            ahead = self.copies[node][:LOOKAHEAD]
            # The least (spread, level, forwarded, rank, i) over every copy's
            # sources; spread first, so a rarer copy with a source ends the search.
            rarest = sorted(
                (self.holding.get(copy.file, 0) + len(self.forwards.get(copy.file, ())), i)
                for i, copy in enumerate(ahead)
                if dst in self._receivers(node, copy)
            )
            best = None
            for spread, i in rarest:
                if best is not None and spread > best[0]:
                    break
                source = self._best_source(ahead[i])
                if source is not None and (best is None or (spread, *source, i) < best):
                    best = (spread, *source, i)
            if best is not None:
                _, level, _, src, i = best
                self._send(node, i, dst, level, src)
                continue
            for copy in ahead:
                self.waiting.setdefault(copy.file, set()).add(node)
            if all(copy.ranges is None for copy in ahead):
                break  # the node's other idle ranks would find no source either

    def _next_event(self) -> bool:
        """Move ``now`` to the next time a rank falls idle; False when none will."""
        self.fresh = set()
        at = self.now
        while self.ends and not self.fresh:  # the next time a rank's last transfer ends
            at = heapq.heappop(self.ends)
            self.fresh = {r for r in self.ending.pop(at) if self.free[r] == at}
        if not self.fresh:
            return False
        self.now = at
        for rank in self.fresh:
            self.rescan.add(self.nodes[rank])
            for f in self.can_send.get(rank, ()):
                self.woken.update(self.waiting.pop(f, ()))
        while self.ready_at and self.ready_at[0] <= self.now:  # (a rebuild may end between)
            for f in self.ready.pop(heapq.heappop(self.ready_at)):
                self.woken.update(self.waiting.pop(f, ()))
                self.fresh.update(rank for at, rank, _ in self.forwards[f] if at <= self.now)
        return True

    def _send(self, node: int, i: int, dst: int, level: int, src: int) -> None:
        copy = replace(self.copies[node].pop(i), dst=dst, level=level, src=src)
        length = self._length(copy)
        self._place(copy, self.now, length)
        if copy.ranges is None:
            self.forwards.setdefault(copy.file, []).append((self.now + length, dst, node))
            self.can_send.setdefault(dst, set()).add(copy.file)
            self._ready_when(self.now + length, copy.file)
        if not length:  # an empty file: both ranks stay idle, the file is forwardable now
            self.rescan.add(node)
            self.rescan.update(self.waiting.pop(copy.file, ()))
            self.fresh.add(dst)  # woken nodes later in this pass may take it from there
        self.left[node] -= length

    # ------------------------------------------------------------------ lookups

    def _length(self, copy: Copy) -> int:
        if copy.ranges is None:
            return self.files.get(copy.file, 0)
        return sum(b - a for a, b in copy.ranges)

    def _best_source(self, copy: Copy) -> tuple[int, int, int] | None:
        """The least ``(level, forwarded, rank)`` of the sources that can send ``copy``
        now (None: none can)."""
        here = self.nodes.get(copy.dst)
        now = self.now
        best = None
        for level, rank, node in self.held.get(copy.file, ()):
            if node != here and self.free.get(rank, 0) <= now:
                option = (level, 0, rank)
                if best is None or option < best:
                    best = option
        for ready, rank, node in self.forwards.get(copy.file, ()):
            if (
                ready <= now
                and node != here
                and self.free.get(rank, 0) <= now
                and not (self.bad and CopyFault(node, copy.file) in self.bad)
            ):
                option = (0, 1, rank)
                if best is None or option < best:
                    best = option
        return best

    def _receivers(self, node: int, copy: Copy) -> list[int]:
        """The ranks that may receive ``copy`` on its node: any for a whole file (it
        lands in the node's first level, where all of them read), the plan's one
        for byte ranges (each node's parts copy has one writer)."""
        return self.ranks_of[node] if copy.ranges is None else [copy.dst]

    def _ready_when(self, at: int, file: str) -> None:
        if at not in self.ready:
            heapq.heappush(self.ready_at, at)
        self.ready.setdefault(at, set()).add(file)


@dataclass(frozen=True)
class Hop:
    """One transfer of a ring: ``ring.files[index]`` from rank ``src`` (its copy on
    level ``level``) to rank ``dst``; ``key`` orders every hop of the ring."""

    index: int
    src: int
    dst: int
    level: int
    key: tuple[int, int, int, int]


def lane_rank(ring: Ring, position: int, lane: int) -> int:
    """The rank of the node at ``position`` that carries lane ``lane``."""
    ranks = ring.ranks[position]
    return ranks[lane % len(ranks)]


def ring_origins(
    held: Mapping[int, Mapping[str, int]], files: Mapping[str, int]
) -> tuple[dict[str, int], dict[int, list[str]]]:
    """Where each file that a ring node lacks starts (file -> node), and the files an
    earlier action must bring onto their origin first (node -> files). ``held``: each
    ring node's files. Entries are the files no ring node holds, and those that
    would make every holder send more than its share (a replaced node's files,
    which one partner holds: it would send twice what the others do, round after
    round); they go to the nodes that send least, which lack them (so an entry
    moves no byte the node did not need)."""
    nodes = sorted(held)
    holders: dict[str, list[int]] = {}
    for n in nodes:
        for f in held[n]:
            holders.setdefault(f, []).append(n)
    wanted = [f for f in files if len(holders.get(f, ())) < len(nodes)]
    total = sum(files[f] for f in wanted)
    # Each node's share, and half a file more: files differ a little in size, and
    # moving one for a few bytes would cost a transfer and a step of the ring.
    share = (total + total / max(len(wanted), 1) / 2) / len(nodes)
    load = dict.fromkeys(nodes, 0)
    origins: dict[str, int] = {}
    entries: dict[int, list[str]] = {}
    later = []  # files no holder can send within its share, and those no ring node holds
    # Fewest holders first (their origins are forced), then in node order; each from
    # its lowest level with room (its own node's first level before a partner's copy):
    # a chain of partner copies then shifts by one node, not at random.
    for f in sorted(wanted, key=lambda f: (len(holders.get(f, ())), holders.get(f, [-1])[0], f)):
        size = files[f]
        room = [(held[n][f], n) for n in holders.get(f, ()) if load[n] + size <= share]
        if room:
            origin = min(room)[1]
            origins[f] = origin
            load[origin] += size
        else:
            later.append(f)
    light = [(load[n], n) for n in nodes]  # (load, node), lazily updated
    heapq.heapify(light)
    for f in later:
        have = holders.get(f)
        origin = min(have, key=lambda n: (load[n], n)) if have else None
        while light[0][0] != load[light[0][1]]:
            heapq.heappop(light)  # stale
        lightest = light[0][1]
        if origin is None or load[lightest] < load[origin]:
            origin = lightest  # it lacks the file: else it would be the holder chosen
            entries.setdefault(origin, []).append(f)
        origins[f] = origin
        load[origin] += files[f]
        heapq.heappush(light, (load[origin], origin))
    return origins, entries


def build_ring(
    ranks: Mapping[int, Sequence[int]],
    held: Mapping[int, Mapping[str, int]],
    files: Mapping[str, int],
    origins: Mapping[str, int],
    landed: Mapping[str, int],
) -> Ring:
    """The ring over nodes ``ranks`` (node -> its ranks) for the files ``origins``
    (:func:`ring_origins`), each starting at its node; ``held``: node -> file -> the
    lowest level holding it there; ``landed``: file -> the rank an earlier action
    brought it onto (it sends it first). Lanes are filled by bytes."""
    nodes = tuple(sorted(ranks))
    lanes = tuple(tuple(sorted(ranks[n])) for n in nodes)
    position = {n: i for i, n in enumerate(nodes)}
    m = len(nodes)
    holders: dict[str, dict[int, int]] = {}
    for n in nodes:
        for f, level in held.get(n, {}).items():
            holders.setdefault(f, {})[position[n]] = level
    lane_load = [[0] * len(lanes[p]) for p in range(m)]
    chosen: dict[str, RingFile] = {}
    for f in sorted(origins, key=lambda f: (f not in landed, f)):  # entries' lanes first
        origin, sender = position[origins[f]], landed.get(f)
        others = dict(holders.get(f, {}))
        level = others.pop(origin, 0)
        loads = lane_load[origin]
        lane = loads.index(min(loads))  # the least loaded lane (the first of equals)
        loads[lane] += files[f]
        if sender == lanes[origin][lane]:
            sender = None  # it is the lane's own rank
        span = m - 1
        while span > 0 and (origin + span) % m in others:
            span -= 1  # the ring's last nodes before the origin hold it: it stops earlier
        chosen[f] = RingFile(f, origin, lane, level, span, tuple(sorted(others.items())), sender)
    return Ring(nodes, lanes, tuple(chosen[f] for f in sorted(chosen)))


def _phase(position: int, m: int) -> int:
    return 2 if m % 2 and position == m - 1 else position % 2


def _hop(ring: Ring, index: int, k: int, held: dict[int, int]) -> Hop | None:
    """Hop ``k`` (1-based) of file ``index``; None where its receiver holds the file."""
    rf, m = ring.files[index], len(ring.nodes)
    s, q = (rf.origin + k - 1) % m, (rf.origin + k) % m
    if q in held:
        return None
    level = rf.level if s == rf.origin else held.get(s, 0)
    src, dst = lane_rank(ring, s, rf.lane), lane_rank(ring, q, rf.lane)
    if s == rf.origin and rf.sender is not None:
        src = rf.sender
    return Hop(index, src, dst, level, (k - 1, _phase(s, m), s, index))


def hops(ring: Ring) -> list[Hop]:
    """Every hop of ``ring``, in the order every rank keeps (for simulation and tests;
    ``nodes x files`` of them)."""
    out = []
    for i, rf in enumerate(ring.files):
        held = dict(rf.holders)
        out += [h for k in range(1, rf.hops + 1) if (h := _hop(ring, i, k, held)) is not None]
    out.sort(key=lambda h: h.key)
    return out


def my_hops(ring: Ring, rank: int) -> list[Hop]:
    """The hops rank ``rank`` sends or receives, in order (O(files), not O(hops))."""
    where = [(p, rs.index(rank)) for p, rs in enumerate(ring.ranks) if rank in rs]
    if not where:
        return []
    (p, j), m = where[0], len(ring.nodes)
    out = []
    for i, rf in enumerate(ring.files):
        if rf.lane % len(ring.ranks[p]) != j and rf.sender != rank:
            continue
        held = dict(rf.holders)
        k = (p - rf.origin) % m  # the hop into p (0: p is the origin)
        for hop_k in (k, k + 1):
            h = _hop(ring, i, hop_k, held) if 1 <= hop_k <= rf.hops else None
            if h is not None and rank in (h.src, h.dst):
                out.append(h)
    out.sort(key=lambda h: h.key)
    return out


def received_around(ring: Ring, node: int) -> list[str]:
    """The files ``ring`` brings onto ``node``."""
    if node not in ring.nodes:
        return []
    p, m = ring.nodes.index(node), len(ring.nodes)
    out = []
    for rf in ring.files:
        k = (p - rf.origin) % m
        if 1 <= k <= rf.hops and p not in dict(rf.holders):
            out.append(rf.file)
    return out


def ring_nodes_from_env() -> int | None:
    """``DCP_ML_RING_NODES``, checked (``plan.plan_restore``'s ``ring_nodes``); None: unset."""
    value = os.environ.get("DCP_ML_RING_NODES", "")
    if not value:
        return None
    try:
        return max(2, int(value))
    except ValueError:
        raise ConfigError(
            f"DCP_ML_RING_NODES={value!r}: give a whole number of nodes (rings from that "
            "many nodes that need every file on), or unset it for the default"
        ) from None
