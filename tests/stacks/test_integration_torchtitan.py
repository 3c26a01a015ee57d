"""torchtitan's checkpointer machinery saving and loading through dcp_multilevel's plugin.

Each job is a torchtitan-style training loop on 2 real gloo ranks: a small model,
torchtitan's ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer``,
``ParallelAwareDataloader`` (a ``StatefulDataLoader``) and a train state, all
handed to :class:`MultiLevelCheckpointManager`, built from its ``Config`` the
way torchtitan's ``Trainer`` builds its checkpointer, and driven as
``Trainer.train`` drives it (``load(step=load_step)``, then
``maybe_wait_for_staging()`` before each optimizer step and ``save(step,
last_step=...)`` after it). Each rank is a simulated node (``DCP_ML_NODE``);
losing a node is deleting its folder.

torchtitan's ``Trainer`` itself does not run here: on a CPU-only torch it
selects CUDA (``torchtitan/tools/utils.py``), and its Llama 3 attention cannot
train on CPU (the adapter's module docstring names each obstacle).
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _required import require

require("torchtitan.components.checkpoint")
require("torchdata.stateful_dataloader")
require("spmd_types")  # torchtitan.components.optimizer imports it

import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

import dcp_multilevel
import dcp_multilevel.integrations.torchtitan as adapter
from dcp_multilevel import ConfigError, Level, Schedule
from dcp_multilevel.convert import convert
from dcp_multilevel.integrations.torchtitan import MultiLevelCheckpointManager
from dcp_multilevel.schedule import FixedInterval
from dcp_multilevel.testing import run_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2
VOCAB, DIM = 32, 16


# ---------------------------------------------------------------- the training job


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.mix = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.tok(tokens))))


class Tokens(IterableDataset):
    """Deterministic token rows, this rank's share (every ``world``-th row)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        for i in range(self.rank, 10_000, self.world):
            g = torch.Generator().manual_seed(i)
            row = torch.randint(0, VOCAB, (9,), generator=g)
            yield {"input": row[:-1]}, row[1:]


class TrainState(Stateful):
    """What torchtitan's Trainer keeps as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class TinyAdapter(BaseStateDictAdapter):
    """HF names are ``model.<torchtitan name>``."""

    def __init__(self, model_config: Any = None, hf_assets_path: str | None = None) -> None:
        self.fqn_to_index_mapping = None
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        return HuggingFaceStorageReader(path)


@dataclass(frozen=True)
class Tensor:
    """A tensor, as its rank sent it back: dtype, shape and bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> Tensor:
        return cls(str(t.dtype), tuple(t.shape), _bytes(t))


def _snapshot(model, optimizers, lr_schedulers, train_state) -> dict[str, Any]:
    """What a resume must restore, as plain values; the dataloader's position shows in
    the batches that follow (its ``state_dict()`` right after a load counts the batches
    it skips to get there twice: a quirk of torchdata's StatefulDataLoader)."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):  # sent back as bytes (a tensor would be an fd)
            return Tensor.of(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {
        "model": plain(model.state_dict()),
        "optimizer": plain(optimizers.state_dict()),
        "lr_scheduler": plain(lr_schedulers.state_dict()),
        "lr": [s.get_last_lr() for s in lr_schedulers],
        "train_state": train_state.state_dict(),
    }


def _job(
    rank: int,
    world: int,
    root: str,
    options: dict[str, Any],
    run_to: int,
    total: int,
    snapshot_at: list[int],
    seed: bool = False,
) -> dict[str, Any]:
    """One run of a torchtitan-style job: load, train to ``run_to`` (``total`` is the
    run's last step: ``run_to < total`` is a job killed after step ``run_to``)."""
    os.environ["DCP_ML_NODE"] = str(rank)
    torch.manual_seed(0)
    model = TinyLM()
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                )
            ],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=total
    )
    dataloader = ParallelAwareDataloader(Tokens(rank, world), rank, world, batch_size=4)
    train_state = TrainState()
    stock = options.pop("stock", False)  # torchtitan's own checkpointer (saves stock DCP)
    kind = CheckpointManager if stock else MultiLevelCheckpointManager
    config = kind.Config(enable=True, **options)
    checkpointer = config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=TinyAdapter(),
        base_folder=root,
    )
    out: dict[str, Any] = {"saved": [], "held": {}, "snapshots": {}, "batches": {}}
    try:
        if seed:  # what torchtitan's train.py does with create_seed_checkpoint
            out["saved"] = [0] if checkpointer.save(curr_step=0, last_step=True) else []
            return out
        out["load_returned"] = checkpointer.load(step=config.load_step)
        out["loaded"] = train_state.step
        report = None if stock else checkpointer.last_restore
        out["restore"] = dict(report.received) if report is not None else {}
        out["snapshots"]["loaded"] = _snapshot(model, optimizers, lr_schedulers, train_state)
        batches = iter(dataloader)
        while train_state.step < run_to:
            train_state.step += 1
            inputs, labels = next(batches)
            out["batches"][train_state.step] = Tensor.of(labels)
            logits = model(inputs["input"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            for p in model.parameters():  # data parallel: average the gradients
                dist.all_reduce(p.grad)
                p.grad /= world
            fence = checkpointer.staging_future  # async_with_pinned_mem: the copies' fence
            checkpointer.maybe_wait_for_staging()  # as Trainer.train_step, before the step
            if fence is not None:
                assert fence.done()  # the fence held before the optimizer step
                out["fenced"] = out.get("fenced", 0) + 1
            optimizers.step()
            lr_schedulers.step()
            optimizers.zero_grad()
            train_state.ntokens_seen += labels.numel() * world
            if train_state.step in snapshot_at:
                out["snapshots"][train_state.step] = _snapshot(
                    model, optimizers, lr_schedulers, train_state
                )
            if checkpointer.save(train_state.step, last_step=train_state.step == total):
                out["saved"].append(train_state.step)
                out["held"][train_state.step] = [] if stock else checkpointer.steps(0)
        checkpointer.maybe_wait_for_saving()  # the async save in flight commits
        dcp_multilevel.wait()  # ... and every due drain and retention follows it
        levels = [] if stock else checkpointer.levels
        out["levels"] = [checkpointer.steps(i) for i in range(len(levels))]
        out["purge_thread"] = checkpointer.purge_thread is not None
    finally:
        checkpointer.close()
    return out


def _run(
    root: Path,
    options: dict[str, Any],
    run_to: int,
    total: int,
    snapshot_at: list[int] = (),
    seed: bool = False,
) -> list[dict[str, Any]]:
    return run_ranks(_job, WORLD, str(root), options, run_to, total, list(snapshot_at), seed)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Bit-exact equality of nested snapshots (tensors by dtype, shape and bytes)."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {set(actual) ^ set(expected)}"
        for k in expected:
            _assert_same(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]")
    else:  # Tensor compares its bytes; the rest by value
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------- one level, as torchtitan


INTERVAL_RUN = {
    "interval": 2,
    "keep_latest_k": 2,
    "enable_first_step_checkpoint": True,
    "last_save_model_only": True,
    "last_save_in_hf": True,
    "async_mode": "async",
    "codec": "bytegroup",
}


@pytest.fixture(scope="module")
def interval_runs(tmp_path_factory):
    """A run to its last step (6), then a restart of the same job from scratch."""
    root = tmp_path_factory.mktemp("titan")
    first = _run(root, INTERVAL_RUN, run_to=6, total=6, snapshot_at=[2, 4, 6])
    restart = _run(root, INTERVAL_RUN, run_to=6, total=6, snapshot_at=[6])
    return root, first, restart


def test_saves_at_interval_first_step_and_last_step(interval_runs):
    root, first, _ = interval_runs
    for rank in range(WORLD):
        assert first[rank]["loaded"] == 0  # a fresh start
        assert first[rank]["saved"] == [1, 2, 4, 6]
    # Our checkpoints, not stock ones: the manifest, at torchtitan's layout.
    assert (root / "checkpoint" / "step-4" / "manifest.json").is_file()


def test_keep_latest_k_is_the_levels_retention(interval_runs):
    root, first, _ = interval_runs
    # keep_latest_k=2 is the level's keep, applied in the background as each save
    # commits (async_mode="async": the save returns once staged, and commits before the
    # next save starts). Right after a save the level holds committed steps only, at
    # most keep_latest_k of them plus the newest commit whose retention may not have
    # run yet; the model-only last step (6) is an export, not a step of the level.
    held = first[0]["held"]
    assert sorted(held) == [1, 2, 4, 6]
    for step, steps in held.items():
        assert set(steps) <= {s for s in (1, 2, 4) if s <= step} and len(steps) <= 3, held
    # Once the drains and retention followed the last save: the 2 newest.
    assert first[0]["levels"] == [[2, 4]] and first[1]["levels"] == [[2, 4]]
    assert sorted(
        p.name for p in (root / "checkpoint").iterdir() if p.name.startswith("step-")
    ) == ["step-2", "step-4"]
    assert not first[0]["purge_thread"]  # torchtitan's own purge is off


def test_restart_resumes_bit_exact(interval_runs):
    _, first, restart = interval_runs
    for rank in range(WORLD):
        assert restart[rank]["loaded"] == 4  # the newest full checkpoint
        # model, optimizer, lr scheduler, dataloader position, train state
        _assert_same(
            restart[rank]["snapshots"]["loaded"],
            first[rank]["snapshots"][4],
            f"rank {rank} after load",
        )
        # ... and training goes on as if never stopped: the dataloader goes on where it
        # was (the same batches), and the same updates follow.
        assert restart[rank]["batches"] == {s: first[rank]["batches"][s] for s in (5, 6)}
        _assert_same(
            restart[rank]["snapshots"][6], first[rank]["snapshots"][6], f"rank {rank} at step 6"
        )


def test_last_step_exports_hf_safetensors(interval_runs):
    root, first, _ = interval_runs
    export = root / "export" / "step-6"
    files = sorted(export.glob("*.safetensors"))
    assert files, sorted(p.name for p in export.rglob("*"))
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(f))
    expected = first[0]["snapshots"][6]["model"]
    assert set(loaded) == {f"model.{k}" for k in expected}
    for k, v in expected.items():
        assert Tensor.of(loaded[f"model.{k}"]) == v, k


def test_load_step_exclude_from_loading_and_load_only(interval_runs):
    root, first, _ = interval_runs
    options = {
        **INTERVAL_RUN,
        "load_step": 2,
        "exclude_from_loading": ["dataloader"],
        "load_only": True,
        "async_mode": "disabled",
    }
    out = _run(root, options, run_to=4, total=6)
    for rank in range(WORLD):
        assert out[rank]["loaded"] == 2
        assert out[rank]["saved"] == []  # load_only: nothing saved
        _assert_same(out[rank]["snapshots"]["loaded"], first[rank]["snapshots"][2])
        # The dataloader was not loaded: it starts from its first batch again.
        assert out[rank]["batches"][3] == first[rank]["batches"][1]
    assert sorted(
        p.name for p in (root / "checkpoint").iterdir() if p.name.startswith("step-")
    ) == ["step-2", "step-4"]


# ---------------------------------------------------------------- a lost node


def test_lost_node_resumes_from_the_partner_level(tmp_path):
    levels = [
        Level(f"{tmp_path}/n{{node}}/l1", keep=2),
        Level(f"partner:{tmp_path}/n{{node}}/partner", keep=2, replicas=2),
    ]
    options = {
        "interval": 2,
        "levels": levels,
        "async_mode": "async_with_pinned_mem",
        "drain_policy": "wait",
    }
    first = _run(tmp_path, options, run_to=4, total=8, snapshot_at=[4])  # killed after step 4
    assert first[0]["saved"] == [2, 4]
    assert first[0].get("fenced"), "async_with_pinned_mem saved without overlapped copies"
    shutil.rmtree(tmp_path / "n1")  # node 1 is lost with its disk
    restart = _run(tmp_path, options, run_to=4, total=8)
    for rank in range(WORLD):
        assert restart[rank]["loaded"] == 4
        _assert_same(
            restart[rank]["snapshots"]["loaded"], first[rank]["snapshots"][4], f"rank {rank}"
        )
    assert restart[1]["restore"], "node 1's files were not brought back"
    assert any("partner" in source for source in restart[1]["restore"]), restart[1]["restore"]


# ---------------------------------------------------------------- last step, seed, initial load


def test_full_last_step_reaches_every_level_and_seeds_another_run(tmp_path):
    levels = [Level(f"{tmp_path}/run1/l1", keep=2), Level(f"{tmp_path}/run1/remote", every=4)]
    options = {"interval": 2, "keep_latest_k": 3, "levels": levels, "last_save_model_only": False}
    first = _run(tmp_path / "run1", options, run_to=5, total=5, snapshot_at=[5])
    assert first[0]["saved"] == [2, 4, 5]
    # The first level keeps its own 2; the remote keeps keep_latest_k=3 and took the
    # last step (5) though its every=4 does not divide it.
    assert first[0]["levels"] == [[4, 5], [4, 5]]
    # A new run (its own folder) starts from that checkpoint's model only.
    second = _run(
        tmp_path / "run2", {"initial_load_path": f"{tmp_path}/run1/l1/step-5"}, run_to=0, total=5
    )
    for rank in range(WORLD):
        assert second[rank]["load_returned"] and second[rank]["loaded"] == 0
        got = second[rank]["snapshots"]["loaded"]
        _assert_same(got["model"], first[rank]["snapshots"][5]["model"])
        assert got["lr_scheduler"] == {"last_epoch": 0}  # model only: the rest starts afresh


def test_seed_checkpoint_then_training_starts_from_it(tmp_path):
    seeded = _run(tmp_path, {}, run_to=0, total=0, seed=True)
    assert seeded[0]["saved"] == [0]
    assert (tmp_path / "checkpoint" / "step-0" / "manifest.json").is_file()
    run = _run(tmp_path, {}, run_to=3, total=3, snapshot_at=[3])
    for rank in range(WORLD):
        # step 0 is model only (torchtitan's seed): loaded without the other states
        assert run[rank]["load_returned"] and run[rank]["loaded"] == 0
        assert run[rank]["saved"] == [3]
    # The model-only last step is an export of ours, which `convert` turns into safetensors.
    out = tmp_path / "model.safetensors"
    convert(str(tmp_path / "export" / "step-3"), str(out), to="safetensors")
    loaded = load_file(out)
    expected = run[0]["snapshots"][3]["model"]
    assert {k: Tensor.of(v) for k, v in loaded.items()} == expected


# ---------------------------------------------------------------- configuration


def test_a_schedule_deciding_every_step_is_refused():
    with pytest.raises(ConfigError) as info:
        MultiLevelCheckpointManager.Config(enable=True, schedule=Schedule.auto(mtbf_hours=24))
    schedule = info.value.args[0].split("checkpoint.schedule=", 1)[1].split(": torchtitan", 1)[0]
    assert str(info.value) == (
        f"checkpoint.schedule={schedule}: torchtitan decides when to save (interval), so the "
        "schedule only says which levels take each step and must decide from the step alone "
        "(FixedInterval(), or a SavePolicy with deterministic=True and due()); a schedule that "
        "decides at every training step (Schedule.auto) needs "
        "dcp_multilevel.CheckpointManager.step()"
    )
    MultiLevelCheckpointManager.Config(enable=True, schedule=FixedInterval())  # deterministic


def test_the_adapter_uses_one_private_torchtitan_name():
    # A private name is torchtitan's when the adapter reads it without defining it, or
    # defines it over torchtitan's (an override); the module docstring names each one.
    tree = ast.parse(inspect.getsource(adapter))
    used = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    }
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    defined |= {
        t.attr
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute)
    }
    overridden = {
        n
        for n in defined
        if n.startswith("_") and not n.startswith("__") and hasattr(CheckpointManager, n)
    }
    private = (used - defined) | overridden
    assert private == {"_states_to_load"}, private
    assert all(hasattr(CheckpointManager, name) for name in private)
    assert "one, ``CheckpointManager._states_to_load``" in adapter.__doc__


def test_a_stock_checkpoint_saved_before_the_switch_resumes(tmp_path):
    # torchtitan's own checkpointer saved stock DCP at folder/step-N; the same job,
    # switched to ours, finds no step on its levels and resumes through torchtitan's
    # own load, then saves its steps as ours.
    options = {"interval": 2, "last_save_model_only": False}
    stock = _run(tmp_path, {**options, "stock": True}, run_to=2, total=4, snapshot_at=[2])
    assert stock[0]["saved"] == [2]
    assert (tmp_path / "checkpoint" / "step-2" / ".metadata").is_file()
    ours = _run(tmp_path, options, run_to=4, total=4)
    for rank in range(WORLD):
        assert ours[rank]["loaded"] == 2 and ours[rank]["saved"] == [4]
        _assert_same(ours[rank]["snapshots"]["loaded"], stock[rank]["snapshots"][2])
    assert ours[0]["levels"] == [[4]]  # step 2 is stock: not a step of the level
    assert (tmp_path / "checkpoint" / "step-4" / "manifest.json").is_file()
