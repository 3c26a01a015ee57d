"""Accelerate's save_state / load_state with FSDP go through dcp_multilevel (accelerate==1.15.0).

Accelerate enters its FSDP mode only on an accelerator device (``AcceleratorState``
sets ``DistributedType.FSDP`` for multi-GPU-like types, never for ``MULTI_CPU``),
while FSDP2 itself (``fully_shard``) runs on CPU with gloo. So the ranks here
build a CPU ``Accelerator`` and then set its distributed type to FSDP, in both
of Accelerate's shared states (``PartialState`` is copied into every new
``AcceleratorState``). From there everything is Accelerate's own code:
``prepare`` shards the model with its ``fsdp2_prepare_model``, and
``save_state`` / ``load_state`` call its ``save_fsdp_model``,
``save_fsdp_optimizer``, ``load_fsdp_model``, ``load_fsdp_optimizer``.
Not exercised here: FSDP1 (it refuses CPU in torch 2.13), NCCL, GPU tensors.
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest

pytest.importorskip("accelerate", minversion="1.15")

import torch
import torch.distributed.checkpoint as dcp
from conftest import as_bytes

from dcp_multilevel import MultiLevelReader, MultiLevelWriter
from dcp_multilevel.integrations.accelerate import multilevel_fsdp_checkpoints
from dcp_multilevel.testing import run_ranks

WORLD = 2


def _fsdp2_on_cpu(rank: int, world: int, stock: bool = False, **options):
    """A CPU ``MultiLevelAccelerator`` (``stock``: Accelerate's own ``Accelerator``) in
    Accelerate's FSDP2 mode (see the module docstring)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from dcp_multilevel.integrations.accelerate import MultiLevelAccelerator

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    cls = Accelerator if stock else MultiLevelAccelerator
    accelerator = cls(cpu=True, fsdp_plugin=plugin, **options)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _prepared(accelerator, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return accelerator.prepare(model, optimizer, scheduler)


def _step(accelerator, model, optimizer, scheduler, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def _local_bytes(model, optimizer) -> dict[str, bytes]:
    """Every tensor this rank holds (its shards), as bytes, by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    out = {}
    for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
        flat = {}
        _flatten(sd, prefix, flat)
        out.update(flat)
    return out


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}", out)
    elif isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        out[prefix] = as_bytes(local)
    else:
        out[prefix] = repr(value).encode()


def _save_train_load(rank: int, world: int, root: str, stock_save: bool = False) -> dict:
    """Train 2 steps, save_state, take a 3rd step; a fresh model load_state's, takes it again.

    ``stock_save``: stock Accelerate saves; ours loads (a run switching over).
    """
    warnings.filterwarnings("ignore")
    if stock_save:
        accelerator = _fsdp2_on_cpu(rank, world, stock=True)
    else:
        accelerator = _fsdp2_on_cpu(rank, world, writer_options={"codec": "bytegroup"})
    parts = _prepared(accelerator, seed=0)
    for step in range(2):
        _step(accelerator, *parts, step, rank)
    saved = _local_bytes(*parts[:2])
    ckpt = os.path.join(root, "ckpt")
    accelerator.save_state(ckpt)
    expected_loss = _step(accelerator, *parts, 2, rank)
    expected_lr = parts[2].get_last_lr()

    # As a restarted job: a new Accelerator (its own list of prepared objects),
    # other weights, no optimizer state yet.
    accelerator = _fsdp2_on_cpu(rank, world)
    fresh = _prepared(accelerator, seed=1)
    accelerator.load_state(ckpt)
    loaded = _local_bytes(*fresh[:2])
    loss = _step(accelerator, *fresh, 2, rank)
    return {
        "saved": saved,
        "loaded": loaded,
        "expected_loss": expected_loss,
        "loss": loss,
        "lr": fresh[2].get_last_lr(),
        "expected_lr": expected_lr,
        "files": sorted(os.listdir(ckpt)),
        "distributed_type": str(accelerator.distributed_type),
    }


def test_save_state_load_state_round_trip_is_bit_exact(tmp_path):
    results = run_ranks(_save_train_load, WORLD, str(tmp_path), timeout=120)
    ckpt = tmp_path / "ckpt"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert MultiLevelReader.validate_checkpoint_id(ckpt / folder), folder
        assert not list((ckpt / folder).glob("*.distcp")), folder  # no stock data files
    for rank, r in enumerate(results):
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(r["files"])
        assert r["loaded"].keys() == r["saved"].keys()
        differ = [k for k in r["saved"] if r["loaded"][k] != r["saved"][k]]
        assert not differ, f"rank {rank}: {differ}"
        assert any(k.startswith("optim.state.") for k in r["saved"]), sorted(r["saved"])
        assert r["loss"] == r["expected_loss"], rank  # the next step too, bit for bit
        # The scheduler came back too (Accelerate's own file; its prepared
        # scheduler steps once per process per step).
        assert r["lr"] == r["expected_lr"] == [1e-2 * 0.5 ** (3 * WORLD)], rank


def test_a_checkpoint_saved_by_stock_accelerate_loads_through_ours_bit_exact(tmp_path):
    results = run_ranks(_save_train_load, WORLD, str(tmp_path), True, timeout=120)
    ckpt = tmp_path / "ckpt"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert (ckpt / folder / ".metadata").is_file(), folder  # stock DCP's own files
        assert list((ckpt / folder).glob("*.distcp")), folder
        assert not MultiLevelReader.validate_checkpoint_id(ckpt / folder), folder
    for rank, r in enumerate(results):
        assert r["loaded"].keys() == r["saved"].keys()
        differ = [k for k in r["saved"] if r["loaded"][k] != r["saved"][k]]
        assert not differ, f"rank {rank}: {differ}"
        assert any(k.startswith("optim.state.") for k in r["saved"]), sorted(r["saved"])
        assert r["loss"] == r["expected_loss"], rank


def test_a_folder_with_neither_checkpoint_gets_our_readers_error(tmp_path):
    # Not stock's: nothing there says it was ever a stock checkpoint.
    (tmp_path / "half").mkdir()
    with multilevel_fsdp_checkpoints():
        reader = dcp.FileSystemReader(tmp_path / "half")
    assert isinstance(reader, MultiLevelReader)


def test_routing_is_scoped_to_the_block_and_the_thread(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    built = {}

    def other_thread() -> None:
        built["other"] = dcp.FileSystemWriter(tmp_path / "other")

    with multilevel_fsdp_checkpoints(writer_options={"codec": "zstd"}):
        writer = dcp.FileSystemWriter(tmp_path / "a")
        reader_cls = dcp.FileSystemReader
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        with pytest.raises(TypeError) as info:
            dcp.FileSystemWriter(tmp_path / "b", single_file_per_rank=False)
    assert isinstance(writer, MultiLevelWriter)
    assert writer.overwrite and writer.compression.codec == "zstd"
    assert reader_cls is not FileSystemReader
    assert type(built["other"]) is FileSystemWriter
    assert dcp.FileSystemWriter is FileSystemWriter and dcp.FileSystemReader is FileSystemReader
    assert str(info.value) == (
        f"FileSystemWriter({str(tmp_path / 'b')!r}, ...) was called with options () "
        "{'single_file_per_rank': False} inside multilevel_fsdp_checkpoints(), which builds "
        "a MultiLevelWriter instead; pass that one's options as writer_options / reader_options"
    )
