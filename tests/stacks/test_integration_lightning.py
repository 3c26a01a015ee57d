"""Lightning's Trainer saves and resumes through dcp_multilevel (lightning==2.6.6).

Two real gloo ranks (``run_ranks``) run a ``Trainer`` on CPU with our strategy
subclasses: fit two epochs, checkpoint, then a new Trainer resumes with
``fit(ckpt_path=...)``; its losses must equal, bit for bit, those of one
uninterrupted run. Lightning finds the ranks through ``LOCAL_RANK`` (its
``LightningEnvironment``) and reuses the process group ``run_ranks`` opened.

With ``levels=``, each rank is a simulated node (a directory, ``DCP_ML_NODE``,
``{node}`` in the level paths); the resume runs in new processes after one
node's directory (or both) was deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
from _required import require

require("lightning", minversion="2.6")

import torch

from dcp_multilevel import Level, MultiLevelReader
from dcp_multilevel.errors import ManifestError
from dcp_multilevel.testing import run_ranks

pytest_plugins = ["_s3"]

WORLD = 2
BATCHES_PER_EPOCH = 3  # per rank


def _trainer(strategy, root: str, max_epochs: int, callbacks=(), *, gpu: bool = False):
    import lightning as L

    return L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1 if gpu else WORLD,
        strategy=strategy,
        max_epochs=max_epochs,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        num_sanity_val_steps=0,
        deterministic=True,
    )


def _module(kind: str):
    """A small MLP under FSDP2 (``fully_shard``) or FSDP1, recording its losses."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
            )
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if kind == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return [opt], [sched]

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            n = WORLD * BATCHES_PER_EPOCH * 4
            data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
            return DataLoader(data, batch_size=4, shuffle=False)

    return Net()


def _strategy(kind: str, *, stock: bool = False):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dcp_multilevel.integrations.lightning import (
        MultiLevelFSDPStrategy,
        MultiLevelModelParallelStrategy,
    )

    if stock:  # Lightning's own: a stock DCP folder
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    if kind == "fsdp2":
        return MultiLevelModelParallelStrategy(
            data_parallel_size=WORLD,
            tensor_parallel_size=1,
            writer_options={"codec": "bytegroup"},
        )
    return MultiLevelFSDPStrategy()


def _fit_stop_resume(rank: int, world: int, kind: str, root: str, stock_first: bool) -> dict:
    """Uninterrupted 3 epochs, then 2 epochs + checkpoint + a resumed 3rd.

    ``stock_first``: the first 2 epochs run under Lightning's own strategy (a
    stock DCP checkpoint, as before a switch to ours), the resumed one under ours.
    """
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    warnings.filterwarnings("ignore")
    gpu = kind == "fsdp1"
    if gpu:
        # FSDP1 needs an accelerator: one rank on the GPU, in the NCCL group
        # Lightning opens itself (run_ranks' gloo group is given up first).
        dist.destroy_process_group()
        # Bit-exact losses across runs need deterministic kernels on a GPU. (The first
        # lent run failed a check; likely cause: the strategy then defaulted to
        # Lightning's "full" single-file save, not ours; it defaults to "sharded" now.)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    else:
        os.environ["LOCAL_RANK"] = str(rank)  # Lightning: processes launched externally
        os.environ["NODE_RANK"] = "0"

    whole = _module(kind)
    _trainer(_strategy(kind), os.path.join(root, "whole"), 3, gpu=gpu).fit(whole)

    first = _module(kind)
    ckpt_dir = os.path.join(root, "ckpt")
    callback = ModelCheckpoint(dirpath=ckpt_dir, filename="last", save_on_train_epoch_end=True)
    first_strategy = _strategy(kind, stock=stock_first)
    _trainer(first_strategy, os.path.join(root, "first"), 2, [callback], gpu=gpu).fit(first)
    path = os.path.join(ckpt_dir, "last.ckpt")

    resumed = _module(kind)
    trainer = _trainer(_strategy(kind), os.path.join(root, "resumed"), 3, gpu=gpu)
    trainer.fit(resumed, ckpt_path=path)
    return {
        "whole": whole.losses,
        "first": first.losses,
        "resumed": resumed.losses,
        "global_step": trainer.global_step,
        "files": sorted(os.listdir(path)),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "fsdp2",  # MultiLevelModelParallelStrategy: 2 CPU ranks, gloo
        pytest.param(
            "fsdp1",  # MultiLevelFSDPStrategy: FSDP1 refuses CPU, so 1 rank on a GPU
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="FSDP1 needs an accelerator (torch 2.13)"
            ),
        ),
    ],
)
def test_trainer_fit_stop_resume_is_bit_exact(tmp_path, kind):
    world = WORLD if kind == "fsdp2" else 1
    results = run_ranks(_fit_stop_resume, world, kind, str(tmp_path), False, timeout=120)
    _check_resumed(results, world)
    assert MultiLevelReader.validate_checkpoint_id(tmp_path / "ckpt" / "last.ckpt")
    assert {"manifest.json", "meta.pt"} <= set(results[0]["files"]), results[0]["files"]


def test_resume_from_a_stock_checkpoint(tmp_path):
    """Switching to our strategy mid-run: a stock DCP folder still resumes (Lightning's loader)."""
    results = run_ranks(_fit_stop_resume, WORLD, "fsdp2", str(tmp_path), True, timeout=120)
    _check_resumed(results, WORLD)
    assert not MultiLevelReader.validate_checkpoint_id(tmp_path / "ckpt" / "last.ckpt")
    assert {".metadata", "meta.pt"} <= set(results[0]["files"]), results[0]["files"]


def _check_resumed(results: list[dict], world: int) -> None:
    per_epoch = BATCHES_PER_EPOCH * WORLD // world  # batches each rank takes per epoch
    for rank, r in enumerate(results):
        assert len(r["whole"]) == 3 * per_epoch, rank
        assert r["first"] == r["whole"][: 2 * per_epoch], rank
        # The resumed run starts at epoch 3 (model, AdamW moments, StepLR and
        # loop state restored) and its losses are the uninterrupted run's, bit
        # for bit: Python floats compare exactly.
        assert r["resumed"] == r["whole"][2 * per_epoch :], rank
        assert r["global_step"] == 3 * per_epoch, rank


def _levels(root: str, remote: str, remote_options: dict) -> list:
    return [
        Level(f"{root}/n{{node}}/l1", keep=2),
        Level(f"partner:{root}/n{{node}}/partner", keep=2),
        Level(remote, every=2, keep=2, codec="bytegroup", storage_options=remote_options),
    ]


def _level_strategy(levels: list, storage=None):
    from dcp_multilevel.integrations.lightning import MultiLevelModelParallelStrategy

    if storage is not None:  # the levels are the storage's
        return MultiLevelModelParallelStrategy(
            data_parallel_size=WORLD, tensor_parallel_size=1, storage=storage
        )
    return MultiLevelModelParallelStrategy(
        data_parallel_size=WORLD, tensor_parallel_size=1, levels=levels
    )


def _reader_keeping_storage(levels: list):
    """The strategy's storage, keeping the reader of every load it makes."""
    from dcp_multilevel.integrations.lightning import MultiLevelStorage

    class ReaderKeepingStorage(MultiLevelStorage):
        def __init__(self) -> None:
            super().__init__(levels=levels)
            self.readers: list[MultiLevelReader] = []

        def reader(self, where):
            reader = super().reader(where)
            self.readers.append(reader)
            return reader

    return ReaderKeepingStorage()


def _as_node(rank: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning: processes launched externally
    os.environ["NODE_RANK"] = "0"
    os.environ["DCP_ML_NODE"] = str(rank)  # one simulated node per rank


def _fit_to_levels(rank: int, world: int, root: str, levels: list) -> dict:
    """Uninterrupted 3 epochs; then 2 epochs saved to the levels by ModelCheckpoint:
    a top-k checkpoint and ``last.ckpt`` at every epoch's step (the same step twice),
    the previous top-k one removed."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _as_node(rank)
    whole = _module("fsdp2")
    _trainer(_strategy("fsdp2"), os.path.join(root, "whole"), 3).fit(whole)
    first = _module("fsdp2")
    callback = ModelCheckpoint(
        dirpath=os.path.join(root, "ckpt"),
        filename="{epoch}-{step}",
        save_last=True,
        save_on_train_epoch_end=True,
    )
    _trainer(_level_strategy(levels), os.path.join(root, "first"), 2, [callback]).fit(first)
    return {"whole": whole.losses, "first": first.losses}


def _resume_from_levels(rank: int, world: int, root: str, levels: list, ckpt_path: str) -> dict:
    _as_node(rank)
    resumed = _module("fsdp2")
    storage = _reader_keeping_storage(levels)
    trainer = _trainer(_level_strategy(levels, storage), os.path.join(root, "resumed"), 3)
    trainer.fit(resumed, ckpt_path=ckpt_path)
    return {
        "resumed": resumed.losses,
        "global_step": trainer.global_step,
        # Each load's items on this rank, by the copy that served them.
        "sources": [dict(reader.last_load_sources) for reader in storage.readers],
    }


def _markers(ckpt_dir) -> dict:
    """Each checkpoint Lightning kept: the files in it, and the step its marker names."""
    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        files = sorted(os.listdir(ckpt_dir / name))
        out[name] = (files, json.loads((ckpt_dir / name / files[0]).read_text())["step"])
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("remote_kind", "lost", "ckpt_path"),
    [
        # node 1's disk is gone: its files come back from node 0's partner copies
        pytest.param("folder", ["n1"], "ckpt/last.ckpt", id="partner-last.ckpt"),
        # both nodes' disks are gone: the step comes back from S3 alone
        pytest.param("s3", ["n0", "n1"], "latest", id="s3-latest"),
    ],
)
def test_levels_resume_after_a_lost_node_is_bit_exact(
    tmp_path, request, remote_kind, lost, ckpt_path
):
    root = str(tmp_path)
    if remote_kind == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = server.new_bucket()
        remote, remote_options = f"s3://{bucket}/run", server.storage_options
    else:
        remote, remote_options = f"{root}/remote", {}
    levels = _levels(root, remote, remote_options)
    first = run_ranks(_fit_to_levels, WORLD, root, levels, timeout=120)
    # Lightning's paths hold markers only; the step was saved once (top-k, then last).
    step_dir = "step-6"
    assert _markers(tmp_path / "ckpt") == {
        "epoch=1-step=6.ckpt": (["dcp_multilevel_step.json"], 6),
        "last.ckpt": (["dcp_multilevel_step.json"], 6),
    }
    for node in (0, 1):
        assert sorted(os.listdir(tmp_path / f"n{node}" / "l1")) == ["step-3", step_dir]
        assert sorted(os.listdir(tmp_path / f"n{node}" / "partner")) == ["step-3", step_dir]
    # teardown waited for the drains: step 6 (the 2nd save, every=2) is on the remote
    if remote_kind == "s3":
        assert f"run/{step_dir}/manifest.json" in server.keys(bucket)
    else:
        assert os.listdir(tmp_path / "remote") == [step_dir]

    for node in lost:
        shutil.rmtree(tmp_path / node)
    path = str(tmp_path / ckpt_path) if ckpt_path.endswith(".ckpt") else ckpt_path
    resumed = run_ranks(_resume_from_levels, WORLD, root, levels, path, timeout=120)
    results = [{**a, **b} for a, b in zip(first, resumed, strict=True)]
    _check_resumed(results, WORLD)
    if remote_kind == "folder":  # node 1's rank's files came back onto its first level
        files = os.listdir(tmp_path / "n1" / "l1" / step_dir / "data")
        assert any(f.startswith("1-") for f in files), files
    # Each load (the model's 5 items on each rank, then the optimizer's 25) read every
    # item from one copy: with node 1 lost, each node's first level (node 1's files
    # brought back from node 0's partner copies); with both nodes lost, S3.
    if remote_kind == "folder":
        copies = [f"file://{root}/n{node}/l1/{step_dir}" for node in range(WORLD)]
    else:
        copies = [f"{remote}/{step_dir}"] * WORLD
    assert [r["sources"] for r in resumed] == [[{copy: 5}, {copy: 25}] for copy in copies]


def test_level_targets_of_lightning_paths(tmp_path):
    from dcp_multilevel.integrations.lightning import (
        LevelStep,
        level_target,
        write_marker,
    )

    stock = tmp_path / "stock.ckpt"  # a sharded checkpoint of Lightning's: not a level step
    stock.mkdir()
    (stock / "meta.pt").write_bytes(b"")
    assert level_target(stock) is None
    assert level_target(tmp_path / "missing.ckpt") is None
    assert level_target("latest") == LevelStep("latest")
    assert level_target("step-7") == LevelStep("step-7") and LevelStep("step-7").step == 7
    write_marker(stock, 9)  # saving over it: the sharded checkpoint gives way
    assert os.listdir(stock) == ["dcp_multilevel_step.json"]
    assert level_target(stock) == LevelStep("step-9")
    link = tmp_path / "last.ckpt"  # save_last="link": the link is replaced, not followed
    link.symlink_to(stock)
    write_marker(link, 12)
    assert level_target(stock) == LevelStep("step-9")
    assert level_target(link) == LevelStep("step-12") and not link.is_symlink()
    (stock / "dcp_multilevel_step.json").write_text('{"step": 3}')
    with pytest.raises(ManifestError) as info:
        level_target(stock)
    assert str(info.value) == (
        f"rank 0: {stock}/dcp_multilevel_step.json is not a dcp_multilevel Lightning step "
        'marker (expected {"format": "dcp_multilevel.lightning-step", "step": <int>}): '
        "restore it, or pass ckpt_path='step-<N>' or 'latest' to load from the levels"
    )
