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

With ``levels=``, each rank is a simulated node of its own (a directory,
``DCP_ML_NODE``, ``{node}`` in the level paths; losing a node is deleting its
directory), and ``save_state``'s folder is shared, outside the nodes, as
Accelerate needs.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings

import pytest
from _required import require

require("accelerate", minversion="1.15")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import as_bytes

import dcp_multilevel
from dcp_multilevel import ConfigError, Level, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.integrations.accelerate import (
    MARKER_NAME,
    MultiLevelAccelerator,
    StepMarker,
    multilevel_fsdp_checkpoints,
)
from dcp_multilevel.levels.config import describe
from dcp_multilevel.testing import run_ranks

pytest_plugins = ["_s3"]

WORLD = 2
PARTS = ("pytorch_model_fsdp_0", "optimizer_0")


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


def _save_train_load(
    rank: int, world: int, root: str, stock_save: bool = False, load_levels: list | None = None
) -> dict:
    """Train 2 steps, save_state, take a 3rd step; a fresh model load_state's, takes it again.

    ``stock_save``: stock Accelerate saves; ours loads (a run switching over).
    ``load_levels``: the loading accelerator has these levels.
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
    if load_levels is not None:
        os.environ["DCP_ML_NODE"] = str(rank)
        accelerator = _fsdp2_on_cpu(rank, world, levels=load_levels)
    else:
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
        "save_iteration": accelerator.save_iteration,
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


# --- levels: partner copies, a remote, a resume after a lost node -------------------

STEPS = 5  # the uninterrupted run's; both runs save after the first 2


def _node_levels(root: str, remote: str, remote_options: dict) -> list:
    return [
        Level(f"{root}/n{{node}}/l1", keep=2),
        Level(f"partner:{root}/n{{node}}/partner", keep=2),
        Level(remote, keep=2, codec="bytegroup", storage_options=remote_options),
    ]


def _train_on_levels(rank: int, world: int, root: str, levels: list) -> dict:
    """The uninterrupted run: 2 steps, save_state onto the levels (step 0), the rest."""
    warnings.filterwarnings("ignore")
    os.environ["DCP_ML_NODE"] = str(rank)  # one rank per simulated node
    accelerator = _fsdp2_on_cpu(rank, world, levels=levels)
    parts = _prepared(accelerator, seed=0)
    losses = [_step(accelerator, *parts, step, rank) for step in range(2)]
    accelerator.save_state(os.path.join(root, "ckpt"))
    drains = accelerator.wait_for_checkpoints()
    losses += [_step(accelerator, *parts, step, rank) for step in range(2, STEPS)]
    return {
        "losses": losses,
        "lr": parts[2].get_last_lr(),
        "save_iteration": accelerator.save_iteration,
        "drains": sorted((r.step, r.level, r.committed, r.error) for r in drains),
    }


def _resume_from_levels(rank: int, world: int, root: str, levels: list) -> dict:
    """A restarted job (other weights, no optimizer state) load_state's, trains on, saves."""
    warnings.filterwarnings("ignore")
    os.environ["DCP_ML_NODE"] = str(rank)
    accelerator = _fsdp2_on_cpu(rank, world, levels=levels)
    parts = _prepared(accelerator, seed=1)
    accelerator.load_state(os.path.join(root, "ckpt"))
    loaded_iteration = accelerator.save_iteration
    received = {
        runtime.given[0].url: dict(runtime.restorer.last_restore.received)
        for runtime in dcp_multilevel.levels.runtime.runtimes()
        if runtime.restorer.last_restore is not None
    }
    # What each level served this rank, by copy (the step's location on the level).
    served = {
        runtime.given[0].url: dict(runtime.restorer.last_load_sources)
        for runtime in dcp_multilevel.levels.runtime.runtimes()
    }
    losses = [_step(accelerator, *parts, step, rank) for step in range(2, STEPS)]
    accelerator.save_state(os.path.join(root, "ckpt-after"))  # goes on numbering: step 1
    accelerator.wait_for_checkpoints()
    return {
        "losses": losses,
        "lr": parts[2].get_last_lr(),
        "loaded_iteration": loaded_iteration,
        "received": received,
        "served": served,
    }


def _lose_nodes_and_resume(tmp_path, remote: str, remote_options: dict, lost: list[int]):
    """Train and save, delete the ``lost`` nodes' directories, resume in new processes."""
    root = str(tmp_path)
    levels = _node_levels(root, remote, remote_options)
    before = run_ranks(_train_on_levels, WORLD, root, levels, timeout=120)
    for part in PARTS:
        for node in range(WORLD):
            for level in ("l1", "partner"):
                assert (tmp_path / f"n{node}" / level / part / "step-0").is_dir(), (node, part)
    assert all(r["save_iteration"] == 1 for r in before)
    assert all(err is None and ok for r in before for _, _, ok, err in r["drains"]), before
    assert StepMarker.read(tmp_path / "ckpt") == StepMarker(0, PARTS, describe(levels))
    assert not os.listdir(tmp_path / "ckpt" / PARTS[0])  # Accelerate's folder; ours is on levels
    for node in lost:
        shutil.rmtree(tmp_path / f"n{node}")
    after = run_ranks(_resume_from_levels, WORLD, root, levels, timeout=120)
    for rank in range(WORLD):
        # Bit for bit: the model and AdamW shards, and Accelerate's RNG states and scheduler.
        assert after[rank]["losses"] == before[rank]["losses"][2:], rank
        assert after[rank]["lr"] == before[rank]["lr"], rank
        assert after[rank]["loaded_iteration"] == 1, rank
    assert StepMarker.read(tmp_path / "ckpt-after").step == 1
    return after


def _held(tmp_path, node: int, part: str) -> list[str]:
    return sorted(os.listdir(tmp_path / f"n{node}" / "l1" / part))


@pytest.mark.multiprocess
def test_a_node_lost_after_save_state_resumes_from_its_partner_bit_exact(tmp_path):
    remote = str(tmp_path / "remote")
    after = _lose_nodes_and_resume(tmp_path, remote, {}, lost=[1])
    for part in PARTS:
        assert (tmp_path / "remote" / part / "step-0" / "manifest.json").is_file(), part
        assert (tmp_path / "remote" / part / "step-1" / "manifest.json").is_file(), part
        first = f"{tmp_path}/n{{node}}/l1/{part}"
        partner = f"partner:{tmp_path}/n{{node}}/partner/{part} (node 0)"
        assert partner in after[1]["received"][first], after[1]["received"]
        # Node 0 lost nothing of its own; what its rank reads of rank 1's files (DCP
        # saves each non-tensor value once) it has in its own partner copy.
        assert all(s.endswith("(this node)") for s in after[0]["received"][first]), after[0]
        for node in range(WORLD):  # the lost node's first level holds the step again
            assert _held(tmp_path, node, part) == ["step-0", "step-1"], (node, part)


@pytest.mark.multiprocess
def test_every_node_lost_after_save_state_resumes_from_s3_bit_exact(tmp_path, s3_server):
    bucket = s3_server.new_bucket()
    remote = f"s3://{bucket}/run"
    after = _lose_nodes_and_resume(tmp_path, remote, s3_server.storage_options, lost=[0, 1])
    keys = s3_server.keys(bucket)
    for part in PARTS:
        assert f"run/{part}/step-0/manifest.json" in keys, keys
        first = f"{tmp_path}/n{{node}}/l1/{part}"
        for rank in range(WORLD):  # no partner copy survived: read from the remote
            assert list(after[rank]["served"][first]) == [f"{remote}/{part}/step-0"], after[rank]
            assert not after[rank]["received"].get(first), after[rank]
        for node in range(WORLD):  # the save after the resume, on the new disks
            assert _held(tmp_path, node, part) == ["step-1"], (node, part)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stock_save", [True, False], ids=["stock", "ours"])
def test_an_accelerator_with_levels_loads_a_checkpoint_saved_without_them(tmp_path, stock_save):
    levels = [Level(f"{tmp_path}/n{{node}}/l1"), Level(f"partner:{tmp_path}/n{{node}}/p")]
    results = run_ranks(_save_train_load, WORLD, str(tmp_path), stock_save, levels, timeout=120)
    for rank, r in enumerate(results):
        differ = [k for k in r["saved"] if r["loaded"][k] != r["saved"][k]]
        assert not differ, f"rank {rank}: {differ}"
        assert r["loss"] == r["expected_loss"], rank
        assert r["save_iteration"] == 0, rank  # no step on the levels was loaded
    assert not (tmp_path / "n0").exists()  # the levels were not touched


def test_a_folder_saved_on_levels_is_refused_without_them_naming_the_levels(tmp_path):
    (tmp_path / "ckpt" / PARTS[0]).mkdir(parents=True)  # what Accelerate leaves
    StepMarker(3, PARTS, "[Level('/nvme/{node}/run')]").write(tmp_path / "ckpt")
    with multilevel_fsdp_checkpoints(), pytest.raises(ConfigError) as info:
        dcp.FileSystemReader(tmp_path / "ckpt" / PARTS[0])
    assert str(info.value) == (
        f"'{tmp_path}/ckpt/{PARTS[0]}' was saved on levels (step 3 of "
        f"[Level('/nvme/{{node}}/run')], named by {tmp_path}/ckpt/{MARKER_NAME}): load it "
        "with MultiLevelAccelerator(levels=...) and the same levels"
    )


def test_levels_must_be_a_list_of_levels(tmp_path):
    # Refused before Accelerate sets up any state.
    with pytest.raises(ConfigError) as info:
        MultiLevelAccelerator(cpu=True, levels=[str(tmp_path)])
    assert str(info.value) == (
        "MultiLevelAccelerator(levels=...) needs a non-empty list of dcp_multilevel.Level(...) "
        f"objects, got [{str(tmp_path)!r}]"
    )


def test_writer_options_the_levels_set_themselves_are_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        MultiLevelAccelerator(
            cpu=True,
            levels=[Level(str(tmp_path))],
            writer_options={"codec": "zstd", "thread_count": 2},
        )
    assert str(info.value) == (
        "MultiLevelAccelerator(levels=...): writer_options sets codec, which the levels set "
        "themselves: set them on each Level (Level(..., codec=..., storage_options=...); "
        "deltas: keyframe_every)"
    )


def _end_training_then_check(rank: int, world: int, root: str) -> list[bool]:
    import _faulty_fs  # noqa: F401 - registers faulty://

    warnings.filterwarnings("ignore")
    os.environ["DCP_ML_NODE"] = "0"
    slow = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "delay": {"put_file": 0.3},
    }
    levels = [Level(f"{root}/l1"), Level(f"faulty://{root}/remote", storage_options=slow)]
    accelerator = _fsdp2_on_cpu(rank, world, levels=levels)
    parts = _prepared(accelerator, seed=0)
    _step(accelerator, *parts, 0, rank)
    accelerator.save_state(os.path.join(root, "ckpt"))
    accelerator.end_training()  # ends the process group, after the drains landed
    landed = [os.path.isfile(f"{root}/remote/{part}/step-0/manifest.json") for part in PARTS]
    # run_ranks ends a process group of its own after this function: give it one.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return landed


@pytest.mark.multiprocess
def test_end_training_returns_once_the_saves_reached_every_level(tmp_path):
    (landed,) = run_ranks(_end_training_then_check, 1, str(tmp_path), timeout=120)
    assert landed == [True, True]


def _save_without_fsdp(rank: int, world: int, root: str) -> str:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    accelerator = MultiLevelAccelerator(cpu=True, levels=[Level(f"{root}/l1")])
    with pytest.raises(ConfigError) as info:
        accelerator.save_state(os.path.join(root, "ckpt"))
    return str(info.value)


@pytest.mark.multiprocess
def test_levels_without_sharded_fsdp_are_refused_before_anything_is_saved(tmp_path):
    (message,) = run_ranks(_save_without_fsdp, 1, str(tmp_path), timeout=120)
    assert message == (
        "MultiLevelAccelerator(levels=...).save_state: the levels hold FSDP's "
        "SHARDED_STATE_DICT model and optimizer states, and this accelerator runs MULTI_CPU, "
        "not FSDP; use FSDP with FullyShardedDataParallelPlugin("
        "state_dict_type='SHARDED_STATE_DICT'), or pass no levels"
    )
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "l1").exists()
