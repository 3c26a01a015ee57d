"""BalancedSavePlanner's DCP translation, exercised in one process (plans built by hand)."""

from __future__ import annotations

import pytest
import torch

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
