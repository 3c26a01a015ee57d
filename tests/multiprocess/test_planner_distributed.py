"""BalancedSavePlanner on real gloo ranks: balance, splitting, resharding, replica checks,
and compressed checkpoints resharded across world sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from conftest import assert_bit_equal
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_multilevel import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.planning import CostModel

pytestmark = pytest.mark.multiprocess

HUGE = (2048, 512)  # 4 MiB of fp32, inserted last: stock DCP's worst case


def _full(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def _replicated() -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i in range(40):
        state[f"model.layer{i}.weight"] = _full(f"w{i}", (64, 64))
        state[f"model.layer{i}.bias"] = _full(f"b{i}", (64,))
    state["model.emb"] = _full("emb", (128, 33), torch.bfloat16)
    state["meta"] = {"step": 5, "name": "run"}
    state["model.huge"] = _full("huge", HUGE)
    return state


def _sharded_full() -> torch.Tensor:
    return _full("sharded", (16, 8))


def _state(mesh) -> dict[str, Any]:
    state = _replicated()
    state["sharded"] = distribute_tensor(_sharded_full(), mesh, [Shard(0)])
    return state


def _blank(mesh) -> dict[str, Any]:
    state = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
        for k, v in _replicated().items()
    }
    state["meta"] = {"step": 0, "name": ""}
    full = torch.zeros(16, 8)
    state["sharded"] = distribute_tensor(full, mesh, [Shard(0)]) if mesh is not None else full
    return state


def _check(state: dict[str, Any]) -> None:
    for k, v in _replicated().items():
        if isinstance(v, torch.Tensor):
            assert_bit_equal(state[k], v, k)
    assert state["meta"] == {"step": 5, "name": "run"}
    sharded = state["sharded"]
    if isinstance(sharded, DTensor):
        sharded = sharded.full_tensor()
    assert_bit_equal(sharded, _sharded_full(), "sharded")


def _bytes_per_rank(ckpt: Path, world: int) -> list[int]:
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    out = [0] * world
    for name, size in files.items():
        out[int(name.split("/")[1].split("-")[0])] += size
    return out


class _CountingPlanner(BalancedSavePlanner):
    calls = 0

    def _balance(self, all_plans):
        type(self).calls += 1
        return super()._balance(all_plans)


def _save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    root_p = Path(root)
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh)
    bytes_only = BalancedSavePlanner(cost_model=CostModel(per_item_overhead=0))
    dcp.save(state, storage_writer=MultiLevelWriter(root_p / "ours"), planner=bytes_only)
    dcp.save(state, storage_writer=MultiLevelWriter(root_p / "stock_planner"))
    dcp.save(state, storage_writer=FileSystemWriter(root_p / "fs"), planner=BalancedSavePlanner())
    dcp.save(
        state,
        storage_writer=MultiLevelWriter(root_p / "compressed", codec="bytegroup"),
        planner=BalancedSavePlanner(),
    )

    # Load back at the same world size, both formats.
    for name, reader in [
        ("ours", MultiLevelReader),
        ("fs", FileSystemReader),
        ("compressed", MultiLevelReader),
    ]:
        blank = _blank(mesh)
        dcp.load(blank, storage_reader=reader(root_p / name))
        _check(blank)

    # Plan caching: the second save reuses the global plan (no new partition) and
    # still commits the *new* data, with fresh files.
    planner = _CountingPlanner(verify_replicas=False)  # (the replica check plans every save)
    dcp.save(state, storage_writer=MultiLevelWriter(root_p / "cached1"), planner=planner)
    state["model.huge"].add_(1)
    dcp.save(state, storage_writer=MultiLevelWriter(root_p / "cached2"), planner=planner)
    state["model.huge"].sub_(1)
    blank = _blank(mesh)
    dcp.load(blank, storage_reader=MultiLevelReader(root_p / "cached2"))
    assert torch.equal(blank["model.huge"], _full("huge", HUGE) + 1)
    cached_calls = _CountingPlanner.calls
    # Only a dtype changes, not the bytes (DCP's plan comparison leaves dtypes out),
    # then only a DTensor's placement: planned again, each rank under its new plan.
    state["model.emb"] = state["model.emb"].half()
    dcp.save(state, storage_writer=MultiLevelWriter(root_p / "cached3"), planner=planner)
    state["sharded"] = distribute_tensor(_sharded_full(), mesh, [Replicate()])
    dcp.save(state, storage_writer=MultiLevelWriter(root_p / "cached4"), planner=planner)
    for name in ("cached3", "cached4"):
        blank = _blank(mesh)
        blank["model.emb"] = torch.zeros(128, 33, dtype=torch.half)
        dcp.load(blank, storage_reader=MultiLevelReader(root_p / name))
        want = _full("emb", (128, 33), torch.bfloat16).half()
        assert torch.equal(blank["model.emb"], want), name
        assert torch.equal(blank["sharded"].full_tensor(), _sharded_full()), name
    state["model.emb"] = state["model.emb"].bfloat16()
    state["sharded"] = distribute_tensor(_sharded_full(), mesh, [Shard(0)])

    # The replica check (on by default): one rank's "replicated" tensor differs.
    if rank == world - 1:
        state["model.layer3.weight"] = state["model.layer3.weight"] + 1
    dcp.save(
        state, storage_writer=MultiLevelWriter(root_p / "unequal"), planner=BalancedSavePlanner()
    )
    dist.barrier()
    return {
        "cached_calls": cached_calls if rank == 0 else None,
        "replanned_calls": _CountingPlanner.calls if rank == 0 else None,
    }


def _load_job(rank: int, world: int, ckpts: tuple[str, ...]) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for ckpt in ckpts:
        reader = FileSystemReader if ckpt.endswith("fs") else MultiLevelReader
        blank = _blank(mesh)
        dcp.load(blank, storage_reader=reader(ckpt))
        _check(blank)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, tuple[Path, list[dict[str, Any]]]]:
    out = {}
    for world in (2, 4):
        root = tmp_path_factory.mktemp(f"saved{world}")
        out[world] = (root, run_ranks(_save_job, world, str(root), timeout=240))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_huge_replicated_tensor_is_split_and_ranks_write_equal_bytes(saved, world):
    root, _ = saved[world]
    ours = _bytes_per_rank(root / "ours", world)
    stock = _bytes_per_rank(root / "stock_planner", world)
    mean = sum(ours) / world
    assert max(ours) / mean <= 1.05, ours
    # Stock dedup gives the 4 MiB tensor, whole, to one rank.
    assert max(stock) / (sum(stock) / world) >= 1.4, stock
    manifest = json.loads((root / "ours" / "manifest.json").read_text())
    huge_chunks = manifest["state_dict"]["model.huge"]["chunks"]
    assert len(huge_chunks) >= world
    assert sum(c["sizes"][0] for c in huge_chunks) == HUGE[0]


@pytest.mark.parametrize("world", [2, 4])
def test_plan_is_cached_across_saves_and_unequal_replicas_are_named(saved, world):
    root, results = saved[world]
    assert results[0]["cached_calls"] == 1
    assert results[0]["replanned_calls"] == 3  # each new layout, planned again
    # Unequal replicas quarantine the save, naming the item and the ranks; with
    # four copies the odd one is outvoted, and the majority's bytes are written.
    manifest = StoredCheckpoint.at(root / "unequal").manifest()
    assert manifest.quarantined
    (finding,) = manifest.health.findings
    assert finding.check == "replicas"
    assert finding.items == ("model.layer3.weight",)
    if world == 2:
        assert "no majority" in finding.message
        assert finding.ranks == (0, 1)
    else:
        assert "majority" in finding.message and "no majority" not in finding.message
        assert finding.ranks == (world - 1,)
        blank = _blank(None)
        dcp.load(blank, storage_reader=MultiLevelReader(root / "unequal"))
        want = _replicated()["model.layer3.weight"]  # as the clean replicas hold it
        assert_bit_equal(blank["model.layer3.weight"], want, "model.layer3.weight")


def test_balanced_checkpoints_load_with_three_ranks(saved):
    ckpts = tuple(str(saved[w][0] / n) for w in (2, 4) for n in ("ours", "fs", "compressed"))
    run_ranks(_load_job, 3, ckpts, timeout=240)


def test_balanced_checkpoints_load_in_one_process(saved):
    for w in (2, 4):
        for name, reader in [
            ("ours", MultiLevelReader),
            ("fs", FileSystemReader),
            ("compressed", MultiLevelReader),
        ]:
            blank = _blank(None)
            dcp.load(blank, storage_reader=reader(saved[w][0] / name))
            _check(blank)
