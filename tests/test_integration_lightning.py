"""Lightning's Trainer saves and resumes through dcp_multilevel (lightning==2.6.6).

Two real gloo ranks (``run_ranks``) run a ``Trainer`` on CPU with our strategy
subclasses: fit two epochs, checkpoint, then a new Trainer resumes with
``fit(ckpt_path=...)``; its losses must equal, bit for bit, those of one
uninterrupted run. Lightning finds the ranks through ``LOCAL_RANK`` (its
``LightningEnvironment``) and reuses the process group ``run_ranks`` opened.
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("lightning", minversion="2.6")

import torch

from dcp_multilevel import MultiLevelReader
from dcp_multilevel.testing import run_ranks

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
