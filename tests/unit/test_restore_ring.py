"""Rings: files that every node of many needs, planned once per file.

Pure planning against the point-to-point planner it replaces at scale (kept
as the reference: ``ring_nodes`` above the node count), on random small
topologies; the executor's side (each rank's hops) against the ring's order.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel.errors import ConfigError
from dcp_multilevel.levels.erasure import ErasureRebuilder
from dcp_multilevel.levels.restore_actions import Copy, Inventory, Link, Rebuild, Ring
from dcp_multilevel.levels.restore_plan import (
    RING_NODES,
    expand_rings,
    hops,
    my_hops,
    plan_restore,
    received_around,
    simulated_time,
)

URLS = ["/l1", "partner:/p", "erasure:/e"]
COPIES = 10_000  # ring_nodes above any node count here: today's point-to-point plan


def _topology(rnd: random.Random, nodes: int, per_node: int, per_rank: int):
    """Every rank reads every file (replicated state); each node holds a random share
    of them on levels 0 and 1, some nodes none (replaced); every file somewhere."""
    ranks = nodes * per_node
    files = {f"data/{i}-0.t.bin": rnd.randint(0, 500) for i in range(ranks * per_rank)}
    empty = set(rnd.sample(range(nodes), rnd.randint(0, nodes - 1)))
    full = [n for n in range(nodes) if n not in empty]
    held = {n: {0: [], 1: []} for n in range(nodes)}
    for f in files:
        for n in rnd.sample(full, rnd.randint(1, len(full))):
            held[n][rnd.choice((0, 0, 1))].append(f)
    invs = [
        Inventory(n * per_node + r, n, None, files={lv: sorted(fs) for lv, fs in held[n].items()})
        for n in range(nodes)
        for r in range(per_node)
    ]
    return files, invs


def _walk(plan, files, invs):
    """Carry ``plan`` out on paper: every copy's sender holds the file by then (a rank
    holds its node's files from before, and what it received or rebuilt itself);
    return what each node received (file -> count) and holds at the end."""
    node_of = {inv.rank: inv.node for inv in invs}
    before = {inv.node: {f for fs in inv.files.values() for f in fs} for inv in invs}
    holds = {inv.rank: set(before[inv.node]) for inv in invs}
    before = {n: set(fs) for n, fs in before.items()}
    got: dict[int, dict[str, int]] = {n: {} for n in before}
    for action in expand_rings(plan.actions):
        if isinstance(action, Copy):
            assert action.file in holds[action.src], action
            assert node_of[action.src] != node_of[action.dst], action
            holds[action.dst].add(action.file)
            into = got[node_of[action.dst]]
            into[action.file] = into.get(action.file, 0) + 1
        elif isinstance(action, Rebuild):
            holds[action.dst].update(action.brings)
            before[node_of[action.dst]].update(action.brings)  # (the walk's own copy)
        else:
            assert isinstance(action, Link)
    final = {n: set(before[n]) | set(got[n]) for n in before}
    return got, final, before


@settings(max_examples=120, deadline=None)
@given(st.integers(2, 7), st.integers(1, 3), st.integers(1, 3), st.randoms(use_true_random=False))
def test_a_ring_brings_every_file_once_and_moves_no_more_bytes_than_copies(
    nodes, per_node, per_rank, rnd
):
    files, invs = _topology(rnd, nodes, per_node, per_rank)
    ring = plan_restore(7, files, invs, URLS, ring_nodes=2)
    copies = plan_restore(7, files, invs, URLS, ring_nodes=COPIES)
    assert ring.ok and copies.ok
    assert not any(isinstance(a, Ring) for a in copies.actions)
    got, final, before = _walk(ring, files, invs)
    got_copies, _, _ = _walk(copies, files, invs)
    for n in before:
        assert final[n] == set(files)  # every node ends with every file
        assert all(count == 1 for count in got[n].values())  # each once
        assert not set(got[n]) & before[n]  # and none it had
        mine = sum(files[f] for f in got[n])
        assert mine <= sum(files[f] for f in got_copies[n])
    # The default keeps the faster of the two at this size (from RING_NODES nodes).
    default = plan_restore(7, files, invs, URLS)
    best = simulated_time(copies.actions, files)
    if nodes >= RING_NODES:
        best = min(best, simulated_time(ring.actions, files))
    assert simulated_time(default.actions, files) == best


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(1, 4), st.randoms(use_true_random=False))
def test_each_rank_carries_out_exactly_its_hops_in_the_rings_order(nodes, per_node, rnd):
    files, invs = _topology(rnd, nodes, per_node, rnd.randint(1, 2))
    plan = plan_restore(7, files, invs, URLS, ring_nodes=2)
    rings = [a for a in plan.actions if isinstance(a, Ring)]
    for ring in rings:
        every = hops(ring)
        for inv in invs:
            mine = [h for h in every if inv.rank in (h.src, h.dst)]
            assert my_hops(ring, inv.rank) == mine
        for n in ring.nodes:  # what the restore report counts
            into = {inv.rank for inv in invs if inv.node == n}
            arrived = sorted(ring.files[h.index].file for h in every if h.dst in into)
            assert sorted(received_around(ring, n)) == arrived


def test_replicated_state_on_many_nodes_is_one_ring_not_a_copy_per_node_and_file():
    # 100 nodes of 4 ranks, a file per rank on its node, node 7 replaced, its files
    # on the next node's partner level: every node needs every file.
    nodes, per_node = 100, 4
    own = {n: [f"data/{n * per_node + r}-0.t.bin" for r in range(per_node)] for n in range(nodes)}
    files = {f: 1000 for fs in own.values() for f in fs}
    invs = []
    for n in range(nodes):
        held = {} if n == 7 else {0: own[n], 1: sorted(own[n] + own[(n - 1) % nodes])}
        invs += [Inventory(n * per_node + r, n, None, files=held) for r in range(per_node)]
    plan = plan_restore(7, files, invs, URLS)
    (ring,) = [a for a in plan.actions if isinstance(a, Ring)]
    assert len(ring.files) == len(files) and len(ring.nodes) == nodes
    copies = [a for a in plan.actions if isinstance(a, Copy)]
    # The replaced node sends its share too: files it lacks anyway enter the ring there
    # (the partner copies shift the others' origins by one node, around to it).
    assert len(copies) == per_node and {c.dst // per_node for c in copies} == {7}
    # Lanes: each node's ranks send their share side by side.
    per_lane = [sum(1 for f in ring.files if f.origin == 0 and f.lane == j) for j in range(4)]
    assert max(per_lane) - min(per_lane) <= 1


def test_sharded_state_makes_no_ring():
    # Each rank reads its own file: the replaced node fetches its 2 files, nothing else.
    nodes = 6
    own = {n: [f"data/{2 * n + r}-0.t.bin" for r in range(2)] for n in range(nodes)}
    files = {f: 100 for fs in own.values() for f in fs}
    invs = []
    for n in range(nodes):
        held = {} if n == 2 else {0: own[n], 1: sorted(own[n] + own[(n - 1) % nodes])}
        invs += [Inventory(2 * n + r, n, [own[n][r]], files=held) for r in range(2)]
    plan = plan_restore(7, files, invs, URLS, ring_nodes=2)
    assert sorted((a.file, a.src // 2, a.dst // 2) for a in plan.actions) == [
        (f, 3, 2) for f in own[2]
    ]


def test_erasure_members_rebuilt_once_enter_the_ring_on_the_rebuilding_rank():
    from test_restore_plan import _erasure_inventories

    files, invs = _erasure_inventories(6, 2, 1, lost={1})
    plan = plan_restore(7, files, invs, URLS, rebuilders={2: ErasureRebuilder()}, ring_nodes=2)
    assert plan.ok, plan.reasons
    (rebuild,) = [a for a in plan.actions if isinstance(a, Rebuild)]
    (ring,) = [a for a in plan.actions if isinstance(a, Ring)]
    assert plan.actions.index(rebuild) < plan.actions.index(ring)
    lost = ring.files[[f.file for f in ring.files].index("data/1-0.t.bin")]
    assert ring.nodes[lost.origin] == rebuild.dst  # one rank per node: rank = node
    _, final, _ = _walk(plan, files, invs)
    assert all(got == set(files) for got in final.values())


@pytest.mark.parametrize("value", ["many", "1.5"])
def test_a_bad_ring_setting_is_named(monkeypatch, value):
    monkeypatch.setenv("DCP_ML_RING_NODES", value)
    files = {"data/0-0.t.bin": 1}
    invs = [Inventory(0, 0, None, files={0: ["data/0-0.t.bin"]})]
    with pytest.raises(ConfigError, match="DCP_ML_RING_NODES"):
        plan_restore(7, files, invs, URLS)
