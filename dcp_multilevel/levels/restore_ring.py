"""Files that every node of many needs, passed around a ring: plans O(files), not O(nodes x files).

With replicated (data-parallel) state that the balanced planner spread over
every rank, a node-local first level holds a different part of each
checkpoint on each node, and every node needs every file: as point-to-point
copies that is ``nodes x files`` actions (32 million at 2,000 nodes of 8
ranks), which no planner lists in a second. A :class:`~.actions.Ring` names
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
  one-transfer-at-a-time model of ``plan.simulated_time`` that is the lower
  bound for replicated state (``2 (nodes - 1) x`` a lane's bytes per node).

Every rank carries out the global order restricted to its own hops, so the
argument of ``order.py`` holds: the earliest unfinished hop has both its
ranks waiting on it (no deadlock). The origin of a file several ring nodes
hold is the least loaded of them; lanes are filled by bytes.

Pure: no I/O, no torch.distributed. Call order::

    origins, entries = ring_origins(held, files)      # plan.py: entries are planned first
    ring = build_ring(ranks, held, files, origins, landed)   # once those are ordered
    hops(ring)  /  my_hops(ring, rank)                # simulation / the executor
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .restore_actions import Ring, RingFile

__all__ = [
    "Hop",
    "build_ring",
    "hops",
    "lane_rank",
    "my_hops",
    "received_around",
    "ring_nodes_from_env",
    "ring_origins",
]


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
