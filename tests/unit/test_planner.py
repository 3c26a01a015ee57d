"""BalancedSavePlanner's DCP translation, exercised in one process (plans built by hand)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_multilevel import BalancedSavePlanner
from dcp_multilevel.errors import PlanningError
from dcp_multilevel.planning import CostModel
from dcp_multilevel.planning.fingerprint import CHUNK_WORDS, fingerprint


def _local_plans(states):
    plans = []
    for rank, state in enumerate(states):
        p = BalancedSavePlanner()
        p.set_up_planner(state, None, rank == 0)
        plans.append(p.create_local_plan())
    return plans


def test_replicas_with_different_shapes_are_refused_naming_both_ranks():
    plans = _local_plans([{"w": torch.zeros(4, 4)}, {"w": torch.zeros(4, 5)}])
    with pytest.raises(PlanningError) as info:
        BalancedSavePlanner().create_global_plan(plans)
    assert str(info.value) == (
        "item 'w' is a (4, 4) torch.float32 tensor on rank 0 but a (4, 5) torch.float32 "
        "tensor on rank 1; every rank must hold the same structure for a replicated item"
    )


def test_split_pieces_are_shard_items_and_resolve_to_narrowed_views():
    state = {"big": torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)}
    plans = _local_plans([state] * 4)
    planner = BalancedSavePlanner(cost_model=CostModel(per_item_overhead=0))
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    global_plan, metadata = planner.create_global_plan(plans)
    chunks = metadata.state_dict_metadata["big"].chunks
    assert len(chunks) == 4 and sorted(c.sizes[0] for c in chunks) == [1024] * 4
    for plan in global_plan:
        (item,) = plan.items
        assert item.type.name == "SHARD"
        view = planner.resolve_data(item)
        off = item.tensor_data.chunk.offsets[0]
        assert torch.equal(view, state["big"][off : off + 1024])
        assert view.data_ptr() == state["big"][off].data_ptr()  # a view: no copy


def test_bytes_items_and_sharded_items_are_never_split():
    states = [{"obj": {"k": list(range(10_000))}, "w": torch.zeros(8, 8)} for _ in range(2)]
    global_plan, _ = BalancedSavePlanner().create_global_plan(_local_plans(states))
    items = [i for p in global_plan for i in p.items]
    assert sorted(i.index.fqn for i in items) == ["obj.k", "w"]
    assert all(i.type.name != "SHARD" for i in items)


def _strip_hints(plans):
    """Plans as DCP's dedup would hand them to create_default_global_save_plan."""
    return [
        dataclasses.replace(
            p,
            items=[
                dataclasses.replace(w, index=dataclasses.replace(w.index, index=None))
                for w in p.items
            ],
        )
        for p in plans
    ]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_global_plan_and_metadata_are_what_stock_dcp_builds_from_the_same_assignment(world):
    # The planner builds final plans and Metadata in one pass; DCP's
    # create_default_global_save_plan run on the same per-rank items must agree,
    # index hints included.
    state = {
        "big": torch.zeros(4096, 64),
        "small": torch.zeros(3, 3),
        "scalar": torch.zeros(()),
        "obj": {"k": 1},
    }
    planner = BalancedSavePlanner(cost_model=CostModel(per_item_overhead=0))
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    ours, metadata = planner.create_global_plan(_local_plans([state] * world))
    stock, stock_md = create_default_global_save_plan(_strip_hints(ours))
    assert [p.items for p in ours] == [p.items for p in stock]
    assert [[w.index.index for w in p.items] for p in ours] == [
        [w.index.index for w in p.items] for p in stock
    ]
    assert metadata.state_dict_metadata == stock_md.state_dict_metadata
    if world > 1:
        assert len(metadata.state_dict_metadata["big"].chunks) > 1  # split, hints 0..k


def test_each_rank_writes_its_items_in_state_dict_order():
    state = {f"p{i:02d}": torch.zeros(1000 - 10 * i) for i in range(30)}
    global_plan, _ = BalancedSavePlanner().create_global_plan(_local_plans([state] * 3))
    order = list(state)
    for plan in global_plan:
        fqns = [w.index.fqn for w in plan.items]
        assert fqns == sorted(fqns, key=order.index)


def test_ranks_with_different_plans_keep_every_item_on_a_rank_that_holds_it():
    # Ranks 0 and 2 hold the same items, rank 1 one more: three plan classes in
    # a non-adjacent order, so the fast path (same plan as the previous rank) misses.
    common = {f"w{i}": torch.zeros(64, 64) for i in range(6)}
    extra = dict(common, only1=torch.zeros(8))
    states = [common, extra, common, extra]
    global_plan, metadata = BalancedSavePlanner().create_global_plan(_local_plans(states))
    where = {}
    for rank, plan in enumerate(global_plan):
        for w in plan.items:
            where.setdefault(w.index.fqn, set()).add(rank)
    assert where["only1"] <= {1, 3}
    assert set(where) == set(extra)
    for fqn in common:
        chunks = metadata.state_dict_metadata[fqn].chunks
        assert sum(c.sizes.numel() for c in chunks) == 64 * 64


def test_a_mismatch_in_a_later_plan_class_names_the_first_rank_holding_the_item():
    states = [{"w": torch.zeros(4)}, {"w": torch.zeros(4), "x": torch.zeros(2)}]
    states.append({"w": torch.zeros(4, dtype=torch.float64)})
    with pytest.raises(PlanningError) as info:
        BalancedSavePlanner().create_global_plan(_local_plans(states))
    assert str(info.value) == (
        "item 'w' is a (4,) torch.float32 tensor on rank 0 but a (4,) torch.float64 "
        "tensor on rank 2; every rank must hold the same structure for a replicated item"
    )


def test_one_fqn_saved_as_two_whole_tensors_is_refused():
    # Two ranks claim different boxes of "w" as whole (non-SHARD) tensors: DCP
    # itself asserts on this; the planner names the item instead.
    plans = _local_plans([{"w": torch.zeros(4)}, {"w": torch.zeros(4)}])
    w = plans[1].items[0]
    moved = dataclasses.replace(w, index=dataclasses.replace(w.index, offset=torch.Size([2])))
    plans[1] = dataclasses.replace(plans[1], items=[moved])
    with pytest.raises(PlanningError) as info:
        BalancedSavePlanner().create_global_plan(plans)
    assert str(info.value) == (
        "item 'w' is saved twice: as a whole tensor and as another item; every state-dict "
        "key must name one tensor, sharded or whole"
    )


def _shard(fqn, offsets, sizes, size, dtype=torch.float32):
    """A DTensor-like SHARD item: box (offsets, sizes) of tensor ``fqn`` of ``size``."""
    offsets, sizes = torch.Size(offsets), torch.Size(sizes)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _sharded_plans(boxes, size=(8, 4)):
    """One local plan per rank, each saving one box ((offsets), (sizes)) of tensor "w"."""
    return [SavePlan([_shard("w", offsets, sizes, size)]) for offsets, sizes in boxes]


def _fsdp_plans(world, rows=(3, 8, 40), dtype_of=lambda rank: torch.float32):
    """Every rank's plan as fully_shard leaves it: row shards of tensors with ``rows``
    rows (DTensor's empty shard at offset ``rows`` past the last one) and a scalar."""
    plans = []
    for rank in range(world):
        items = []
        for n in rows:
            full = -(-n // world)
            start, size = full * rank, max(0, min(full, n - full * rank))
            box = ((start, 0), (size, 4)) if size else ((n, 0), (0, 4))
            items.append(_shard(f"w{n}", *box, (n, 4), dtype_of(rank)))
        scalar = torch.zeros(())
        items += _local_plans([{"step": scalar}])[0].items
        plans.append(SavePlan(items))
    return plans


def test_fsdp_shards_stay_on_their_rank_and_shared_items_are_saved_once():
    world = 16
    plans = _fsdp_plans(world)
    global_plan, metadata = BalancedSavePlanner().create_global_plan(plans)

    def rows(plan):
        return [
            (w.index.fqn, w.index.offset)
            for w in plan.items
            if w.index.fqn != "step" and w.tensor_data.chunk.sizes.numel()
        ]

    for local, final in zip(plans, global_plan, strict=True):
        assert rows(final) == rows(local)  # every non-empty shard where it is, nothing else
    saved = [(w.index.fqn, tuple(w.index.offset)) for p in global_plan for w in p.items]
    assert len(saved) == len(set(saved))  # empty shards and the scalar: once each
    assert {"step", "w3", "w8", "w40"} <= {fqn for fqn, _ in saved}
    chunks = metadata.state_dict_metadata["w40"].chunks
    assert sum(c.sizes.numel() for c in chunks) == 40 * 4


def test_a_replica_mismatch_among_mostly_equal_sharded_plans_is_named():
    # Ranks 3.. hold only empty shards of w3 and w8, equal to the previous rank's;
    # rank 9's w8 is float64: it must be compared, not taken as the previous one.
    plans = _fsdp_plans(12, dtype_of=lambda rank: torch.float64 if rank == 9 else torch.float32)
    with pytest.raises(PlanningError) as info:
        BalancedSavePlanner().create_global_plan(plans)
    assert str(info.value) == (
        "item 'w3' is a (0, 4) torch.float32 shard on rank 3 but a (0, 4) torch.float64 "
        "shard on rank 9; every rank must hold the same structure for a replicated item"
    )


def test_row_shards_from_every_rank_stay_there_and_pass_validation():
    boxes = [((2 * r, 0), (2, 4)) for r in range(4)]
    global_plan, metadata = BalancedSavePlanner().create_global_plan(_sharded_plans(boxes))
    assert [[tuple(w.index.offset) for w in p.items] for p in global_plan] == [
        [(0, 0)],
        [(2, 0)],
        [(4, 0)],
        [(6, 0)],
    ]
    assert [w.index.index for p in global_plan for w in p.items] == [0, 1, 2, 3]
    assert len(metadata.state_dict_metadata["w"].chunks) == 4


@pytest.mark.parametrize(
    ("boxes", "problems"),
    [
        (
            [((0, 0), (4, 4)), ((2, 0), (4, 4))],
            "1 found: 'w': chunks offsets (0, 0) sizes (4, 4) and offsets (2, 0) sizes (4, 4) "
            "overlap",
        ),
        (
            [((0, 0), (4, 4)), ((6, 0), (4, 4))],
            "1 found: 'w': chunk offsets (6, 0) sizes (4, 4) lies outside the tensor of size "
            "(8, 4)",
        ),
        (
            [((0, 0), (4, 4)), ((2, 0), (2, 4))],
            "2 found: 'w': chunks offsets (0, 0) sizes (4, 4) and offsets (2, 0) sizes (2, 4) "
            "overlap; 'w': chunks hold 24 elements but the tensor has 32: some would not be "
            "saved",
        ),
        (
            [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((3, 0), (2, 4))],
            "3 found: 'w': chunks offsets (0, 0) sizes (4, 4) and offsets (3, 0) sizes (2, 4) "
            "overlap; 'w': chunks offsets (3, 0) sizes (2, 4) and offsets (4, 0) sizes (4, 4) "
            "overlap; 'w': chunks hold 40 elements but the tensor has 32: some are saved twice",
        ),
    ],
)
def test_chunks_that_do_not_tile_their_tensor_are_refused(boxes, problems):
    with pytest.raises(PlanningError) as info:
        BalancedSavePlanner().create_global_plan(_sharded_plans(boxes))
    assert str(info.value) == (
        "the ranks' chunks do not tile their tensors; every rank must shard a tensor the "
        f"same way. {problems}"
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_leaves_the_garbage_collector_as_it_found_it(enabled):
    import gc

    good = _local_plans([{"w": torch.zeros(64, 64)}] * 2)
    bad = _local_plans([{"w": torch.zeros(4)}, {"w": torch.zeros(5)}])
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        BalancedSavePlanner().create_global_plan(good)
        assert gc.isenabled() is enabled
        with pytest.raises(PlanningError):
            BalancedSavePlanner().create_global_plan(bad)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


# --------------------------------------------------------------------------- kept local plan


def _layout_state() -> dict:
    return {
        "w": torch.randn(8, 4),
        "p": torch.nn.Parameter(torch.randn(3)),
        "opt": {"step": torch.tensor(2.0), "lr": 0.1},
    }


def _changed_layouts() -> dict:
    return {
        "shape": lambda s: s.update(w=torch.randn(4, 8)),
        "dtype": lambda s: s.update(w=s["w"].double()),
        "requires_grad": lambda s: s.update(p=s["p"].detach()),
        "value kind": lambda s: s["opt"].update(lr=torch.tensor(0.1)),
        "new key": lambda s: s.update(b=torch.zeros(2)),
        "key order": lambda s: s.update(w=s.pop("w")),
        "dropped key": lambda s: s.pop("p"),
        "nesting": _unnest_opt,  # the same flat keys, from other places
    }


def _unnest_opt(state: dict) -> None:
    opt = state.pop("opt")
    state.update({"opt.step": opt["step"], "opt.lr": opt["lr"]})


def _planned(planner: BalancedSavePlanner, state: dict) -> list:
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    return planner.plan.items


def test_a_state_laid_out_as_the_last_one_gets_the_last_local_plan_again():
    # The items DCP makes per tensor would otherwise be made anew each save
    # (and reach the collector's oldest generation); values are not in them.
    planner = BalancedSavePlanner(enable_plan_caching=False)
    state = _layout_state()
    first = _planned(planner, state)
    state["w"].add_(1)
    state["opt"]["lr"] = 0.2
    again = _planned(planner, state)
    assert again is first
    rebuilt = _planned(BalancedSavePlanner(enable_plan_caching=False), state)
    assert again == rebuilt  # what DCP would make now


@pytest.mark.parametrize("change", list(_changed_layouts()))
def test_a_state_laid_out_otherwise_gets_a_new_local_plan(change):
    planner = BalancedSavePlanner(enable_plan_caching=False)
    state = _layout_state()
    first = _planned(planner, state)
    _changed_layouts()[change](state)
    new = _planned(planner, state)
    assert new is not first
    assert new == _planned(BalancedSavePlanner(enable_plan_caching=False), state)
    assert _planned(planner, state) is new  # and that one is kept in turn


def test_a_planner_sent_to_another_process_keeps_no_plan():
    import pickle

    planner = BalancedSavePlanner()
    state = _layout_state()
    _planned(planner, state)
    copy = pickle.loads(pickle.dumps(planner))
    assert planner._kept_local.plan is not None and copy._kept_local.plan is None
    assert _planned(copy, state) == _planned(BalancedSavePlanner(), state)


def test_values_that_make_their_own_write_items_are_never_kept():
    class Own:
        def __create_write_items__(self, fqn, obj):
            return [
                WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO),
            ]

    planner = BalancedSavePlanner(enable_plan_caching=False)
    state = {"w": torch.zeros(2), "own": Own()}
    first = _planned(planner, state)
    assert _planned(planner, state) is not first


@pytest.mark.parametrize("caching", [True, False])
def test_saves_of_one_planner_store_each_saves_values_dtypes_and_grads(tmp_path, caching):
    # DCP's plan caching compares plans without their dtypes or paths: a state
    # changed only in a dtype was written under the last plan (refused by our
    # writer; stock DCP recorded the old dtype in its metadata), and one nested
    # otherwise under the same flat keys recorded the last nesting.
    import json

    import torch.distributed.checkpoint as dcp

    from dcp_multilevel import MultiLevelReader, MultiLevelWriter
    from dcp_multilevel.plugin.planner import drop_cached_plans

    planner = BalancedSavePlanner(enable_plan_caching=caching)
    state = _layout_state()

    def save_and_check(name: str) -> None:
        dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / name), planner=planner)
        out = {
            "w": torch.zeros_like(state["w"]),
            "p": torch.zeros_like(state["p"]),
            "opt": {"step": torch.zeros(()), "lr": None},
        }
        dcp.load(out, storage_reader=MultiLevelReader(tmp_path / name))
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["p"], state["p"])
        assert out["opt"]["lr"] == state["opt"]["lr"]
        stored = json.loads((tmp_path / name / "manifest.json").read_text())["state_dict"]
        assert stored["w"]["dtype"] == str(state["w"].dtype).removeprefix("torch.")
        assert stored["p"]["requires_grad"] is state["p"].requires_grad

    save_and_check("a")
    kept = planner._kept_local.plan
    state["w"].mul_(2)
    state["opt"]["lr"] = 0.5
    save_and_check("b")
    assert planner._kept_local.plan is kept  # the same layout: the same local plan
    state["w"] = state["w"].double()  # only a dtype changes
    save_and_check("c")
    assert planner._kept_local.plan is not kept
    state["p"] = torch.nn.Parameter(state["p"].detach(), requires_grad=False)
    save_and_check("d")
    state["w"] = state["w"].float().add_(1)
    save_and_check("e")
    paths = json.loads((tmp_path / "e" / "manifest.json").read_text())["planner_data"]
    assert paths["opt.step"] == ["opt", "step"]
    opt = state.pop("opt")  # the same flat keys, nested otherwise
    state["opt.step"], state["opt.lr"] = opt["step"], opt["lr"]
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "n"), planner=planner)
    paths = json.loads((tmp_path / "n" / "manifest.json").read_text())["planner_data"]
    assert paths["opt.step"] == ["opt.step"] and paths["opt.lr"] == ["opt.lr"]
    state["opt"] = {"step": state.pop("opt.step"), "lr": state.pop("opt.lr")}
    # DCP's cache lost (as after a failed save): the kept plan is not taken on its own.
    drop_cached_plans(planner._cached_plans_key)
    state["w"].add_(1)
    save_and_check("f")


def test_stock_plan_caching_after_a_dtype_change_is_refused_saying_what_to_use(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_multilevel import MultiLevelWriter
    from dcp_multilevel.plugin.planner import drop_cached_plans

    planner = DefaultSavePlanner(enable_plan_caching=True)
    drop_cached_plans(planner._cached_plans_key)  # stock's cache is per class
    try:
        state = {"w": torch.ones(4)}
        dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "a"), planner=planner)
        state["w"] = state["w"].double()  # DCP replays the float32 plan
        with pytest.raises(CheckpointException, match="BalancedSavePlanner, which plans again"):
            dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "b"), planner=planner)
        assert not (tmp_path / "b" / "manifest.json").exists()  # nothing committed
    finally:
        drop_cached_plans(planner._cached_plans_key)


# --------------------------------------------------------------------------- fingerprint


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]),
    st.integers(1, 5000),
    st.integers(0, 2**31),
)
def test_a_fingerprint_changes_with_any_bit_and_not_with_chunking(dtype, numel, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(numel, generator=g) * 100).to(dtype)
    same = fingerprint(t)
    assert fingerprint(t.clone()) == same == fingerprint(t, chunk_words=7)  # any chunking
    raw = t.view(torch.uint8).clone()
    byte = int(torch.randint(raw.numel(), (1,), generator=g))
    raw[byte] ^= 1 << int(torch.randint(8, (1,), generator=g))
    assert fingerprint(raw.view(dtype)) != same  # one flipped bit anywhere
    assert fingerprint(t[:-1]) != same or numel == 1  # a shorter tensor


@pytest.mark.parametrize(
    "view",
    [
        lambda: torch.arange(20, dtype=torch.bfloat16)[1:9],  # starts 2 bytes in
        lambda: torch.tensor([True, False, True, True, False])[1:],  # 1 byte in
        lambda: torch.arange(40, dtype=torch.int8)[3:11],  # 3 bytes in
        lambda: torch.arange(40, dtype=torch.int8)[3:10],  # 3 bytes in, 7 long
        lambda: torch.randn(6, 5, generator=torch.Generator().manual_seed(1)).half()[:, 1:],
    ],
    ids=["bf16-slice", "bool-slice", "int8-slice", "int8-odd-slice", "f16-strided"],
)
@pytest.mark.parametrize("chunk_words", [1, 3, CHUNK_WORDS])
def test_a_fingerprint_of_a_view_at_any_byte_offset_is_that_of_its_values(view, chunk_words):
    # torch refuses to view bytes as words from an offset not divisible by 4.
    t = view()
    assert fingerprint(t, chunk_words=chunk_words) == fingerprint(t.clone())
    assert fingerprint(t, chunk_words=chunk_words) == fingerprint(t.contiguous().clone(), 2)
