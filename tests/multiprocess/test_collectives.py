"""Collectives by node: the restore inventories' exchange gives the
inventories every rank's own all-gathered did, in bytes that do not grow with
ranks x files; a node-local drain's "every rank is done" goes by node.

``simulate_exchange`` runs the exchange's encodings in one process; one test
runs the real one (``gather_inventories`` over gloo) and compares.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
from _dist import run_ranks

from dcp_multilevel import _dist
from dcp_multilevel.errors import DrainError
from dcp_multilevel.levels.base import DrainChannel
from dcp_multilevel.levels.restore_actions import Inventory
from dcp_multilevel.levels.restore_inventory import (
    _inventory,
    gather_inventories,
    simulate_exchange,
)
from dcp_multilevel.levels.restore_plan import merge_node_needs

TOKEN = "5f0c2a9e41d7b386"


def _name(rank: int, n: int = 0) -> str:
    return f"data/{rank}-{n}.{TOKEN}.bin"


def _description(group: int, members: list[int], own: dict[int, list[str]]) -> dict:
    return {
        "group": str(group),
        "data": len(members),
        "parity": 1,
        "stripe": 1 << 22,
        "members": [{"node": m, "files": [[f, 100] for f in own[m]]} for m in members],
        "parity_nodes": [(members[-1] + 1) % 4],
        "checksums": {str(len(members)): ["xxh3:0"]},
    }


def _taken(
    nodes: int, per_node: int, files_per_node: int = 0, *, lost: int = -1
) -> list[Inventory]:
    """Every rank's inventory as taken: a node-local first level, a partner level (the
    node before's files too) and an erasure one (groups of 2 nodes), sharded needs
    (own file, a few bytes of rank 0's), some ranks reading everything; node
    ``lost`` holds nothing. ``files_per_node``: the files each node holds (default:
    one per rank)."""
    count = files_per_node or per_node
    own = {n: [_name(n, i) for i in range(count)] for n in range(nodes)}
    groups = {
        n: {str(n // 2): _description(n // 2, [n - n % 2, n - n % 2 + 1], own)}
        for n in range(nodes)
    }
    placement = [r // per_node for r in range(nodes * per_node)]
    out = []
    for r in range(nodes * per_node):
        n = r // per_node
        if r % 3 == 2:
            needs, ranges = None, {}
        else:
            needs, ranges = sorted({own[n][0], _name(0)}), {_name(0): [[8, 16], [32, 40 + r]]}
        held = {}
        if n != lost:
            held = {
                "files": {0: own[n], 1: sorted(own[n] + own[(n - 1) % nodes]), 2: own[n]},
                "parity": {2: [[str(n // 2), 2]]},
                "groups": {2: groups[n]},
                "placement": placement,
            }
        out.append(
            Inventory(r, n, needs, ranges, parts=n % 2 == 0, whole=[3] if r % 4 else [], **held)
        )
    return out


def _all_gathered(taken: list[Inventory]) -> list[Inventory]:
    """What the exchange gave before (``merge_node_needs`` at each node's lowest rank,
    then every rank's own all-gathered, pickled)."""
    nodes: dict[int, list[Inventory]] = {}
    for inv in taken:
        nodes.setdefault(inv.node, []).append(inv)
    sent = []
    for invs in nodes.values():
        sent.append(merge_node_needs(invs) if len(invs) > 1 else invs[0])
        sent += [replace(inv, needs=[], ranges={}, merged=True) for inv in invs[1:]]
    return [_inventory(asdict(inv)) for inv in sorted(sent, key=lambda i: i.rank)]


@pytest.mark.parametrize(("nodes", "per_node", "lost"), [(4, 3, 1), (4, 1, -1), (2, 4, 0)])
def test_every_rank_gets_the_inventories_the_all_gather_gave(nodes, per_node, lost):
    taken = _taken(nodes, per_node, lost=lost)
    got, _ = simulate_exchange(taken)
    assert got == _all_gathered(taken)


def test_what_every_rank_receives_does_not_grow_with_ranks_per_node():
    # 4 nodes holding 64 files each: 2 ranks or 16 per node. A rank's own says only
    # its rank and store levels; the node's files, groups and placement travel once.
    small = simulate_exchange(_taken(4, 2, 64))[1]
    large = simulate_exchange(_taken(4, 16, 64))[1]
    extra_ranks = 4 * (16 - 2)
    # The placement (an int per rank, once) and a few bytes per rank's entry.
    assert large.everyone - small.everyone < 16 * extra_ranks
    # Were every rank's files sent (what a regression to per-rank lists costs):
    per_rank_files = len(json.dumps({"0": [_name(0, i) for i in range(64 * 3)]}))
    assert large.everyone - small.everyone < per_rank_files * extra_ranks / 50


def test_what_every_rank_receives_grows_with_files_not_ranks_times_files():
    # Twice the nodes (ranks and files): twice the bytes, not four times.
    one = simulate_exchange(_taken(4, 4, 32))[1].everyone
    two = simulate_exchange(_taken(8, 4, 32))[1].everyone
    assert two < 2.2 * one


def test_a_group_description_and_the_placement_travel_once():
    taken = _taken(4, 4, 32)
    moved = simulate_exchange(taken)[1]
    without = simulate_exchange([replace(inv, groups={}, placement=None) for inv in taken])[1]
    descs = {g: d for inv in taken for gs in inv.groups.values() for g, d in gs.items()}
    once = sum(len(json.dumps(d)) for d in descs.values()) + len(json.dumps(taken[0].placement))
    assert moved.everyone - without.everyone < once + 400  # the indices naming them
    # Rank 0 gets the placement from itself (it holds it): the records carry digests.
    assert moved.at_root - without.at_root < sum(len(json.dumps(d)) * 2 for d in descs.values())


def test_before_every_rank_received_ranks_times_the_largest_inventory():
    # What the bench compares with: all_gather_object pads each pickle to the largest,
    # so 16 ranks per node received 8 times what 2 did; by node, the same.
    received = {}
    for per_node in (2, 16):
        taken = _taken(4, per_node, 64)
        largest = max(_dist.pickled_size(asdict(inv)) for inv in _all_gathered(taken))
        ranks = len(taken)
        received[per_node] = (8 * ranks + ranks * largest, simulate_exchange(taken)[1].everyone)
    assert received[16][0] > 7 * received[2][0]
    assert received[16][1] < 1.1 * received[2][1] < received[2][0]
    assert received[16][1] * 10 < received[16][0]


def _exchange_job(rank: int, world_size: int, nodes: list[int]) -> list[dict]:
    per_node = world_size // len(set(nodes))
    taken = _taken(len(set(nodes)), per_node, lost=1)
    group = _dist.new_group(60)
    members = [r for r in range(world_size) if nodes[r] == nodes[rank]]
    return [asdict(inv) for inv in gather_inventories(taken[rank], members, group)]


@pytest.mark.multiprocess
def test_the_exchange_over_gloo_gives_every_rank_the_simulated_inventories():
    nodes = [0, 0, 1, 1]
    got = run_ranks(_exchange_job, 4, nodes, timeout=60)
    want = [asdict(inv) for inv in simulate_exchange(_taken(2, 2, lost=1))[0]]
    assert got == [want] * 4


def _done_job(rank: int, world_size: int, nodes: list[int], failing: int) -> str:
    link = DrainChannel("d1", timeout_s=30)
    if rank == failing:
        link.fail(RuntimeError("disk full"))
    else:
        link.done()
    if nodes.index(nodes[rank]) != rank:  # only each node's lowest rank waits
        return "member"
    try:
        link.wait_all_done(nodes)
    except DrainError as e:
        link.fail(e)  # as run_one does: the failure travels on
        return str(e)
    return "all done"


@pytest.mark.multiprocess
def test_every_nodes_lowest_rank_learns_that_all_are_done_or_which_failed():
    # Two nodes of two ranks; rank 3 (node 1) fails: its node's lowest rank says so,
    # then rank 0, then every node's lowest rank, without waiting out the timeout.
    nodes = [0, 0, 1, 1]
    assert run_ranks(_done_job, 4, nodes, -1, timeout=60) == ["all done", "member"] * 2
    got = run_ranks(_done_job, 4, nodes, 3, timeout=60)
    why = "done/3: rank 3 failed: RuntimeError: disk full"
    assert got[2] == why
    assert got[0] == f"node-done/2: rank 2 failed: DrainError: {why}"
