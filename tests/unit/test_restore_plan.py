"""Restore planning (pure), erasure group layout, and the byte-stream functions of the
node-local levels: what each node must fetch, from where, and what cannot be had."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dcp_multilevel import ConfigError, Level
from dcp_multilevel.levels import driver_for
from dcp_multilevel.levels.erasure import ErasureRebuilder, group_layout, rechunk
from dcp_multilevel.levels.erasure_code import ErasureCode
from dcp_multilevel.levels.restore_actions import Copy, CopyFault, Inventory, Link, Rebuild
from dcp_multilevel.levels.restore_plan import (
    expand_rings,
    merge_node_needs,
    merge_ranges,
    simulated_time,
)
from dcp_multilevel.levels.restore_plan import plan_restore as _plan_restore
from dcp_multilevel.levels.topology import Topology

URLS = ["/l1", "partner:/p", "erasure:/e", "s3://remote"]
#: Level 2 (erasure) rebuilds lost members: its kind's rebuilder, as a job's driver has it.
REBUILDERS = {2: ErasureRebuilder()}


def plan_restore(*args, **kwargs):
    """The planner as a job with these levels calls it (with level 2's rebuilder), its
    rings as the copies of their hops (``test_restore_ring.py`` checks rings as such)."""
    plan = _plan_restore(*args, rebuilders=REBUILDERS, **kwargs)
    return dataclasses.replace(plan, actions=tuple(expand_rings(plan.actions)))


def _files(ranks: int) -> dict[str, int]:
    return {f"data/{r}-0.t.bin": 100 + r for r in range(ranks)}


# --------------------------------------------------------------------------- copies


def test_nothing_to_do_when_every_node_holds_what_it_needs():
    files = _files(2)
    invs = [Inventory(r, r, None, files={0: sorted(files)}) for r in range(2)]
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok and plan.actions == ()


def test_a_replaced_node_copies_from_the_lowest_level_then_the_lowest_rank():
    files = _files(4)
    names = sorted(files)
    invs = [
        Inventory(0, 0, None, files={0: names[:2], 1: names}),
        Inventory(1, 0, None, files={0: names[:2], 1: names}),
        Inventory(2, 1, None),  # a new, empty disk
        Inventory(3, 1, None),
    ]
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok
    # Node 0 links node 1's copies into its first level; node 1 gets node 0's own
    # files from node 0's first level, the rest from copies. Both ranks of each node
    # take part, two transfers at a time (whole files land in the node's first
    # level, where every rank of it reads).
    assert list(plan.actions) == [
        Link(names[2], 1, 0),
        Link(names[3], 1, 0),
        Copy(names[0], 0, 0, 2),
        Copy(names[1], 0, 1, 3),
        Copy(names[2], 1, 0, 2),
        Copy(names[3], 1, 1, 3),
    ]
    assert simulated_time(plan.actions, files) == files[names[1]] + files[names[3]]  # not all 4


def test_only_the_files_a_node_needs_are_fetched():
    files = _files(2)
    names = sorted(files)
    invs = [
        Inventory(0, 0, [names[0]], files={0: [names[0]], 1: [names[1]]}),
        Inventory(1, 1, [names[1]]),
    ]
    plan = plan_restore(7, files, invs, URLS)
    assert list(plan.actions) == [Copy(names[1], 1, 0, 1)]


def test_a_damaged_source_is_left_out_and_a_store_level_covers_the_rest():
    files = _files(2)
    names = sorted(files)
    invs = [
        Inventory(0, 0, None, files={0: [names[0]], 1: names}, whole=[3]),
        Inventory(1, 1, None, whole=[3]),
    ]
    bad = {CopyFault(0, names[1])}
    plan = plan_restore(7, files, invs, URLS, bad)
    assert plan.ok
    assert Copy(names[1], 1, 0, 1) not in plan.actions  # the remote serves it
    assert Copy(names[0], 0, 0, 1) in plan.actions
    # Without the store level the step cannot be restored, and the reasons say why.
    for inv in invs:
        inv.whole = []
    plan = plan_restore(7, files, invs, URLS, bad)
    assert not plan.ok and plan.actions == ()
    # Node 0's own copy is the damaged one: neither node can have the file.
    assert list(plan.reasons[:2]) == [
        f"node {n} (ranks [{n}]) lacks 1 file(s) of step 7 that no node holds and no level can "
        f"rebuild (e.g. {names[1]})"
        for n in (0, 1)
    ]
    assert f"partner:/p: no node here holds a copy of {names[1]}" in plan.reasons


def test_a_node_that_needs_a_few_items_of_a_file_gets_only_their_bytes():
    # Files of 100 bytes: node 1 reads 20 bytes of node 0's file (a replicated
    # value stored there), in two pieces; it gets those ranges, merged and sorted.
    files = {"data/0-0.t.bin": 100, "data/1-0.t.bin": 100}
    a, b = sorted(files)
    invs = [
        Inventory(0, 0, [a], {a: [[0, 100]]}, parts=True, files={0: [a]}),
        Inventory(1, 1, [a, b], {a: [[40, 50]], b: [[0, 100]]}, parts=True, files={0: [b]}),
        Inventory(2, 1, [a, b], {a: [[10, 15], [15, 20]], b: [[0, 100]]}, parts=True),
    ]
    plan = plan_restore(7, files, invs, URLS)
    assert list(plan.actions) == [Copy(a, 0, 0, 1, ((10, 20), (40, 50)))]
    # More than PART_SHARE of the file: the whole file.
    invs[2].ranges = {a: [[0, 55]], b: [[0, 100]]}
    assert list(plan_restore(7, files, invs, URLS).actions) == [Copy(a, 0, 0, 1)]
    # A rank that reads a file mostly sends no ranges for it (take_inventory keeps
    # only those of files read in part): the node gets it whole.
    invs[2].ranges = {b: [[0, 100]]}
    assert list(plan_restore(7, files, invs, URLS).actions) == [Copy(a, 0, 0, 1)]
    # The receiver's first level cannot take parts, or a rank's needs are unknown:
    # the whole file.
    invs[2].ranges = {a: [[10, 20]], b: [[0, 100]]}
    invs[1].parts = False
    assert list(plan_restore(7, files, invs, URLS).actions) == [Copy(a, 0, 0, 1)]
    invs[1].parts, invs[2].ranges = True, None
    assert list(plan_restore(7, files, invs, URLS).actions) == [Copy(a, 0, 0, 1)]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_plan_from_inventories_merged_per_node_is_the_plan_from_every_ranks_own(data):
    """The exchange carries each node's needs and ranges in its lowest rank's
    inventory (merge_node_needs): any mix of ranks that read files whole, in
    part or not at all, with needs known or not, gives the same plan, and the
    other ranks of a node send no ranges."""
    nodes = data.draw(st.integers(2, 4))
    per_node = data.draw(st.integers(1, 3))
    files = {f"data/{n}-0.t.bin": 1000 for n in range(nodes)}
    names = sorted(files)
    lost = data.draw(st.integers(0, nodes - 1))
    invs = []
    for rank in range(nodes * per_node):
        node = rank // per_node
        needs: dict[str, list[list[int]]] = {}
        for f in names:
            kind = data.draw(st.sampled_from(["none", "whole", "part"]))
            if kind == "whole":
                needs[f] = [[0, 1000]]
            elif kind == "part":
                start = data.draw(st.integers(0, 990))
                needs[f] = [[start, start + data.draw(st.integers(1, 10))]]
        partly = {f: r for f, r in needs.items() if r != [[0, 1000]]}
        unknown = data.draw(st.integers(0, 9)) == 0
        # Each node holds its own file and a partner copy of the next node's.
        held = {0: [names[node]], 1: [names[(node + 1) % nodes]]}
        invs.append(
            Inventory(
                rank,
                node,
                None if unknown else sorted(needs),
                None if unknown else partly,
                parts=True,
                files={} if node == lost else held,
            )
        )
    merged = []
    for node in range(nodes):
        mine = [inv for inv in invs if inv.node == node]
        merged.append(merge_node_needs(mine))
        merged += [dataclasses.replace(i, needs=[], ranges={}, merged=True) for i in mine[1:]]
    merged.sort(key=lambda inv: inv.rank)
    plan = plan_restore(3, files, invs, URLS)
    assert plan.ok and plan_restore(3, files, merged, URLS) == plan
    event("items only" if any(getattr(a, "ranges", None) for a in plan.actions) else "files")
    assert all(inv.ranges == {} for inv in merged if inv.merged)


def test_a_lost_member_is_rebuilt_where_it_is_needed_whole_and_others_take_items_from_it():
    # RS(2+1) on 3 nodes, node 1 replaced: node 0 needs a few items of node 1's
    # file, node 1 (its shards) all of it. Node 1 rebuilds its member, node 0
    # then takes the items from node 1, not a whole rebuilt member of its own.
    files, invs = _erasure_inventories(3, 2, 1, lost={1})
    mine, theirs = "data/0-0.t.bin", "data/1-0.t.bin"
    for inv in invs:
        inv.parts = True
        inv.ranges = {f: [[0, size]] for f, size in files.items()}
        inv.needs = None
    invs[0].ranges = {mine: [[0, files[mine]]], theirs: [[3, 9]]}
    invs[0].needs = [mine, theirs]
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok, plan.reasons
    rebuilds = [a for a in plan.actions if isinstance(a, Rebuild)]
    assert [r.dst for r in rebuilds] == [1]
    assert Copy(theirs, 0, 1, 0, ((3, 9),)) in plan.actions
    assert plan.actions.index(Copy(theirs, 0, 1, 0, ((3, 9),))) > plan.actions.index(rebuilds[0])


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=12))
def test_merged_ranges_cover_exactly_the_same_bytes(pieces):
    ranges = [(a, a + n) for a, n in pieces]
    merged = merge_ranges(ranges)
    covered = {x for a, b in ranges for x in range(a, b)}
    assert {x for a, b in merged for x in range(a, b)} == covered
    # Sorted, disjoint and not touching (touching ones are one range).
    assert all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(merged))


def test_without_transfers_only_what_a_node_sees_and_store_levels_count():
    files = _files(2)
    names = sorted(files)
    invs = [Inventory(0, 0, None, files={0: names}), Inventory(1, 1, None, files={0: [names[1]]})]
    assert not plan_restore(7, files, invs, URLS, transfers=False).ok
    invs[1].whole = [3]
    assert plan_restore(7, files, invs, URLS, transfers=False).ok


# --------------------------------------------------------------------------- erasure


def _erasure_inventories(
    nodes: int, data: int, parity: int, lost: set[int]
) -> tuple[dict[str, int], list[Inventory]]:
    """One rank per node, the erasure level at index 2; ``lost`` nodes are empty."""
    files = _files(nodes)
    layout = group_layout(list(range(nodes)), data, parity)
    descs = {}
    for g, (members, keepers) in enumerate(layout):
        descs[str(g)] = {
            "group": str(g),
            "data": len(members),
            "parity": parity,
            "chunk": 64,
            "stripe": 128,
            "parity_nodes": keepers,
            "members": [{"node": n, "files": [[f"data/{n}-0.t.bin", 100 + n]]} for n in members],
        }
    invs = []
    for node in range(nodes):
        if node in lost:
            invs.append(Inventory(node, node, None))
            continue
        own = [f"data/{node}-0.t.bin"]
        mine = {
            g: d
            for g, d in descs.items()
            if node in d["parity_nodes"] or node in [m["node"] for m in d["members"]]
        }
        held = [
            [g, d["data"] + d["parity_nodes"].index(node)]
            for g, d in descs.items()
            if node in d["parity_nodes"]
        ]
        invs.append(
            Inventory(
                node,
                node,
                None,
                files={0: own, 2: own},
                parity={2: held},
                groups={2: mine},
                placement=list(range(nodes)),
            )
        )
    return files, invs


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 9), st.integers(1, 4), st.integers(1, 3), st.randoms(use_true_random=False))
def test_any_parity_lost_nodes_are_rebuilt_and_one_more_in_a_group_is_not(nodes, data, parity, rnd):
    if nodes < data + parity:
        with pytest.raises(ConfigError, match=f"needs at least {data + parity} nodes"):
            group_layout(list(range(nodes)), data, parity)
        return
    layout = group_layout(list(range(nodes)), data, parity)
    for members, keepers in layout:  # parity never on a node of its own group
        assert not set(members) & set(keepers) and len(set(keepers)) == parity
    lost = set(rnd.sample(range(nodes), rnd.randint(1, parity)))
    files, invs = _erasure_inventories(nodes, data, parity, lost)
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok, plan.reasons
    # Walking the plan in order (as every rank does), every copy's source holds the
    # file by then, every rebuild reads intact blocks only, each lost member is
    # rebuilt once (then copied), and every node ends with every file.
    holds = {inv.rank: {f for fs in inv.files.values() for f in fs} for inv in invs}
    rebuilt_members = []
    for action in plan.actions:
        if isinstance(action, Copy):
            assert action.file in holds[action.src]
            holds[action.dst].add(action.file)
        elif isinstance(action, Rebuild):
            assert all(rank not in lost for _, rank in action.sources)
            assert len(action.sources) == len(layout[int(action.group)][0])
            members_of = layout[int(action.group)][0]
            rebuilt_members += [(action.group, y) for y in action.members]
            holds[action.dst] |= {f"data/{members_of[y]}-0.t.bin" for y in action.members}
    assert len(rebuilt_members) == len(set(rebuilt_members))
    assert all(got == set(files) for got in holds.values())
    # A level whose kind brings no rebuilder is never asked to rebuild.
    assert not _plan_restore(7, files, invs, URLS).ok
    # One more loss inside a group than its parity: not restorable, the group is named.
    members, keepers = layout[0]
    blocks = members + keepers
    too_many = set(blocks[: parity + 1])
    files, invs = _erasure_inventories(nodes, data, parity, too_many)
    plan = plan_restore(7, files, invs, URLS)
    assert not plan.ok
    if len(members) > 1:  # else every node that knew the group is gone with it
        assert any("erasure:/e: step 7: group 0: RS(" in r for r in plan.reasons), plan.reasons


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("level", "message"),
    [
        (Level("partner:"), "names no directory"),
        (Level("partner:s3://b/p"), "is not a local path"),
        (Level("partner:/p", codec="zstd"), "keeps the first level's files byte for byte"),
        (Level("partner:/p", replicas=1), "needs replicas >= 2"),
        (Level("partner:/p", data=2), "a partner level takes ['replicas', 'jump']"),
        (Level("erasure:/e", data=2), "needs data= and parity="),
        (
            Level("/plain", replicas=2),
            "sets ['replicas']: options of a level kind (Level('<kind>:...')), which "
            "StoreLevel does not take",
        ),
    ],
)
def test_bad_node_level_options_are_named(level, message):
    with pytest.raises(ConfigError) as info:
        driver_for(level)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("level", "topology", "message"),
    [
        (Level("partner:/p"), Topology((0, 0)), "every rank is on node 0"),
        (Level("partner:/p", replicas=3), Topology((0, 1)), "replicas=3 needs 3 nodes"),
        (Level("partner:/p", jump=2), Topology((0, 1)), "jump=2 places copies on the same node"),
        (Level("erasure:/e", data=2, parity=2), Topology((0, 1, 2)), "needs at least 4 nodes"),
    ],
)
def test_copies_on_the_same_node_are_refused(level, topology, message):
    with pytest.raises(ConfigError) as info:
        driver_for(level).check_topology(topology)
    assert message in str(info.value)


def test_kind_options_must_be_positive_integers():
    with pytest.raises(ConfigError, match=r"replicas must be an integer >= 1, got 0"):
        Level("partner:/p", replicas=0)


# --------------------------------------------------------------------------- streams


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=6), st.integers(1, 16), st.integers(0, 3))
def test_rechunk_keeps_the_bytes_and_pads_to_whole_chunks(pieces, chunk, extra):
    total = sum(map(len, pieces))
    length = (-(-total // chunk) + extra) * chunk
    out = b"".join(bytes(c) for c in rechunk((memoryview(p) for p in pieces), chunk, length))
    assert out == b"".join(pieces) + bytes(length - total)


@pytest.mark.parametrize(("data", "parity"), [(2, 1), (3, 2)])
def test_chunk_coding_matches_the_whole_member_code(data, parity):
    rng = random.Random(data * 10 + parity)
    code = ErasureCode(data, parity, chunk=32)
    members = [rng.randbytes(96) for _ in range(data)]
    whole = [[p.data for p in chunks] for chunks in code.encode(members)]
    for index in range(3):
        pieces = [m[index * 32 : (index + 1) * 32] for m in members]
        parity_pieces = code.encode_chunk(pieces)
        assert parity_pieces == whole[index]
        blocks = pieces + parity_pieces
        for keep in itertools.combinations(range(data + parity), data):
            decoded = code.decode_chunk([blocks[b] for b in keep], list(keep))
            assert decoded == pieces


def test_node_local_levels_need_a_first_level_on_the_nodes_own_disk():
    from dcp_multilevel import CheckpointManager

    with pytest.raises(ConfigError, match="must be a path on each node's own disk"):
        CheckpointManager([Level("memory://bucket/l1"), Level("partner:/p")])


def test_empty_files_are_planned_like_others():
    # A rank may write an empty data file. Copies of empty files end at once: the
    # simulation once ran out of copies with no transfer left to wait for, and
    # raised StopIteration instead of returning the plan.
    nodes = 3
    files = {f"data/{n}-0.t.bin": 0 for n in range(nodes)} | {"data/9-0.t.bin": 100}
    invs = [Inventory(n, n, None, files={0: [f"data/{n}-0.t.bin"]}) for n in range(nodes)]
    invs[0].files[0].append("data/9-0.t.bin")
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok
    held = {(inv.node, f) for inv in invs for f in inv.files[0]}
    brought = {(a.dst, a.file) for a in plan.actions}
    assert held | brought == {(n, f) for n in range(nodes) for f in files}
    assert not held & brought


def test_transfers_between_different_nodes_run_at_once():
    # Node-local first levels, replicated state: every node needs every node's file.
    nodes, size = 6, 100
    files = {f"data/{n}-0.t.bin": size for n in range(nodes)}
    invs = [Inventory(n, n, None, files={0: [f"data/{n}-0.t.bin"]}) for n in range(nodes)]
    plan = plan_restore(7, files, invs, URLS)
    assert len(plan.actions) == nodes * (nodes - 1)
    # A rank moves one file at a time and takes part in 2 (nodes - 1) copies on
    # average: that long at best. Node after node, the copies wait on each other.
    best = 2 * (nodes - 1) * size
    assert simulated_time(plan.actions, files) <= 1.15 * best  # 11 units of 10
    assert simulated_time(sorted(plan.actions, key=lambda a: a.dst), files) > 2 * best
    # Files are forwarded: not every node sends its own file to every other node.
    assert any(a.file != f"data/{a.src}-0.t.bin" for a in plan.actions)


def test_a_rebuilt_member_is_forwarded_by_the_nodes_that_receive_it():
    # RS(2+1) on 4 nodes, one rank each, replicated state, node 1 replaced: its
    # member is rebuilt once; then every node needs it, and the others' files.
    files, invs = _erasure_inventories(4, 2, 1, lost={1})
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok, plan.reasons
    (rebuild,) = [a for a in plan.actions if isinstance(a, Rebuild)]
    lost = "data/1-0.t.bin"
    takers = [a for a in plan.actions if isinstance(a, Copy) and a.file == lost]
    assert sorted(a.dst for a in takers) == sorted({0, 1, 2, 3} - {rebuild.dst})
    assert {a.src for a in takers} != {rebuild.dst}  # not all from the rebuilding node
    # 12 copies and a rebuild (2 units in simulated_time's model): 14 units, each
    # keeping two of the 4 ranks busy, so 7 at best; each holder sending its
    # file to every node (before) took 10.
    assert simulated_time(plan.actions, files) <= 8 * max(files.values())


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.integers(1, 3),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_every_copy_comes_from_a_rank_that_holds_the_file_by_then(nodes, per_node, n_files, rnd):
    # Several ranks per node, files on random nodes and levels (a node may hold
    # none), random needs: a forwarded copy must come from the very rank that
    # received it (the others of its node do not wait for that receive), and
    # every node ends with what its ranks need.
    files = {f"data/{i}-0.t.bin": rnd.randint(1, 300) for i in range(n_files * nodes)}
    where = {f: rnd.sample(range(nodes), rnd.randint(1, nodes)) for f in files}
    held = [
        {lvl: sorted(f for f in files if node in where[f] and rnd.random() < 0.7) for lvl in (0, 1)}
        for node in range(nodes)
    ]
    for f in files:  # every file somewhere
        if not any(f in fs for h in held for fs in h.values()):
            held[where[f][0]][0].append(f)
    invs = []
    for node in range(nodes):
        for r in range(per_node):
            needs = sorted(rnd.sample(sorted(files), rnd.randint(0, len(files))))
            invs.append(Inventory(node * per_node + r, node, needs, files=held[node]))
    plan = plan_restore(7, files, invs, URLS)
    assert plan.ok, plan.reasons
    holds = {inv.rank: {f for fs in inv.files.values() for f in fs} for inv in invs}
    node_of = {inv.rank: inv.node for inv in invs}
    got = {inv.node: set(holds[inv.rank]) for inv in invs}
    for action in plan.actions:
        if isinstance(action, Copy):
            assert action.file in holds[action.src] and node_of[action.src] != node_of[action.dst]
            assert action.file in (invs[action.src].files.get(action.level, ())) or (
                action.level == 0 and action.file not in invs[action.src].files.get(0, ())
            )
            holds[action.dst].add(action.file)
            got[node_of[action.dst]].add(action.file)
        elif isinstance(action, Link):
            got[node_of[action.dst]].add(action.file)
    for inv in invs:
        assert set(inv.needs or ()) <= got[inv.node]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=8))
def test_a_file_streamed_in_any_blocks_is_checked_item_by_item(tmp_path_factory, cuts):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_multilevel import MultiLevelWriter
    from dcp_multilevel.checkpoint import StoredCheckpoint
    from dcp_multilevel.errors import ChecksumMismatchError, TruncatedDataError
    from dcp_multilevel.levels.wire import FileVerifier

    root = tmp_path_factory.mktemp("ckpt")
    state = {"a": torch.arange(1000.0), "b": torch.zeros(0), "c": torch.ones(700)}
    dcp.save(state, storage_writer=MultiLevelWriter(str(root)))
    ckpt = StoredCheckpoint.at(str(root))
    (file,) = ckpt.manifest().files
    data = bytearray((root / file).read_bytes())

    def stream(buf: bytes) -> None:
        verifier, pos = FileVerifier(ckpt, file), 0
        for n in [*cuts, len(buf)]:  # arbitrary blocks, then the rest
            verifier.feed(pos, memoryview(buf)[pos : pos + n])
            pos = min(len(buf), pos + n)
        verifier.finish()

    stream(bytes(data))  # intact: every item checks out
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch for item"):
        stream(bytes(flipped))
    with pytest.raises(TruncatedDataError, match="ended at byte"):
        verifier = FileVerifier(ckpt, file)
        verifier.feed(0, memoryview(bytes(data))[:100])
        verifier.finish()


def test_ranges_of_a_file_are_read_with_only_their_items_checked(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_multilevel import MultiLevelWriter
    from dcp_multilevel.checkpoint import StoredCheckpoint
    from dcp_multilevel.errors import ChecksumMismatchError
    from dcp_multilevel.levels.wire import range_blocks

    state = {"a": torch.arange(1000.0), "b": torch.zeros(0), "c": torch.ones(700), "d": 5}
    dcp.save(state, storage_writer=MultiLevelWriter(str(tmp_path)))
    ckpt = StoredCheckpoint.at(str(tmp_path))
    (file,) = ckpt.manifest().files
    locs = {i.fqn: loc for i, loc in ckpt.manifest().locations.items()}
    extent = lambda fqn: (locs[fqn].offset, locs[fqn].offset + locs[fqn].length)  # noqa: E731
    ranges = merge_ranges([extent("c"), extent("d"), extent("b")])
    data = (tmp_path / file).read_bytes()
    got = b"".join(bytes(v) for v in range_blocks(ckpt, file, ranges, block=333))
    assert got == b"".join(data[a:b] for a, b in ranges)
    # A flipped byte outside the ranges is not read; inside them it is caught.
    flipped = bytearray(data)
    flipped[locs["a"].offset] ^= 1
    (tmp_path / file).write_bytes(bytes(flipped))
    assert b"".join(bytes(v) for v in range_blocks(ckpt, file, ranges)) == got
    flipped[locs["c"].offset + 5] ^= 1
    (tmp_path / file).write_bytes(bytes(flipped))
    with pytest.raises(ChecksumMismatchError, match="item 'c'"):
        for _ in range_blocks(ckpt, file, ranges):
            pass


def test_an_inventory_carries_ranges_only_for_files_read_in_part(tmp_path):
    # A rank that reads every byte (replicated state) sends no ranges at all: the
    # exchange stays as small as a file list; a rank that reads a few items of
    # a file sends those, and nothing for the files it reads whole.
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_multilevel import MultiLevelWriter
    from dcp_multilevel.checkpoint import StoredCheckpoint
    from dcp_multilevel.levels.restore_inventory import needed_ranges, split_needs

    state = {"w": torch.arange(4096.0), "step": torch.tensor(3.0), "v": torch.ones(2048)}
    dcp.save(state, storage_writer=MultiLevelWriter(str(tmp_path)))
    manifest = StoredCheckpoint.at(str(tmp_path)).manifest()
    (file,) = manifest.files
    assert split_needs(needed_ranges(state, manifest, None), manifest) == (None, {})
    few = {"step": torch.tensor(0.0)}
    needs, ranges = split_needs(needed_ranges(few, manifest, None), manifest)
    loc = next(loc for i, loc in manifest.locations.items() if i.fqn == "step")
    assert needs is None and ranges == {file: [[loc.offset, loc.offset + loc.length]]}
    assert split_needs(None, manifest) == (None, None)
