"""PyTorch Lightning strategies whose sharded checkpoints are dcp_multilevel checkpoints.

Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) and
``FSDPStrategy`` (FSDP1) save a sharded checkpoint with a plain
``dcp.save(state, checkpoint_id=path)`` (``_distributed_checkpoint_save``,
not through ``CheckpointIO``) plus a ``meta.pt`` that rank 0 writes with
``torch.save`` (loops, callbacks, hyper-parameters: everything but weights and
optimizer states). They load it back when the folder holds ``meta.pt``. The two
subclasses here change only where the sharded bytes go::

    strategy = MultiLevelModelParallelStrategy(writer_options={"codec": "bytegroup"})
    trainer = L.Trainer(strategy=strategy, ...)
    trainer.fit(model, ckpt_path="ckpt/last.ckpt")  # resumes from ours

``save_checkpoint`` writes the weights and optimizer states with
:class:`~dcp_multilevel.MultiLevelWriter` (then ``meta.pt``, as Lightning
does), and ``load_checkpoint`` reads a folder that holds our manifest with
:class:`~dcp_multilevel.MultiLevelReader`. Anything else (a single-file
checkpoint, a stock DCP folder from before the switch) goes to Lightning's
own code, so existing checkpoints keep loading.

Tested with ``lightning==2.6.6`` (``tests/test_integration_lightning.py``).
Besides its public classes this module uses two Lightning internals, pinned
by that version: ``lightning.fabric.utilities.load._METADATA_FILENAME``
(``"meta.pt"``) and, for FSDP1,
``lightning.fabric.strategies.fsdp._get_sharded_state_dict_context``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ..plugin import MultiLevelReader, MultiLevelWriter

__all__ = [
    "MultiLevelFSDPStrategy",
    "MultiLevelModelParallelStrategy",
    "MultiLevelStorage",
]


class MultiLevelStorage:
    """Where a strategy's sharded checkpoints go: our writer, reader and planner.

    Args:
        writer_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelWriter`
            for every save (``codec``, ``thread_count``, ``storage_options``...).
            ``overwrite`` defaults to True here: Lightning saves over a path it
            saved before (``last.ckpt``), as stock DCP does; the old checkpoint
            stays loadable until the new manifest commits.
        reader_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelReader`
            for every load (``fallbacks``, ``thread_count``...).
        planner: the ``SavePlanner`` of every save (e.g.
            :class:`~dcp_multilevel.BalancedSavePlanner`); one instance is reused
            across saves, so its plan cache works. ``None``: DCP's default.
    """

    def __init__(
        self,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        planner: SavePlanner | None = None,
    ) -> None:
        self.writer_options = {"overwrite": True, **(writer_options or {})}
        self.reader_options = dict(reader_options or {})
        self.planner = planner

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds a committed dcp_multilevel checkpoint."""
        return MultiLevelReader.validate_checkpoint_id(path)

    def save(self, state: dict[str, Any], path: Path) -> None:
        """``dcp.save`` of ``state`` to ``path`` through our writer (every rank)."""
        writer = MultiLevelWriter(path, **self.writer_options)
        dcp.save(state, storage_writer=writer, planner=self.planner)

    def load(self, state: dict[str, Any], path: Path) -> None:
        """``dcp.load`` into ``state`` (in place) from ``path`` through our reader."""
        dcp.load(state, storage_reader=self.reader(path))

    def reader(self, path: Path) -> MultiLevelReader:
        """A reader of ``path`` with this storage's options."""
        return MultiLevelReader(path, **self.reader_options)


def _prepare_folder(path: Path) -> None:
    # As Lightning: a single-file checkpoint at the path gives way to a folder.
    # Every rank runs this; on a shared file system another rank may have
    # removed the file first, hence missing_ok.
    if path.is_file():
        path.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)


def _sharded_state(checkpoint: dict[str, Any], model_key: str) -> dict[str, Any]:
    """Take weights and optimizer states out of Lightning's checkpoint dict (in place,
    as Lightning does): what is left is ``meta.pt``."""
    state = {model_key: checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    return state


def _refuse_storage_options(strategy: object, storage_options: Any) -> None:
    if storage_options is not None:
        name = type(strategy).__name__
        raise TypeError(
            f"`{name}.save_checkpoint(..., storage_options=...)` is not supported: {name} "
            "writes through dcp_multilevel, not through the `CheckpointIO`; pass "
            "writer_options={'storage_options': ...} to the strategy instead."
        )


class _OurStorage:
    """What both strategies share: the constructor (the strategy's own arguments, plus
    ours), the save through our writer and the load through our reader (each
    strategy's ``_load_ours`` puts the state into its model and optimizers)."""

    def __init__(
        self,
        *args: Any,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        planner: SavePlanner | None = None,
        storage: MultiLevelStorage | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.storage = storage or MultiLevelStorage(writer_options, reader_options, planner)

    def _save_ours(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], model_key: str
    ) -> None:
        """Weights and optimizer states with our writer, then ``meta.pt`` (rank 0)."""
        # Rank 0's path, as Lightning: every rank must write the same checkpoint.
        path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
        _prepare_folder(path)
        self.storage.save(_sharded_state(checkpoint, model_key), path)
        if self.global_rank == 0:  # type: ignore[attr-defined]
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load our checkpoint into the model and optimizers (``_load_ours``); return
        ``meta.pt``. A path that holds no dcp_multilevel checkpoint goes to Lightning's
        loader."""
        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        if not self.storage.holds(path):
            return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        assert self.model is not None and self.lightning_module is not None  # type: ignore[attr-defined]
        self._load_ours(path)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _load_ours(self, path: Path) -> None:
        raise NotImplementedError


class MultiLevelModelParallelStrategy(_OurStorage, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) saving through us.

    Takes every argument of ``ModelParallelStrategy`` plus the three of
    :class:`MultiLevelStorage` (or a ``storage``). With
    ``save_distributed_checkpoint=True`` (the default) a checkpoint path is a
    folder holding our checkpoint and Lightning's ``meta.pt``; with False,
    Lightning's single-file save is used unchanged.

    Runs wherever ``ModelParallelStrategy`` does, CPU with gloo included.
    """

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save weights and optimizer states with our writer, the rest as ``meta.pt``."""
        _refuse_storage_options(self, storage_options)
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath)
        return self._save_ours(checkpoint, filepath, "state_dict")

    def _load_ours(self, path: Path) -> None:
        """Our checkpoint into the model and optimizers: the same steps as Lightning's
        own sharded load (fabric's _load_checkpoint)."""
        module_state = {"state_dict": get_model_state_dict(self.model)}
        self.storage.load(module_state, path)
        self.model.load_state_dict(
            module_state["state_dict"], strict=self.lightning_module.strict_loading
        )
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            self.storage.load(optim_state, path)
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )


class MultiLevelFSDPStrategy(_OurStorage, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) saving its sharded checkpoints through us.

    Takes every argument of ``FSDPStrategy`` plus the three of
    :class:`MultiLevelStorage` (or a ``storage``). ``state_dict_type`` defaults
    to ``"sharded"`` here (Lightning's default is ``"full"``, a single file):
    only sharded checkpoints go through us; ``"full"`` is Lightning's
    single-file save, unchanged.

    Needs a GPU, as ``FSDPStrategy`` does: FSDP1 refuses CPU-only execution
    in torch 2.13 ("FSDP needs a non-CPU accelerator device"). Its test runs
    only where CUDA is available.
    """

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save weights and optimizer states with our writer, the rest as ``meta.pt``."""
        _refuse_storage_options(self, storage_options)
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath)
        return self._save_ours(checkpoint, filepath, "model")

    def _load_ours(self, path: Path) -> None:
        """Our checkpoint into the model and optimizers: the same steps as
        FSDPStrategy.load_checkpoint's sharded branch."""
        with _get_sharded_state_dict_context(self.model):
            module_state = {"model": self.model.state_dict()}
            self.storage.load(module_state, path)
            self.model.load_state_dict(
                module_state["model"], strict=self.lightning_module.strict_loading
            )
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                for idx, optimizer in enumerate(self.optimizers):
                    key = f"optimizer_{idx}"
                    optim_state = load_sharded_optimizer_state_dict(
                        model_state_dict=module_state["model"],
                        optimizer_key=key,
                        storage_reader=self.storage.reader(path),
                    )
                    flattened = FSDP.optim_state_dict_to_load(
                        optim_state_dict=optim_state[key], model=self.model, optim=optimizer
                    )
                    optimizer.load_state_dict(flattened)
