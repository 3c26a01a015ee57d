"""After a crash that lost the newest step with a node: resume from the newest
restorable step, then save the next steps, through plain ``dcp.save`` and
``dcp.async_save`` as the README shows it.

Real processes (gloo), real files: each simulated node is a directory
(``DCP_ML_NODE`` per process, ``{node}`` in the level paths), losing a node is
deleting its directory. The newest step is saved on the first level only
(``due=[]``): once node 1's directory is gone, no rank can restore it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _logs import Warnings
from torch.distributed.checkpoint.api import CheckpointException

import dcp_multilevel
from dcp_multilevel import Level, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import run_ranks

pytestmark = pytest.mark.multiprocess

#: The newest step of the first run: on the first level only, lost with node 1.
LOST = 6


def _state(step: int, rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 96, generator=g),
        "b": torch.randn(500, generator=g).to(torch.bfloat16),
        "n": torch.full((8,), float(step)),
        "step": step,
    }


def _blank() -> dict:
    return {
        "w": torch.zeros(64, 96),
        "b": torch.zeros(500, dtype=torch.bfloat16),
        "n": torch.zeros(8),
        "step": -1,
    }


def _levels(root: str) -> list[Level]:
    return [
        Level(f"{root}/n{{node}}/l1", keep=3),
        Level(f"partner:{root}/n{{node}}/partner", keep=3),
        Level(f"{root}/remote", every=2, keep=3),  # a store every node reaches
    ]


def _save(state: dict, step: int, levels: list[Level], mode: str, **kw) -> None:
    writer = MultiLevelWriter(f"step-{step}", levels=levels, **kw)
    if mode == "async":
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)


def _first_run(rank: int, world: int, root: str) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = _levels(root)
    for step in range(1, LOST):
        _save(_state(step, rank), step, levels, "sync")
    dcp_multilevel.wait()  # steps 1-5 are on their levels
    _save(_state(LOST, rank), LOST, levels, "sync", due=[])  # the first level only


def _resumed_run(rank: int, world: int, root: str, mode: str) -> dict:
    os.environ["DCP_ML_NODE"] = str(rank)
    kept = Warnings().attach()
    levels = _levels(root)
    assert dcp_multilevel.newest_step(levels) == LOST  # node 0 still lists it
    state = _blank()
    reader = MultiLevelReader("latest", levels=levels)
    dcp.load(state, storage_reader=reader)
    resumed = reader.loads.restore.step
    exact = bit_equal(state, _state(resumed, rank))
    results = []
    for step in range(resumed + 1, resumed + 4):
        _save(_state(step, rank), step, levels, mode)
        results += dcp_multilevel.wait()  # each step's drains land before the next save
    # The steps saved again are the resumed run's, on every level that holds them.
    again = _blank()
    dcp.load(again, storage_reader=MultiLevelReader(f"step-{LOST}", levels=levels))
    return {
        "resumed": resumed,
        "exact": exact,
        "lost_step_new": bit_equal(again, _state(LOST, rank)),
        "drained": sorted({(r.step, r.level) for r in results if r.committed}),
        "failed": [r.error for r in results if r.error],
        "replacing": [m for m in kept.messages if m.startswith("dcp_multilevel: replacing")],
    }


def _resumed_by_number(rank: int, world: int, root: str) -> str:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = _levels(root)
    state = _blank()
    # Step 4, by its number: steps 5 and 6 are committed on the first level (keep=3).
    dcp.load(state, storage_reader=MultiLevelReader("step-4", levels=levels))
    try:
        _save(_state(5, rank), 5, levels, "sync")
    except CheckpointException as e:  # DCP carries our CheckpointExistsError in it
        outcome = str(e)
    else:
        outcome = "saved"
    dcp_multilevel.wait()  # the restore's copies made again, before the group goes
    return outcome


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_resumed_after_losing_a_node_saves_the_next_steps(tmp_path, mode):
    root = str(tmp_path)
    run_ranks(_first_run, 2, root)
    shutil.rmtree(tmp_path / "n1")  # node 1's disk is lost with step 6's only copy of its part
    out = run_ranks(_resumed_run, 2, root, mode)
    for rank, got in enumerate(out):
        assert got["resumed"] == LOST - 1, got
        assert got["exact"], f"rank {rank} did not restore step {LOST - 1} bit-exact"
        assert got["lost_step_new"], f"rank {rank}: step {LOST} is not the resumed run's"
        assert got["failed"] == [], got
    remote, partner = f"{root}/remote", f"partner:{root}/n0/partner"
    drained = out[0]["drained"]
    # Every step the resumed run saved reached its levels: the partner level each,
    # the remote every 2nd save of the level list (the count goes on from the first run).
    # (and step 5 again: node 1's partner copies of it were lost with node 1).
    assert {s for s, lv in drained if lv == partner} == {LOST - 1, LOST, LOST + 1, LOST + 2}, (
        drained
    )
    assert {s for s, lv in drained if lv == remote} == {LOST, LOST + 2}, drained
    # The coordinator logged the replacement of the lost timeline's step, both saves named.
    (replacing,) = out[0]["replacing"]
    assert replacing.startswith(f"dcp_multilevel: replacing step {LOST} on {root}/n0/l1 (save "), (
        replacing
    )
    assert f", passed over by the load of step {LOST - 1}) with save " in replacing
    assert replacing.endswith(" of the resumed run")


def test_a_run_resumed_from_an_older_step_by_number_refuses_to_replace_newer_ones(tmp_path):
    root = str(tmp_path)
    run_ranks(_first_run, 2, root)
    out = run_ranks(_resumed_by_number, 2, root)
    for message in out:
        assert "Checkpoint already exists at" in message, message
        assert "This run resumed from step 4, older than step 5, which the load did not pass " in (
            message
        )
        assert "overwrite=True" in message


_ASYNC_OF_A_COMMITTED_STEP = textwrap.dedent(
    """
    import sys, torch
    import torch.distributed.checkpoint as dcp
    import dcp_multilevel
    from dcp_multilevel import Level, MultiLevelWriter

    levels = [Level(sys.argv[1] + "/l1"), Level(sys.argv[1] + "/l2")]
    dcp.save({"w": torch.ones(4)}, storage_writer=MultiLevelWriter("step-1", levels=levels))
    future = dcp.async_save({"w": torch.ones(4)},
                            storage_writer=MultiLevelWriter("step-1", levels=levels))
    try:
        future.result()
    except BaseException as e:
        print("refused:", "Checkpoint already exists" in str(e))
    dcp_multilevel.wait()
    print("waited")
    """
)


def test_a_failed_async_save_leaves_nothing_to_wait_for(tmp_path):
    """The async save of a committed step fails in planning, on DCP's thread: wait()
    and the interpreter's exit return (no ticket left open)."""
    proc = subprocess.run(
        [sys.executable, "-c", _ASYNC_OF_A_COMMITTED_STEP, str(tmp_path)],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["refused: True", "waited"], proc.stdout


def _one_rank_fails_planning(rank: int, world: int, root: str, mode: str) -> str:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Broken(DefaultSavePlanner):
        def create_local_plan(self):
            if rank == 1:
                raise RuntimeError("rank 1's planner broke")
            return super().create_local_plan()

    levels = [Level(f"{root}/n{{node}}/l1"), Level(f"{root}/remote")]
    os.environ["DCP_ML_NODE"] = str(rank)
    writer = MultiLevelWriter("step-1", levels=levels)
    try:
        if mode == "async":
            dcp.async_save(_state(1, rank), storage_writer=writer, planner=Broken()).result()
        else:
            dcp.save(_state(1, rank), storage_writer=writer, planner=Broken())
    except CheckpointException as e:
        outcome = f"{type(e).__name__}"
    else:
        outcome = "saved"
    dcp_multilevel.wait()  # returns: the failed save left no ticket open on any rank
    _save(_state(2, rank), 2, levels, mode)  # and the next save goes through
    dcp_multilevel.wait()
    return outcome


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_that_fails_on_one_rank_only_leaves_no_rank_waiting(tmp_path, mode):
    out = run_ranks(_one_rank_fails_planning, 2, str(tmp_path), mode, timeout=120)
    assert out == ["CheckpointException", "CheckpointException"]
    assert (tmp_path / "remote" / "step-2" / "manifest.json").exists()
