"""BalancedSavePlanner's DCP translation, exercised in one process (plans built by hand)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

from dcp_multilevel import BalancedSavePlanner, CostModel, PlanningError


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


@pytest.mark.parametrize(
    ("validation", "error"),
    [
        # torch 2.13 returns the list of errors; torch < 2.13 a bool (True: valid).
        ([], None),
        (True, None),
        (["key:w has out of bounds chunk"], "key:w has out of bounds chunk"),
        (False, "see DCP's warnings in the log"),
    ],
)
def test_dcps_plan_validation_is_read_in_either_form(monkeypatch, validation, error):
    import dcp_multilevel.planner as planner_module

    # DCP's own validation of a correct plan returns "valid" in one form only; the
    # other forms are what other torch releases (or an invalid plan) return.
    monkeypatch.setattr(planner_module, "_validate_global_plan", lambda plan, md: validation)
    plans = _local_plans([{"w": torch.zeros(8, 8)}] * 2)
    if error is None:
        global_plan, _ = BalancedSavePlanner().create_global_plan(plans)
        assert sorted(i.index.fqn for p in global_plan for i in p.items) == ["w"]
    else:
        with pytest.raises(PlanningError) as info:
            BalancedSavePlanner().create_global_plan(plans)
        assert str(info.value) == f"balanced plan failed DCP's validation: {error}"
