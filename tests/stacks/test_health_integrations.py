"""The training-stack adapters resume from the newest clean step (``docs/health.md``).

Each stack runs as in its own adapter test (``test_integration_*.py``, whose jobs and
helpers these reuse): 2 gloo ranks, each a simulated node (``DCP_ML_NODE``) with a
node-local first level (Accelerate: a shared one), and a shared folder as the higher
level. A few clean saves, then a NaN in an AdamW moment: the saves after it are
quarantined. The resume a user of the stack makes "from the latest" loads the newest
clean step, bit for bit, and no quarantined step reached the higher level.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _required import require

from dcp_multilevel import Level
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.testing import run_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2


def _levels(root: str, first: str = "n{node}/l1") -> list[Level]:
    return [Level(f"{root}/{first}"), Level(f"{root}/remote")]


def _steps(path) -> list[int]:
    """The steps in a level's folder (a node-local level: the manifest is on node 0's)."""
    if not path.exists():
        return []
    return sorted(int(p.name[5:]) for p in path.iterdir() if p.name.startswith("step-"))


def _quarantined(path) -> bool:
    return StoredCheckpoint.at(str(path)).manifest().quarantined


def _poison(optimizer: torch.optim.Optimizer) -> None:
    """A NaN in the first AdamW moment of this rank (its shard of it), as after a divergence."""
    for state in optimizer.state.values():
        moment = state["exp_avg"]
        local = moment.to_local() if hasattr(moment, "to_local") else moment
        local.view(-1)[0] = float("nan")
        return


# ---------------------------------------------------------------- torchtitan


def _titan_job(
    rank: int,
    world: int,
    root: str,
    options: dict,
    run_to: int,
    total: int,
    snapshot_at: list[int],
    poison_after: int | None,
) -> dict:
    """torchtitan's job (``test_integration_torchtitan._job``); with ``poison_after``, its
    optimizers get a NaN after that many steps."""
    import test_integration_torchtitan as titan
    from torchtitan.components.optimizer import OptimizersContainer

    if poison_after is not None:
        step = OptimizersContainer.step
        taken = [0]

        def step_then_poison(self, *args, **kwargs):
            step(self, *args, **kwargs)
            taken[0] += 1
            if taken[0] == poison_after:
                _poison(self.optimizers[0])

        OptimizersContainer.step = step_then_poison
    return titan._job(rank, world, root, options, run_to, total, snapshot_at)


def test_torchtitan_resumes_from_the_newest_clean_step(tmp_path):
    titan = require("test_integration_torchtitan")
    root = str(tmp_path)
    options = {"interval": 2, "levels": _levels(root)}
    # Saves at 2, 4, 6, 8; the NaN after step 5 is in the states of 6 and 8.
    first = run_ranks(_titan_job, WORLD, root, options, 8, 10, [4], 5, timeout=180)
    assert first[0]["saved"] == [2, 4, 6, 8]
    assert first[0]["levels"] == [[2, 4, 6, 8], [2, 4]]  # the poisoned ones stay below
    assert _steps(tmp_path / "remote") == [2, 4]
    assert [_quarantined(tmp_path / "n0" / "l1" / f"step-{s}") for s in (4, 6, 8)] == [
        False,
        True,
        True,
    ]
    # The restart: torchtitan's load(step=-1), as its Trainer makes it.
    restart = run_ranks(_titan_job, WORLD, root, options, 4, 10, [], None, timeout=180)
    for rank in range(WORLD):
        assert restart[rank]["load_returned"] and restart[rank]["loaded"] == 4
        titan._assert_same(
            restart[rank]["snapshots"]["loaded"], first[rank]["snapshots"][4], f"rank {rank}"
        )


# ---------------------------------------------------------------- Lightning


def _lightning_fit(rank: int, world: int, root: str, levels: list, poison_epoch: int) -> dict:
    """4 epochs (3 steps each) saved to the levels at every epoch's end; at the start of
    ``poison_epoch`` the state (that of the step saved last) is taken, then poisoned."""
    import test_integration_lightning as lt
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_integration_accelerate import _local_bytes

    lt._as_node(rank)
    module = lt._module("fsdp2")
    taken: dict = {}

    def on_train_epoch_start() -> None:
        if module.current_epoch == poison_epoch:
            optimizer = module.trainer.optimizers[0]
            taken.update(_local_bytes(module, optimizer), step=module.trainer.global_step)
            _poison(optimizer)

    module.on_train_epoch_start = on_train_epoch_start
    callback = ModelCheckpoint(
        dirpath=os.path.join(root, "ckpt"),
        filename="{epoch}-{step}",
        save_last=True,
        save_on_train_epoch_end=True,
    )
    lt._trainer(lt._level_strategy(levels), os.path.join(root, "first"), 4, [callback]).fit(module)
    return taken


def _lightning_resume(rank: int, world: int, root: str, levels: list, ckpt_path: str) -> dict:
    """``fit(ckpt_path=...)``; the state as training starts again."""
    import test_integration_lightning as lt
    from test_integration_accelerate import _local_bytes

    from dcp_multilevel.integrations.lightning import level_target, past_quarantine

    lt._as_node(rank)
    # What each kind of path resolves to: a marker of a quarantined step, "step-<N>".
    targets = [
        past_quarantine(level_target(path), levels).location for path in (ckpt_path, "step-12")
    ]
    module = lt._module("fsdp2")
    taken: dict = {}

    def on_train_start() -> None:
        optimizer = module.trainer.optimizers[0]
        taken.update(_local_bytes(module, optimizer), step=module.trainer.global_step)

    module.on_train_start = on_train_start
    lt._trainer(lt._level_strategy(levels), os.path.join(root, "resumed"), 3).fit(
        module, ckpt_path=ckpt_path
    )
    return {"taken": taken, "targets": targets}


def test_lightning_resumes_from_the_newest_clean_step(tmp_path):
    require("test_integration_lightning")
    require("accelerate")  # its test's _local_bytes
    root = str(tmp_path)
    levels = _levels(root)
    # Saves at steps 3, 6, 9, 12; the NaN at the start of the 3rd epoch (after step 6).
    clean = run_ranks(_lightning_fit, WORLD, root, levels, 2, timeout=180)
    for node in (0, 1):
        assert _steps(tmp_path / f"n{node}" / "l1") == [3, 6, 9, 12]
    assert _steps(tmp_path / "remote") == [3, 6]
    assert [_quarantined(tmp_path / "n0" / "l1" / f"step-{s}") for s in (6, 9, 12)] == [
        False,
        True,
        True,
    ]
    # last.ckpt names step 12, the newest save: the resume passes over 12 and 9.
    ckpt_path = str(tmp_path / "ckpt" / "last.ckpt")
    resumed = run_ranks(_lightning_resume, WORLD, root, levels, ckpt_path, timeout=180)
    for rank in range(WORLD):
        assert resumed[rank]["targets"] == ["latest", "step-12"]
        got, expected = resumed[rank]["taken"], clean[rank]
        assert got["step"] == expected["step"] == 6, rank
        # The weights and AdamW states, bit for bit (param_groups: lr is stepped per epoch).
        keys = [k for k in expected if k.startswith(("model.", "optim.state."))]
        assert any(k.startswith("optim.state.") for k in keys), sorted(expected)
        differ = [k for k in keys if got[k] != expected[k]]
        assert not differ, f"rank {rank}: {differ}"


# ---------------------------------------------------------------- Accelerate


def _accelerate_saves(rank: int, world: int, root: str, levels: list) -> dict:
    """save_state into one folder: steps 0 and 1 clean; 2 with a NaN in the optimizer
    only (its model part is clean); 3 after a training step spread it to the weights."""
    from test_integration_accelerate import _fsdp2_on_cpu, _local_bytes, _prepared, _step

    warnings.filterwarnings("ignore")
    os.environ["DCP_ML_NODE"] = str(rank)
    accelerator = _fsdp2_on_cpu(rank, world, levels=levels)
    parts = _prepared(accelerator, seed=0)
    ckpt = os.path.join(root, "ckpt")
    for step in range(2):
        _step(accelerator, *parts, step, rank)
        accelerator.save_state(ckpt)
    clean = _local_bytes(*parts[:2])
    _poison(parts[1].optimizer)
    accelerator.save_state(ckpt)
    _step(accelerator, *parts, 2, rank)
    accelerator.save_state(ckpt)
    accelerator.wait_for_checkpoints()
    return clean


def _accelerate_resume(rank: int, world: int, root: str, levels: list) -> dict:
    """A restarted job load_state's the folder; then on purpose, allowing quarantine."""
    from test_integration_accelerate import _fsdp2_on_cpu, _local_bytes, _prepared

    warnings.filterwarnings("ignore")
    os.environ["DCP_ML_NODE"] = str(rank)
    accelerator = _fsdp2_on_cpu(rank, world, levels=levels)
    parts = _prepared(accelerator, seed=1)
    ckpt = os.path.join(root, "ckpt")
    accelerator.load_state(ckpt)
    loaded = _local_bytes(*parts[:2])
    iteration = accelerator.save_iteration
    accelerator.load_state(ckpt, allow_quarantined=True)
    moments = [s["exp_avg"].to_local() for s in parts[1].optimizer.state.values()]
    return {
        "loaded": loaded,
        "save_iteration": iteration,
        "nan_when_allowed": any(bool(m.isnan().any()) for m in moments),
    }


def test_accelerate_resumes_from_the_newest_step_clean_in_every_part(tmp_path):
    test_accelerate = require("test_integration_accelerate")
    root = str(tmp_path)
    # A first level every node reads, so that a quarantined step (on no other level) can
    # be loaded on purpose: with a node-local one, no node holds the other's files.
    levels = _levels(root, first="l1")
    clean = run_ranks(_accelerate_saves, WORLD, root, levels, timeout=180)
    model, optimizer = test_accelerate.PARTS
    first = tmp_path / "l1"
    for part in (model, optimizer):
        assert _steps(first / part) == [0, 1, 2, 3], part
    assert not _quarantined(first / model / "step-2") and _quarantined(first / model / "step-3")
    assert _quarantined(first / optimizer / "step-2")
    # Each part climbs on its own: step 2's model part was clean.
    assert _steps(tmp_path / "remote" / model) == [0, 1, 2]
    assert _steps(tmp_path / "remote" / optimizer) == [0, 1]
    # The folder's marker names step 3; every part is loaded at step 1, the newest step
    # no part of which is quarantined (not the model at 2 and the optimizer at 1).
    resumed = run_ranks(_accelerate_resume, WORLD, root, levels, timeout=180)
    for rank in range(WORLD):
        got = resumed[rank]
        assert got["loaded"].keys() == clean[rank].keys()
        differ = [k for k in clean[rank] if got["loaded"][k] != clean[rank][k]]
        assert not differ, f"rank {rank}: {differ}"
        assert got["save_iteration"] == 4, rank  # numbering goes on after the folder's step
        assert got["nan_when_allowed"], rank  # allow_quarantined: the folder's step, poisoned
