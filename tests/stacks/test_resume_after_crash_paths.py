"""After a crash that lost the newest step with a node: resume from the newest
restorable step, then save the next steps, on every path other than plain DCP
(that one: ``test_resume_after_crash.py``): ``CheckpointManager`` (sync and
async) and the torchtitan, Lightning and Accelerate adapters, each resumed
through its own API (``load_latest``, ``load(step=-1)``,
``fit(ckpt_path="ckpt/last.ckpt")``, ``load_state(dir)``).

Real processes (gloo), real files: 2 simulated nodes of 1 rank each
(``DCP_ML_NODE``, ``{node}`` in the level paths), losing a node is deleting
its directory. The levels are a node-local first level and a ``partner:``
level with ``every=2`` (the manager's and torchtitan's schedule: even step
numbers; Lightning and Accelerate, whose saves go through a plain writer:
every 2nd save of the level list). The first run's newest step is on the first
level only: once node 1's directory is gone no rank can restore it, and the
resume goes one step back, bit-exact. The resumed run saves the lost step
again (replacing node 0's copy of the lost timeline's step, logged; Accelerate
goes on numbering after it instead) and the steps after it; the newest
reaches the partner level, and a new run, after node 1 is lost again, loads it
back bit-exact.

Lightning loads the model and the optimizer states in two loads of one
checkpoint; the same done with plain DCP (the second load by the step's number)
saves on as well (the last test).
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _logs import Warnings
from _required import require
from torch.distributed.checkpoint.api import CheckpointException

import dcp_multilevel
from dcp_multilevel import CheckpointManager, Level, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import run_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2


def _levels(root: str) -> list[Level]:
    return [
        Level(f"{root}/n{{node}}/l1", keep=3),
        Level(f"partner:{root}/n{{node}}/partner", every=2, keep=3),
    ]


def _steps(path) -> list[int]:
    """The steps committed in a level's folder on one node (those with a manifest)."""
    if not path.exists():
        return []
    return sorted(
        int(p.name[5:])
        for p in path.iterdir()
        if p.name.startswith("step-") and (p / "manifest.json").is_file()
    )


def _kept() -> Warnings:
    return Warnings().attach()


def _replacing(kept: Warnings) -> list[str]:
    return [m for m in kept.messages if m.startswith("dcp_multilevel: replacing")]


def _lose_node_1(tmp_path) -> None:
    shutil.rmtree(tmp_path / "n1")  # node 1's disk, with its only copy of the newest step


def _check_levels_after(root, partner_steps: set[int], newest: int, part: str = "") -> None:
    """Both nodes hold the resumed run's steps: the newest on the first level (its
    manifest on rank 0's node only, each node its own rank's files), ``partner_steps``
    on the partner level (a manifest on each node). ``part``: Accelerate's part, whose
    checkpoints are below each level's folder."""
    assert newest in _steps(root / "n0" / "l1" / part)
    for node in range(WORLD):  # one rank per node: rank `node`'s files
        files = os.listdir(root / f"n{node}" / "l1" / part / f"step-{newest}" / "data")
        assert any(f.startswith(f"{node}-") for f in files), (node, part, files)
        held = set(_steps(root / f"n{node}" / "partner" / part))
        assert partner_steps <= held, (node, part, held)


# ---------------------------------------------------------------- CheckpointManager

#: The manager's and plain DCP's first run saves steps 1-5: step 5 is lost with node 1.
LOST = 5


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(32, 48, generator=g),
        "b": torch.randn(300, generator=g).to(torch.bfloat16),
        "step": step,
    }


def _blank() -> dict:
    return {"w": torch.zeros(32, 48), "b": torch.zeros(300, dtype=torch.bfloat16), "step": -1}


def _manager_first_run(rank: int, world: int, root: str, async_save: bool) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root), async_save=async_save)
    for step in range(1, LOST + 1):  # the schedule: even steps go to the partner level
        mgr.save(_state(step), step=step)
    mgr.wait()
    mgr.close()


def _manager_resumed_run(rank: int, world: int, root: str, async_save: bool) -> dict:
    os.environ["DCP_ML_NODE"] = str(rank)
    kept = _kept()
    mgr = CheckpointManager(_levels(root), async_save=async_save)
    state = _blank()
    resumed = mgr.load_latest(state)
    exact = resumed is not None and bit_equal(state, _state(resumed))
    saved = []
    for step in range(resumed + 1, resumed + 5):
        metrics = mgr.save(_state(step), step=step)  # no CheckpointExistsError
        saved.append(metrics.step)
    results = mgr.wait()
    mgr.close()
    return {
        "resumed": resumed,
        "exact": exact,
        "saved": saved,
        "drained": sorted({(r.step, r.level) for r in results if r.committed}),
        "failed": [r.error for r in results if r.error],
        "replacing": _replacing(kept),
    }


def _manager_load(rank: int, world: int, root: str) -> tuple[int | None, bool, list[str]]:
    """A new manager's ``load_latest``: the step, bit-exact, where node 1's files came from."""
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root))
    state = _blank()
    step = mgr.load_latest(state)
    mgr.close()
    received = sorted(mgr.last_restore.received) if mgr.last_restore else []
    return step, step is not None and bit_equal(state, _state(step)), received


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoint_manager_resumes_after_losing_a_node_and_saves_on(tmp_path, async_save):
    root = str(tmp_path)
    run_ranks(_manager_first_run, WORLD, root, async_save)
    assert _steps(tmp_path / "n0" / "l1") == [3, 4, 5]
    assert _steps(tmp_path / "n1" / "partner") == [2, 4]
    _lose_node_1(tmp_path)
    out = run_ranks(_manager_resumed_run, WORLD, root, async_save)
    lost = LOST
    for rank, got in enumerate(out):
        assert got["resumed"] == lost - 1, got
        assert got["exact"], f"rank {rank} did not restore step {lost - 1} bit-exact"
        assert got["saved"] == [lost, lost + 1, lost + 2, lost + 3], got
        assert got["failed"] == [], got
    partner = f"partner:{root}/n0/partner"
    assert {s for s, lv in out[0]["drained"] if lv == partner} >= {lost + 1, lost + 3}
    _check_levels_after(tmp_path, {lost + 1, lost + 3}, lost + 3)
    (replacing,) = out[0]["replacing"]
    assert replacing.startswith(f"dcp_multilevel: replacing step {lost} on {root}/n0/l1 (save ")
    assert replacing.endswith(" of the resumed run"), replacing
    # Node 1 lost again: the newest step comes back from the partner level, as saved.
    _lose_node_1(tmp_path)
    loaded = run_ranks(_manager_load, WORLD, root)
    assert [got[:2] for got in loaded] == [(lost + 3, True)] * WORLD, loaded
    assert f"partner:{root}/n{{node}}/partner (node 0)" in loaded[1][2], loaded[1][2]


# ---------------------------------------------------------------- torchtitan


def _titan_job(
    rank: int, world: int, root: str, options: dict, run_to: int, snapshot_at: list[int]
) -> dict:
    """torchtitan's job (``test_integration_torchtitan._job``: its checkpointer, optimizers,
    lr schedulers and dataloader driven as ``Trainer.train`` drives them), killed after
    step ``run_to`` of 20; with the replacements its saves logged."""
    import test_integration_torchtitan as titan

    kept = _kept()
    out = titan._job(rank, world, root, dict(options), run_to, 20, snapshot_at)
    return {**out, "replacing": _replacing(kept)}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_torchtitan_resumes_after_losing_a_node_and_saves_on(tmp_path, async_mode):
    titan = require("test_integration_torchtitan")
    root = str(tmp_path)
    # interval=1: torchtitan saves every step; the schedule (FixedInterval) sends the even
    # ones to the partner level. Killed after step 5: step 5 is on the first level only.
    options = {"interval": 1, "levels": _levels(root), "async_mode": async_mode}
    first = run_ranks(_titan_job, WORLD, root, options, 5, [4])
    assert first[0]["saved"] == [1, 2, 3, 4, 5]
    _lose_node_1(tmp_path)
    # The restart: torchtitan's load(step=-1), as its Trainer makes it; then steps 5-8.
    resumed = run_ranks(_titan_job, WORLD, root, options, 8, [8])
    for rank in range(WORLD):
        got = resumed[rank]
        assert got["load_returned"] and got["loaded"] == 4, got["loaded"]
        titan._assert_same(
            got["snapshots"]["loaded"], first[rank]["snapshots"][4], f"rank {rank} after load"
        )
        assert got["saved"] == [5, 6, 7, 8]
        assert {6, 8} <= set(got["levels"][1]), got["levels"]
    _check_levels_after(tmp_path, {6, 8}, 8)
    (replacing,) = resumed[0]["replacing"]
    assert replacing.startswith(f"dcp_multilevel: replacing step 5 on {root}/n0/l1 (save ")
    # Node 1 lost again: the newest step comes back from the partner level, as saved.
    _lose_node_1(tmp_path)
    again = run_ranks(_titan_job, WORLD, root, options, 8, [])
    for rank in range(WORLD):
        assert again[rank]["loaded"] == 8
        titan._assert_same(
            again[rank]["snapshots"]["loaded"],
            resumed[rank]["snapshots"][8],
            f"rank {rank} after the second load",
        )
        assert any("partner" in source for source in again[1]["restore"]), again[1]["restore"]


# ---------------------------------------------------------------- Lightning


def _lightning_fit(rank: int, world: int, root: str, ckpt_path: str | None, epochs: int) -> dict:
    """``Trainer.fit`` for ``epochs`` epochs of 3 steps (``test_integration_lightning``'s
    job), a ``ModelCheckpoint`` saving a top-k checkpoint and ``last.ckpt`` at each
    epoch's end, resuming from ``ckpt_path``. The weights and AdamW states (as bytes)
    where training starts and at each epoch's end, by global step."""
    import test_integration_lightning as lt
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_integration_accelerate import _local_bytes

    lt._as_node(rank)
    kept = _kept()
    module = lt._module("fsdp2")
    taken: dict[str, dict] = {}

    def take(when: str) -> None:
        state = _local_bytes(module, module.trainer.optimizers[0])
        # param_groups' lr is stepped at each epoch's end, after the checkpoint
        taken[when] = {k: v for k, v in state.items() if k.startswith(("model.", "optim.state."))}
        taken[when]["global_step"] = module.trainer.global_step

    module.on_train_start = lambda: take("start")
    module.on_train_epoch_end = lambda: take(f"step-{module.trainer.global_step}")
    callback = ModelCheckpoint(
        dirpath=os.path.join(root, "ckpt"),
        filename="{epoch}-{step}",
        save_last=True,
        save_on_train_epoch_end=True,
    )
    trainer = lt._trainer(
        lt._level_strategy(_levels(root)), os.path.join(root, "run"), epochs, [callback]
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return {"taken": taken, "replacing": _replacing(kept), "global_step": trainer.global_step}


def test_lightning_resumes_from_last_ckpt_after_losing_a_node_and_saves_on(tmp_path):
    require("test_integration_lightning")
    require("accelerate")  # its test's _local_bytes
    root = str(tmp_path)
    ckpt_path = str(tmp_path / "ckpt" / "last.ckpt")
    # 3 epochs: saves at steps 3, 6, 9; every=2 sends the 2nd save (6) to the partner level.
    first = run_ranks(_lightning_fit, WORLD, root, None, 3, timeout=180)
    assert _steps(tmp_path / "n0" / "l1") == [3, 6, 9]
    assert _steps(tmp_path / "n1" / "partner") == [6]
    _lose_node_1(tmp_path)
    # last.ckpt names step 9, lost with node 1: the resume goes to step 6, the newest
    # every rank can restore; epochs 3 and 4 save steps 9 (again) and 12.
    resumed = run_ranks(_lightning_fit, WORLD, root, ckpt_path, 4, timeout=180)
    for rank in range(WORLD):
        got, expected = resumed[rank]["taken"], first[rank]["taken"]
        assert got["start"]["global_step"] == 6, got["start"]["global_step"]
        differ = [k for k in expected["step-6"] if got["start"][k] != expected["step-6"][k]]
        assert not differ, f"rank {rank}: {differ}"
        assert resumed[rank]["global_step"] == 12
    _check_levels_after(tmp_path, {12}, 12)
    (replacing,) = resumed[0]["replacing"]
    assert replacing.startswith(f"dcp_multilevel: replacing step 9 on {root}/n0/l1 (save ")
    # Node 1 lost again: last.ckpt (step 12) comes back from the partner level, as saved.
    _lose_node_1(tmp_path)
    again = run_ranks(_lightning_fit, WORLD, root, ckpt_path, 5, timeout=180)
    for rank in range(WORLD):
        got, expected = again[rank]["taken"]["start"], resumed[rank]["taken"]["step-12"]
        assert got["global_step"] == 12
        differ = [k for k in expected if got[k] != expected[k]]
        assert not differ, f"rank {rank}: {differ}"


# ---------------------------------------------------------------- Accelerate


def _accelerate_job(rank: int, world: int, root: str, resume: bool, saves: int) -> dict:
    """``test_integration_accelerate``'s FSDP2 job on CPU: ``load_state`` of the folder
    (``resume``), then ``saves`` times a training step and ``save_state`` into the same
    folder. The model and AdamW shards (as bytes) after the load and at each save, by
    the step it saved."""
    from test_integration_accelerate import _fsdp2_on_cpu, _local_bytes, _prepared, _step

    warnings.filterwarnings("ignore")
    os.environ["DCP_ML_NODE"] = str(rank)
    kept = _kept()
    accelerator = _fsdp2_on_cpu(rank, world, levels=_levels(root))
    parts = _prepared(accelerator, seed=1 if resume else 0)  # a restart: other weights
    ckpt = os.path.join(root, "ckpt")
    out: dict = {"taken": {}}
    if resume:
        accelerator.load_state(ckpt)
        out["taken"]["loaded"] = _local_bytes(*parts[:2])
        out["save_iteration"] = accelerator.save_iteration
    for i in range(saves):
        _step(accelerator, *parts, i, rank)
        step = accelerator.save_iteration
        accelerator.save_state(ckpt)  # no CheckpointExistsError
        out["taken"][step] = _local_bytes(*parts[:2])
    accelerator.wait_for_checkpoints()
    out["replacing"] = _replacing(kept)
    out["loading"] = [m for m in kept.messages if m.startswith("dcp_multilevel: loading step")]
    return out


def test_accelerate_resumes_after_losing_a_node_and_saves_on(tmp_path):
    accelerate = require("test_integration_accelerate")
    root = str(tmp_path)
    # save_state 3 times: steps 0, 1, 2 of each part; every=2 sends the 2nd save (step 1)
    # to the partner level. The folder's marker names step 2.
    first = run_ranks(_accelerate_job, WORLD, root, False, 3, timeout=180)
    for part in accelerate.PARTS:
        assert _steps(tmp_path / "n0" / "l1" / part) == [0, 1, 2], part
        assert _steps(tmp_path / "n1" / "partner" / part) == [1], part
    _lose_node_1(tmp_path)
    # load_state(folder): its marker names step 2, lost with node 1: every part is
    # loaded at step 1, the newest every rank can restore in every part. The numbering
    # goes on after the marker's step: the next saves are steps 3 and 4.
    resumed = run_ranks(_accelerate_job, WORLD, root, True, 2, timeout=180)
    for rank in range(WORLD):
        got = resumed[rank]
        assert got["taken"]["loaded"] == first[rank]["taken"][1], f"rank {rank}"
        assert got["save_iteration"] == 3
        assert sorted(k for k in got["taken"] if k != "loaded") == [3, 4]
        assert got["loading"] == [
            "dcp_multilevel: loading step 1 of the levels, the newest every rank can restore "
            "in every part (not steps [2]); Accelerate's own files in "
            f"{root}/ckpt (RNG states, schedulers, samplers) are those of step 2's save"
        ], got["loading"]
    for part in accelerate.PARTS:  # steps 3 and 4 saved; 4, the 4th save, on the partner level
        _check_levels_after(tmp_path, {4}, 4, part)
    assert resumed[0]["replacing"] == []  # no step saved again
    # Node 1 lost again: the newest step (4) comes back from the partner level, as saved.
    _lose_node_1(tmp_path)
    again = run_ranks(_accelerate_job, WORLD, root, True, 0, timeout=180)
    for rank in range(WORLD):
        assert again[rank]["taken"]["loaded"] == resumed[rank]["taken"][4], f"rank {rank}"
        assert again[rank]["save_iteration"] == 5


# ---------------------------------------------------------------- plain DCP, loaded in parts


def _plain_first_run(rank: int, world: int, root: str) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    for step in range(1, LOST + 1):  # every 2nd save goes to the partner level
        writer = MultiLevelWriter(f"step-{step}", levels=_levels(root))
        dcp.save({"model": _state(step), "optim": _state(-step)}, storage_writer=writer)
    dcp_multilevel.wait()


def _plain_resumed_in_parts(rank: int, world: int, root: str) -> dict:
    """The model from ``"latest"``, then the optimizer from the step that load read, by
    its number (two loads of one checkpoint, as Lightning makes them); then the next save."""
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = _levels(root)
    model = {"model": _blank()}
    reader = MultiLevelReader("latest", levels=levels)
    dcp.load(model, storage_reader=reader)
    resumed = reader.loads.restore.step
    optim = {"optim": _blank()}
    dcp.load(optim, storage_reader=MultiLevelReader(f"step-{resumed}", levels=levels))
    step = resumed + 1
    saved = "saved"
    try:
        writer = MultiLevelWriter(f"step-{step}", levels=levels)
        dcp.save({"model": _state(step), "optim": _state(-step)}, storage_writer=writer)
    except CheckpointException as e:  # DCP carries our CheckpointExistsError in it
        saved = "refused" if "which the load did not pass over" in str(e) else str(e)
    dcp_multilevel.wait()  # the restore's copies made again for node 1
    return {"resumed": resumed, "saved": saved}


def test_a_checkpoint_loaded_in_two_parts_after_losing_a_node_saves_on(tmp_path):
    root = str(tmp_path)
    run_ranks(_plain_first_run, WORLD, root)
    _lose_node_1(tmp_path)
    out = run_ranks(_plain_resumed_in_parts, WORLD, root)
    assert out == [{"resumed": LOST - 1, "saved": "saved"}] * WORLD, out
