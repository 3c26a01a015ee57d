"""Properties of the pure partitioner (planning/), checked with Hypothesis."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dcp_multilevel.errors import PlanningError
from dcp_multilevel.planning import CostModel, Item, PartitionOptions, partition
from dcp_multilevel.planning.partition import choose_split_dim, slab_bytes


@st.composite
def problems(draw, all_replicated: bool = False):
    world = draw(st.integers(1, 12))
    n = draw(st.integers(0, 25))
    items = []
    for key in range(n):
        dims = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0, 64)) for _ in range(dims))
        itemsize = draw(st.sampled_from([1, 2, 4, 8]))
        splittable = draw(st.booleans())
        nbytes = math.prod(shape) * itemsize if splittable else draw(st.integers(0, 50_000))
        if all_replicated or draw(st.booleans()):
            owners = tuple(range(world))
        elif draw(st.booleans()):
            owners = (draw(st.integers(0, world - 1)),)
        else:
            owners = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1))))
        items.append(
            Item(
                key=key,
                nbytes=nbytes,
                owners=owners,
                sort_key=f"item{key:03d}",
                group=draw(st.sampled_from(["", "g1", "g2", "g3"])),
                shape=shape if splittable else None,
                itemsize=itemsize if splittable else 1,
            )
        )
    cost = CostModel(bandwidth=1e6, per_item_overhead=draw(st.sampled_from([0, 1e-4, 1e-3])))
    options = PartitionOptions(
        epsilon=draw(st.sampled_from([0.01, 0.05, 0.2])),
        min_chunk_bytes=draw(st.sampled_from([None, 1, 16, 256, 4096])),
        split=draw(st.booleans()),
        group=draw(st.booleans()),
    )
    return items, world, cost, options


def _by_key(pieces):
    out = {}
    for p in pieces:
        out.setdefault(p.key, []).append(p)
    return out


@settings(max_examples=150, deadline=None)
@given(problems())
def test_every_element_is_written_exactly_once(problem):
    items, world, cost, options = problem
    result = partition(items, world, cost, options)
    pieces = _by_key(result.pieces)
    assert set(pieces) == {i.key for i in items}
    for item in items:
        ps = pieces[item.key]
        if len(ps) == 1 and not ps[0].is_split:
            assert ps[0].nbytes == item.nbytes
            continue
        # Split: one dimension is cut into consecutive, non-overlapping slabs that
        # cover it exactly; every other dimension is whole.
        assert item.shape is not None
        (dim,) = {d for p in ps for d in range(len(item.shape)) if p.sizes[d] != item.shape[d]} or {
            0
        }
        spans = sorted((p.offsets[dim], p.sizes[dim]) for p in ps)
        pos = 0
        for off, size in spans:
            assert off == pos and size > 0
            pos += size
        assert pos == item.shape[dim]
        assert sum(p.nbytes for p in ps) == item.nbytes


@settings(max_examples=150, deadline=None)
@given(problems())
def test_owned_items_stay_and_unsplittable_items_stay_whole(problem):
    items, world, cost, options = problem
    pieces = _by_key(partition(items, world, cost, options).pieces)
    for item in items:
        for p in pieces[item.key]:
            assert p.rank in item.owners
        if len(item.owners) == 1 or item.shape is None or not options.split:
            assert len(pieces[item.key]) == 1 and not pieces[item.key][0].is_split


@settings(max_examples=150, deadline=None)
@given(problems())
def test_no_split_piece_is_smaller_than_the_minimum(problem):
    items, world, cost, options = problem
    result = partition(items, world, cost, options)
    if options.min_chunk_bytes is not None:
        assert result.min_chunk == options.min_chunk_bytes
    for p in result.pieces:
        if p.is_split:
            assert p.nbytes >= result.min_chunk


@settings(max_examples=100, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_plan_is_deterministic_and_independent_of_input_order(problem, rnd):
    items, world, cost, options = problem
    a = partition(items, world, cost, options)
    assert a == partition(list(items), world, cost, options)
    # Skipping the input checks (the planner's path) changes nothing for valid input.
    assert a == partition(items, world, cost, options, check=False)
    shuffled = list(items)
    rnd.shuffle(shuffled)
    b = partition(shuffled, world, cost, options)
    assert sorted(a.pieces, key=repr) == sorted(b.pieces, key=repr)
    assert a.loads == b.loads


# Found by hypothesis: three slabs of 84 bytes and a minimum chunk of 100 give no two
# pieces of 100 bytes, so the item goes whole (R); 39 slabs of 3,000 bytes cut three
# at a time over 12 ranks leave three slabs, fewer than two chunks of 4,096, whole (R).
_THREE_SLABS = Item(0, 252, tuple(range(7)), "item000", shape=(3, 3, 7), itemsize=4)
_THIRTEEN_CUTS = Item(0, 117_000, tuple(range(12)), "item000", shape=(25, 30, 39), itemsize=4)


@settings(max_examples=300, deadline=None)
@given(problems(all_replicated=True))
@example(
    problem=([_THREE_SLABS], 7, CostModel(1e6, 1e-4), PartitionOptions(epsilon=0.01, split=True))
)
@example(
    problem=(
        [_THIRTEEN_CUTS],
        12,
        CostModel(1e6, 0),
        PartitionOptions(epsilon=0.01, min_chunk_bytes=4096, split=True),
    )
)
def test_balance_bound_of_the_module_docstring(problem):
    """max load <= max(O, M + max(s, U, V)), with O = 0 when everything is replicated."""
    items, world, cost, options = problem
    result = partition(items, world, cost, options)
    h = cost.overhead_bytes
    granularity = result.slack - result.min_chunk - h

    def whole(i: Item) -> int:
        """U (an item with no dimension to cut) or R (the most an item or remainder
        with too few slabs for two pieces of the minimum chunk costs, placed whole)."""
        if i.shape is None or not options.split:
            return cost.cost(i.nbytes)
        dim = choose_split_dim(i.shape, i.itemsize, granularity)
        if dim is None:
            return cost.cost(i.nbytes)
        slab = slab_bytes(i.shape, i.itemsize, dim)
        k_min = -(-result.min_chunk // slab) if slab else 1
        return cost.cost(min(i.nbytes, (2 * k_min - 1) * slab))

    unsplittable = [whole(i) for i in items if world > 1]
    # Items too coarse to cut within the granularity are cut at their finest slab:
    # V, one slab and the overhead, not the whole item.
    coarse = [0]
    for i in items:
        if i.shape is not None and options.split and world > 1:
            slabs = [math.prod(i.shape) * i.itemsize // s for s in i.shape if s >= 2]
            if slabs and min(slabs) > granularity:
                coarse.append(min(slabs) + h)
    mean_ceil = -(-sum(result.loads) // world)
    bound = mean_ceil + max(result.slack, *unsplittable, *coarse)
    assert max(result.loads, default=0) <= bound
    assert sum(result.loads) == sum(
        cost.cost(p.nbytes) for p in result.pieces
    )  # loads account for every piece


def test_one_huge_tensor_last_is_split_to_near_perfect_balance():
    # The stock-DCP worst case from the issue: a 512 MB tensor after 400 small ones.
    world = 4
    everyone = tuple(range(world))
    items = [
        Item(k, 3_600_000, everyone, f"layer.{k:03d}.w", f"layer.{k:03d}", (900, 1000), 4)
        for k in range(400)
    ]
    items.append(Item(400, 512 << 20, everyone, "zz.huge", "", (131072, 1024), 4))
    result = partition(items, world)
    per_rank = result.bytes_per_rank()
    assert max(per_rank) / (sum(per_rank) / world) <= 1.01
    assert len([p for p in result.pieces if p.key == 400]) > 1


def test_grouping_keeps_sub_collections_together_when_balance_allows():
    everyone = (0, 1)
    items = [
        Item(k, 1000, everyone, f"g{k // 2}.{k % 2}", f"g{k // 2}", (250,), 4) for k in range(8)
    ]
    pieces = _by_key(partition(items, 2).pieces)
    for g in range(4):
        assert pieces[2 * g][0].rank == pieces[2 * g + 1][0].rank


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([Item(0, 1, (0,), "a"), Item(0, 1, (0,), "b")], "item key 0 (b) appears twice"),
        ([Item(0, 1, (1, 0), "a")], "item a: owners must be sorted, unique, non-empty"),
        ([Item(0, 1, (5,), "a")], "item a: owner outside 0..1"),
        ([Item(0, 3, (0,), "a", shape=(2,), itemsize=1)], "item a: shape x itemsize != nbytes"),
    ],
)
def test_inconsistent_inputs_are_planning_errors(items, message):
    with pytest.raises(PlanningError) as info:
        partition(items, 2)
    assert str(info.value) == message


def test_options_are_validated():
    with pytest.raises(PlanningError, match=r"epsilon must be in \(0, 1\), got 0"):
        PartitionOptions(epsilon=0)
    with pytest.raises(ValueError, match=r"CostModel\.bandwidth must be > 0 bytes/s, got 0"):
        CostModel(bandwidth=0)


def test_scales_to_1024_ranks_with_tight_balance():
    rng = random.Random(0)
    everyone = tuple(range(1024))
    rows = [rng.choice([1024, 4096, 30522]) for _ in range(1200)]
    items = [
        Item(k, 4 * r * 1024, everyone, f"p{k:04d}", f"g{k // 3}", (r, 1024), 4)
        for k, r in enumerate(rows)
    ]
    per_rank = partition(items, 1024).bytes_per_rank()
    assert max(per_rank) / (sum(per_rank) / 1024) <= 1.02


def _lpt_reference(sizes: list[int], bins: int) -> list[list[int]]:
    """Plain LPT: largest first (ties: earlier index), each to the least-loaded bin."""
    groups: list[list[int]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = loads.index(min(loads))
        groups[k].append(i)
        loads[k] += sizes[i]
    return [g for g in groups if g]


@given(st.lists(st.integers(0, 1 << 30), max_size=40), st.integers(1, 6))
def test_balance_is_lpt_over_whole_items(sizes, bins):
    from dcp_multilevel.planning import balance

    groups = balance(sizes, bins)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(groups) and len(groups) <= bins
    if bins > 1 and len(sizes) > 1:
        assert groups == _lpt_reference(sizes, bins)


# ------------------------------------------------------------------ chunk tiling


@st.composite
def tilings(draw):
    """A tensor shape and boxes near it: mostly a tiling by rows, sometimes broken."""
    dims = draw(st.integers(1, 3))
    size = tuple(draw(st.integers(1, 6)) for _ in range(dims))
    boxes = []
    for _ in range(draw(st.integers(0, 8))):
        offsets = tuple(draw(st.integers(-1, n + 1)) for n in size)
        sizes = tuple(draw(st.integers(0, n)) for n in size)
        boxes.append((offsets, sizes))
    if draw(st.booleans()):  # a proper row tiling, maybe with an empty shard at the end
        cuts = sorted(draw(st.sets(st.integers(1, size[0] - 1), max_size=3))) if size[0] > 1 else []
        edges = [0, *cuts, size[0]]
        rest = tuple(0 for _ in size[1:])
        boxes = [((a, *rest), (b - a, *size[1:])) for a, b in itertools.pairwise(edges)]
        if draw(st.booleans()):
            boxes.append(((size[0], *rest), (0, *size[1:])))
    return size, boxes


def _dcp_verdicts(size, boxes, world):
    """(out-of-bounds, overlapping pairs, fill) counts from DCP's own validation."""
    import torch
    from torch.distributed.checkpoint.default_planner import _validate_global_plan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    md = TensorStorageMetadata(TensorProperties(), torch.Size(size), chunks)
    errors = _validate_global_plan([None] * world, Metadata({"w": md}))
    return tuple(sum(kind in e for e in errors) for kind in ("out of bounds", "overlap", "fill"))


@settings(max_examples=300, deadline=None)
@given(tilings(), st.sampled_from([1, 2]))
def test_chunk_errors_give_dcps_verdicts(tiling, world):
    from dcp_multilevel.planning import chunk_errors

    size, boxes = tiling
    errors = chunk_errors(size, boxes, must_cover=world > 1)
    ours = tuple(
        sum(kind in e for e in errors) for kind in ("lies outside", "overlap", "elements but")
    )
    assert ours == _dcp_verdicts(size, boxes, world)


def test_row_shards_of_many_ranks_are_checked_without_comparing_every_pair(monkeypatch):
    # A (1024, 4096) weight in 1-row shards: DCP sweeps along dim 1 and compares all
    # 523,776 pairs; sweeping along the cut dimension compares none.
    from dcp_multilevel.planning import chunks as chunks_module

    calls = []
    real = chunks_module._overlap
    monkeypatch.setattr(chunks_module, "_overlap", lambda a, b: calls.append(1) or real(a, b))
    boxes = [((r, 0), (1, 4096)) for r in range(1024)]
    boxes.append(((1024, 0), (0, 4096)))  # DTensor's empty shard past the end
    assert chunks_module.chunk_errors((1024, 4096), boxes, must_cover=True) == []
    assert len(calls) == 0
    assert chunks_module.chunk_errors((), [], must_cover=True) == []  # 0-dim: never checked


def _bert_large_adamw() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of BertForPreTraining-large's parameters, each with AdamW's two moments."""
    h, i, v = 1024, 4096, 30522
    params = [("emb.word", (v, h)), ("emb.pos", (512, h)), ("emb.type", (2, h))]
    params += [("emb.ln.w", (h,)), ("emb.ln.b", (h,))]
    for n in range(24):
        for name, shape in [
            *((f"q{k}", (h, h)) for k in "qkvo"),
            *((f"q{k}.b", (h,)) for k in "qkvo"),
            ("in", (i, h)),
            ("in.b", (i,)),
            ("out", (h, i)),
            ("out.b", (h,)),
            ("ln1.w", (h,)),
            ("ln1.b", (h,)),
            ("ln2.w", (h,)),
            ("ln2.b", (h,)),
        ]:
            params.append((f"layer.{n}.{name}", shape))
    params += [("pool", (h, h)), ("pool.b", (h,)), ("cls.bias", (v,)), ("cls.dec", (v, h))]
    return [(f"{kind}.{name}", s) for kind in ("model", "m1", "m2") for name, s in params]


@pytest.mark.parametrize("world", [2048, 4096, 16384])
def test_replicated_bert_large_adamw_stays_within_2_percent_at_thousands_of_ranks(world):
    everyone = tuple(range(world))
    items = [
        Item(k, 4 * math.prod(shape), everyone, name, name.rsplit(".", 1)[0], shape, 4)
        for k, (name, shape) in enumerate(_bert_large_adamw())
    ]
    per_rank = partition(items, world, check=False).bytes_per_rank()
    assert sum(per_rank) == sum(i.nbytes for i in items)
    assert max(per_rank) / (sum(per_rank) / world) <= 1.02
