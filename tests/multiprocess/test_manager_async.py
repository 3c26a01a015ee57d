"""``CheckpointManager(async_save=True)``: saves return once staged; the first level is
written in DCP's background thread; the next call finishes the save (its drains,
retention, errors). Real gloo ranks, real files."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _gate import GatedPlanner

from dcp_multilevel import CheckpointManager, ConfigError, Level, StagingConfig
from dcp_multilevel.schedule import FixedInterval
from dcp_multilevel.testing import run_ranks
from dcp_multilevel.testing.levels import bit_equal


def _state(rank: int) -> dict[str, Any]:
    return {
        "w": torch.randn(256, 64, generator=torch.Generator().manual_seed(0)),  # replicated
        f"r{rank}": torch.randn(1000, generator=torch.Generator().manual_seed(1 + rank)),
        "step": 0,
    }


def _snapshot(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


def _levels(root: str) -> list[Level]:
    return [Level(f"{root}/l1", every=1, keep=2), Level(f"{root}/l2", every=2, keep=5)]


def _save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    mgr = CheckpointManager(_levels(root), async_save=True)
    sd = _state(rank)
    expected = {}
    for step in range(1, 5):
        sd["step"] = step
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.add_(1.0)
        expected[step] = _snapshot(sd)
        metrics = mgr.save(sd, step=step)
        assert metrics.step == step  # (that it returns before the write: the gated test)
        # Returned once staged: the state may change now, the checkpoint holds the old.
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.mul_(-3.0)
    mgr.wait()
    assert [m.step for m in mgr.metrics] == [1, 2, 3, 4]
    assert all(m.bytes_written > 0 for m in mgr.metrics)
    # The staging buffers are reused: host memory flat after the second save.
    held = [m.staging_bytes for m in mgr.metrics]
    assert held[1] > 0 and held[1:] == [held[1]] * 3, held
    assert mgr.metrics[-1].staging_peak_bytes <= 2 * held[1], held
    held = {0: mgr.steps(0), 1: mgr.steps(1)}
    mgr.close()
    loaded = {}
    for step in sorted(set(held[0]) | set(held[1])):
        back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
        CheckpointManager(_levels(root)).load(back, step)
        loaded[step] = bit_equal(back, expected[step])
    return {"held": held, "loaded": loaded}


def test_async_saves_hold_the_state_of_their_step_on_every_level(tmp_path: Path) -> None:
    results = run_ranks(_save_job, 2, str(tmp_path), timeout=180)
    for r in results:
        assert r["held"][0] == [3, 4], r  # keep=2
        assert 4 in r["held"][1] and set(r["held"][1]) <= {2, 4}, r  # every=2: the newest due
        assert r["loaded"] and all(r["loaded"].values()), r


def _gated_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """A save whose background write cannot start until the gate opens."""
    gate = threading.Event()
    mgr = CheckpointManager([Level(f"{root}/l1")], async_save=True, planner=GatedPlanner(gate))
    sd = _state(rank)
    t_call = time.perf_counter()
    metrics = mgr.save(sd, step=1)  # returns with the write held at the gate
    returned = {
        "committed": (Path(root) / "l1/step-1/manifest.json").exists(),
        "bytes": metrics.bytes_written,
        "listed": list(mgr.metrics),
    }
    blocked = metrics.blocked_seconds
    t_open = time.perf_counter()
    gate.set()
    done = mgr.finish_save()
    out = {
        **returned,
        "same": done is metrics and mgr.metrics == [metrics],
        "bytes_after": metrics.bytes_written,
        "committed_after": (Path(root) / "l1/step-1/manifest.json").exists(),
        # The write ran past t_open (the gate held it), the staging did not: a
        # blocked_seconds that counted the write would be longer than this.
        "blocked_before_the_gate_opened": blocked < t_open - t_call,
        "blocked_kept": metrics.blocked_seconds == blocked,
        "waited_is_the_write": metrics.waited_seconds > 0,
    }
    mgr.close()
    return out


def test_an_async_save_returns_before_its_write_and_blocks_only_for_staging(tmp_path: Path):
    for r in run_ranks(_gated_job, 2, str(tmp_path), timeout=180):
        assert r == {
            "committed": False,
            "bytes": 0,
            "listed": [],
            "same": True,
            "bytes_after": r["bytes_after"],
            "committed_after": True,
            "blocked_before_the_gate_opened": True,
            "blocked_kept": True,
            "waited_is_the_write": True,
        }, r
        assert r["bytes_after"] > 0, r


def _step_job(rank: int, world: int, root: str) -> list[list[int]]:
    levels = [Level(f"{root}/l1", every=2, keep=3), Level(f"{root}/l2", every=4, keep=3)]
    mgr = CheckpointManager(levels, schedule=FixedInterval(), async_save=True)
    sd = _state(rank)
    for step in range(1, 9):
        sd["step"] = step
        mgr.step(sd, step)
    mgr.wait()
    out = [mgr.steps(0), mgr.steps(1)]
    mgr.close()
    return out


def test_step_saves_asynchronously_where_the_schedule_says(tmp_path: Path) -> None:
    for held in run_ranks(_step_job, 2, str(tmp_path), timeout=180):
        assert held[0] == [4, 6, 8] and held[1][-1] == 8, held


def _failing_job(rank: int, world: int, root: str) -> str:
    mgr = CheckpointManager([Level(f"{root}/l1", every=1, keep=3)], async_save=True)
    sd = _state(rank)
    mgr.save(sd, step=1)
    mgr.finish_save()
    if rank == 0:  # where step 2 would go is a file: its background write fails
        Path(f"{root}/l1/step-2").write_text("in the way")
    mgr.save(sd, step=2)
    try:
        mgr.wait()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"raised {type(e).__name__}"
    finally:
        mgr.close()  # the failed save is not tried again: finish_save dropped it
    return "no error"


def test_a_failed_async_save_raises_at_the_next_call(tmp_path: Path) -> None:
    out = run_ranks(_failing_job, 2, str(tmp_path), timeout=180)
    assert out == ["raised CheckpointException"] * 2, out
    assert (tmp_path / "l1" / "step-1" / "manifest.json").exists()


def test_async_saves_refuse_a_first_level_that_stores_deltas(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stores deltas"):
        CheckpointManager(
            [Level(str(tmp_path / "l1"), codec="bytegroup", keyframe_every=4)], async_save=True
        )


def test_overlapped_staging_saves_behind_the_fence_the_manager_keeps(tmp_path: Path) -> None:
    """StagingConfig(overlap=True): save() returns before the copy, as dcp.async_save
    does; wait_for_staging() is the fence before the optimizer step. Budget 0: no copy."""
    for budget in (None, 0):
        root = tmp_path / str(budget)
        staging = StagingConfig(overlap=True, budget_bytes=budget, check_fence=True)
        mgr = CheckpointManager(
            [Level(str(root / "l1"), every=1, keep=3)], async_save=True, staging=staging
        )
        # 256 MiB: its copy or write is still running when save() returns, so a
        # wait_for_staging that did not wait would let the change below into the
        # save (the fence check fails it).
        sd = {"w": torch.randn(64, 1 << 20), "b": torch.zeros(7)}
        expected = {}
        for step in range(1, 4):
            mgr.save(sd, step=step)
            expected[step] = {k: v.clone() for k, v in sd.items()}
            mgr.wait_for_staging()
            for v in sd.values():  # the optimizer step, after the fence
                v.add_(1.0)
        mgr.wait()
        assert mgr.steps(0) == [1, 2, 3]
        for step, want in expected.items():
            back = {k: torch.empty_like(v) for k, v in sd.items()}
            mgr.load(back, step)
            assert all(torch.equal(back[k], want[k]) for k in want), (budget, step)
        mgr.close()
