"""CheckpointManager.step: one save decision on every rank, and saving on SIGTERM.

Real processes (gloo), real files, real signals.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import BalancedSavePlanner, CheckpointManager, Level
from dcp_multilevel.checkpoint import CheckpointRoot, StoredCheckpoint
from dcp_multilevel.manage.manager import SCHEDULE_KEY
from dcp_multilevel.schedule import (
    ConvergenceAware,
    FailureModel,
    FixedInterval,
    Interval,
    IntervalPolicy,
    OverheadBound,
    ProgressValue,
    YoungDaly,
)
from tests._dist import run_ranks

pytestmark = pytest.mark.multiprocess


def _state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


class FailOnRankOne(BalancedSavePlanner):
    """Fails the planning of rank 1's second save (a save failing on one rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def create_local_plan(self):
        self.calls += 1
        if torch.distributed.get_rank() == 1 and self.calls == 2:
            raise RuntimeError("rank 1 cannot plan this save")
        return super().create_local_plan()


def _adaptive_job(rank: int, world: int, root: str) -> list[tuple[int, list[str] | str]]:
    levels = [Level(f"{root}/l1", keep=2), Level(f"{root}/remote", keep=2)]
    # A tiny mean time between failures: Young/Daly saves every fraction of a second;
    # the losses (which differ per rank) scale the intervals.
    policy = ConvergenceAware(YoungDaly(FailureModel(0.0002), default_cost=0.02))
    records: list[dict] = []
    mgr = CheckpointManager(
        levels,
        schedule=policy,
        planner=FailOnRankOne(),
        drain_policy="wait",
        on_metrics=records.append,
    )
    taken: list[tuple[int, list[str] | str]] = []
    for step in range(2000):
        if len(taken) >= 4:  # the same step on every rank while their decisions agree
            break
        time.sleep(0.01 * (1 + rank))  # ranks at different paces, losses that differ
        try:
            metrics = mgr.step(_state(step), step=step, loss=10.0 / (step + 1) + rank)
        except CheckpointException:
            taken.append((step, "failed"))
            continue
        if metrics is not None:
            taken.append((step, metrics.drains_started))
    mgr.close()
    # Every decision that saved is explained: which rule fired, on what, with what interval.
    decisions = [r for r in records if r["kind"] == "decision"]
    assert [r["step"] for r in decisions] == [step for step, _ in taken]
    for r in decisions:
        assert "young-daly" in r["policy"] and r["intervals"]["0"] > 0
        assert {"blocked_seconds", "rates_per_hour", "rules"} <= set(r["inputs"])
    return taken


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_takes_rank_0s_decisions_even_after_a_failed_save(tmp_path, world):
    taken = run_ranks(_adaptive_job, world, str(tmp_path), timeout=240)
    assert all(t == taken[0] for t in taken), taken
    saves = [step for step, what in taken[0] if what != "failed"]
    assert len(saves) == 3 and [what for _, what in taken[0]].count("failed") == 1, taken[0]
    assert any(what and what != "failed" for _, what in taken[0])  # the remote took some


def _sigterm_job(rank: int, world: int, root: str) -> tuple[str, int, int]:
    levels = [Level(f"{root}/l1", every=1000), Level(f"{root}/remote", every=1000)]
    mgr = CheckpointManager(
        levels, schedule=FixedInterval(), save_on_sigterm=True, check_seconds=0.0
    )
    step = 1
    try:
        for step in range(1, 200):
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told
            time.sleep(0.005)
            mgr.step(_state(step), step=step)
    except SystemExit as e:
        return "exited", e.code, step
    finally:
        handler = signal.getsignal(signal.SIGTERM)
    return "ran out", handler == signal.SIG_DFL, step


def _resume_job(rank: int, world: int, root: str) -> int | None:
    mgr = CheckpointManager([Level(f"{root}/l1"), Level(f"{root}/remote")])
    state = {"w": torch.zeros(64, 64), "step": -1}
    step = mgr.load_latest(state)
    mgr.close()
    assert step is not None and torch.equal(state["w"], _state(step)["w"])
    return step


def test_sigterm_on_one_rank_saves_the_same_step_everywhere_then_exits(tmp_path):
    out = run_ranks(_sigterm_job, 2, str(tmp_path), timeout=240)
    assert [o[:2] for o in out] == [("exited", 143), ("exited", 143)], out
    stopped = out[0][2]
    assert out[1][2] == stopped and stopped >= 5
    assert (tmp_path / "l1" / f"step-{stopped}" / "manifest.json").exists()
    assert not (tmp_path / "remote").exists() or not list((tmp_path / "remote").iterdir())
    assert run_ranks(_resume_job, 2, str(tmp_path), timeout=240) == [stopped, stopped]


def _bounded_job(rank: int, world: int, root: str) -> tuple[list[dict], float, float]:
    levels = [Level(f"{root}/l1", keep=2)]
    policy = OverheadBound(YoungDaly(FailureModel(0.0002), ("first",)), target=0.25)
    records: list[dict] = []
    mgr = CheckpointManager(
        levels, schedule=policy, planner=SlowFirstSave(), on_metrics=records.append
    )
    for step in range(4000):
        # At least 800 steps, then until three decisions, whatever the machine's load
        # (decisions are agreed: the same step on every rank).
        if step >= 800 and sum(r["kind"] == "decision" for r in records) >= 3:
            break
        time.sleep(0.01)
        mgr.step(_state(step), step=step)
    mgr.close()
    # Each decision against the saves' own records before it: what the schedule was
    # told the run had blocked, and what the save records say it blocked.
    told, saved, blocked = [], [], 0.0
    for r in records:
        if r["kind"] == "decision":
            told.append(r["inputs"]["run_blocked_seconds"])
            saved.append(blocked)
        elif r["kind"] == "save":
            blocked += r["blocked_seconds"]
    return [r for r in records if r["kind"] == "decision"], told, saved


class SlowFirstSave(BalancedSavePlanner):
    """The first save blocks training for a second (a cold first save, measured by nobody)."""

    calls = 0

    def create_local_plan(self):
        SlowFirstSave.calls += 1
        if SlowFirstSave.calls == 1:
            time.sleep(1.0)
        return super().create_local_plan()


def test_the_manager_tells_the_overhead_bound_the_runs_blocked_time(tmp_path):
    (decisions, told, saved), _ = run_ranks(_bounded_job, 2, str(tmp_path), timeout=240)
    # Each decision says how long the run had been blocked by then: 0 before the
    # first save, then at least the slow first save's second, never less later.
    assert len(decisions) >= 3
    assert told[0] == 0 and told[1] >= 1.0 and told == sorted(told), told
    # One measure of a save's cost: exactly what the save records before it say
    # (the bound the policy keeps from these inputs: tests/unit/test_schedule.py).
    assert told == pytest.approx(saved), (told, saved)


class _EveryCheck(IntervalPolicy):
    """Every level at every check: a save each few steps, whatever the clock."""

    def intervals(self, observation):
        return {s.index: Interval(1e-9, "every-check") for s in observation.levels}, {}


def _kept(root: str, level: str, step: int) -> dict:
    manifest = StoredCheckpoint.at(f"{root}/{level}/step-{step}").manifest()
    return manifest.extra[SCHEDULE_KEY]


def _schedule_job(rank: int, world: int, root: str) -> int:
    policy = ProgressValue(_EveryCheck(), min_steps=2)
    levels = [Level(f"{root}/l1", keep=3), Level(f"{root}/remote", keep=3)]
    mgr = CheckpointManager(levels, schedule=policy, drain_policy="wait")
    last = None
    for step in range(1, 40):
        time.sleep(0.005)
        if mgr.step(_state(step), step=step, loss=5.0 / step + 0.01 * rank) is not None:
            last = step
    mgr.wait()
    mgr.close()
    return last


def _schedule_resume(rank: int, world: int, root: str) -> tuple[int, dict | None, float, list]:
    policy = ProgressValue(_EveryCheck(), min_steps=2)
    mgr = CheckpointManager(
        [Level(f"{root}/l1", keep=3), Level(f"{root}/remote", keep=3)], schedule=policy
    )
    state = {"w": torch.zeros(64, 64), "step": -1}
    step = mgr.load_latest(state)
    clock, levels = mgr._cadence.clock, sorted(mgr._cadence._last)
    mgr.close()
    return step, policy.state(), clock, levels


def test_a_restarted_job_goes_on_with_the_schedule_it_kept(tmp_path, caplog):
    """Each save keeps rank 0's schedule state (the clock, each level's last save,
    the policy's learnt curve) in its manifest, drains carry it to the next level,
    and load_latest gives it back to every rank: from the first level, and from
    the remote once the first level is gone."""
    root = str(tmp_path)
    last = run_ranks(_schedule_job, 2, root, timeout=240)[0]
    drained = CheckpointRoot(f"{root}/remote").steps()[-1]  # a drain may skip the newest
    assert drained in CheckpointRoot(f"{root}/l1").steps()
    assert _kept(root, "remote", drained) == _kept(root, "l1", drained)  # the drain carried it
    for gone, step in ((None, last), ("l1", drained)):
        if gone:
            shutil.rmtree(tmp_path / gone)
        kept = _kept(root, "remote" if gone else "l1", step)
        assert kept["clock"] > 0.1 and kept["last"]["0"][0] == step
        curve = kept["policy"]["own"]
        assert curve["steps"][-1] == step and curve["losses"][-1] == pytest.approx(5.0 / step)
        out = run_ranks(_schedule_resume, 2, root, timeout=240)
        assert [o[0] for o in out] == [step, step]
        assert out[0][1] == out[1][1] == kept["policy"]  # rank 0's curve, on every rank
        assert all(o[2] >= kept["clock"] for o in out)
        # Each level's last save comes back, but a wiped level has none.
        assert [o[3] for o in out] == [[1] if gone else [0, 1]] * 2
    # Another schedule keeps going, from the clock, with its own policy afresh.
    mgr = CheckpointManager([Level(f"{root}/remote")], schedule=FixedInterval())
    with caplog.at_level("WARNING", logger="dcp_multilevel"):
        assert mgr.load_latest({"w": torch.zeros(64, 64), "step": -1}) == drained
    mgr.close()
    assert "kept the state of another schedule" in caplog.text
