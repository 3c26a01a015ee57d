"""``StagingConfig(overlap=True)``: copies behind a fence, while training goes on.

``dcp.async_save`` returns before the copies are done, with DCP's
``AsyncSaveResponse``; the caller waits for ``staging_completion`` (the fence)
before the next in-place change, as torchtitan's ``maybe_wait_for_staging``
does. With ``check_fence=True`` a change before the fence fails the save.
Over the staging budget (``budget_bytes=0``: no copy at all) the fence also
waits until the tensors left live are written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_multilevel import MultiLevelReader, MultiLevelWriter, StagingConfig, StagingFenceError
from dcp_multilevel.testing.levels import bit_equal


def _zeros(like: dict) -> dict:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in like.items()}


def _load(path: Path, like: dict) -> dict:
    back = _zeros(like)
    dcp.load(back, storage_reader=MultiLevelReader(path))
    return back


def test_async_save_answers_with_a_fence_and_saves_the_state_of_its_call(tmp_path):
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=True))
    sd = {"w": torch.randn(512, 512), "b": torch.arange(1000.0)}
    want = {k: v.clone() for k, v in sd.items()}
    response = dcp.async_save(sd, storage_writer=writer)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result()  # the fence: the state may change now
    for v in sd.values():
        v.mul_(-1.0)
    response.upload_completion.result()
    assert bit_equal(_load(tmp_path / "c", want), want)


def test_a_change_before_the_fence_fails_the_save_and_names_the_tensor(tmp_path):
    staging = StagingConfig(overlap=True, check_fence=True, copy_threads=1)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging)
    # Copied in order: 128 MiB first, so the small tensor after it is copied well
    # after async_save returned, and after the change below.
    sd = {"big": torch.ones(32 << 20), "small": torch.zeros(16)}
    response = dcp.async_save(sd, storage_writer=writer)
    sd["small"].add_(1.0)  # no wait for staging_completion: a broken fence
    with pytest.raises(StagingFenceError, match=r"'/small'"):
        response.upload_completion.result()
    assert not (tmp_path / "c" / "manifest.json").exists()
    # The writer goes on: the next save, fenced, commits.
    response = dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / "d")
    response.staging_completion.result()
    response.upload_completion.result()
    assert bit_equal(_load(tmp_path / "d", sd), sd)


@pytest.mark.parametrize("budget", [None, 0, 64 << 10], ids=["copies", "no-copy", "part"])
def test_training_with_saves_behind_the_fence_is_bit_exact_at_any_budget(tmp_path, budget):
    """Over budget, the tensors left out are written from the live state behind the
    fence: budget 0 copies nothing, and the fence waits until the bytes are in the
    files. The optimizer step after the fence must not reach the checkpoint."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    staging = StagingConfig(overlap=True, budget_bytes=budget, check_fence=True)
    writer = MultiLevelWriter(tmp_path / "unused", staging=staging)
    snapshots, pending, fence = {}, [], None
    for step in range(1, 7):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()  # overlaps the last save's copies and writes
        if fence is not None:
            fence.result()
            fence = None
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            snapshots[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
            response = dcp.async_save(
                state, storage_writer=writer, checkpoint_id=tmp_path / f"s{step}"
            )
            fence = response.staging_completion
            pending.append(response.upload_completion)
    for f in pending:
        f.result()
    for step, want in snapshots.items():
        assert bit_equal(_load(tmp_path / f"s{step}", want), want), step
    pool = writer.staging_pool
    assert len(pool.sets) <= 2  # reused, not one per save
    if budget == 0:
        assert pool.held_bytes == 0  # no copy of the state at all
    elif budget is not None:
        assert 0 < pool.held_bytes <= budget


def test_without_a_copy_the_fence_waits_until_the_live_bytes_are_written(tmp_path):
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=True, budget_bytes=0))
    sd = {"w": torch.randn(64 << 20), "b": torch.arange(1000.0)}  # 256 MiB: writing takes a while
    want = {k: v.clone() for k, v in sd.items()}
    response = dcp.async_save(sd, storage_writer=writer)
    assert not response.staging_completion.done()  # returned before writing, copying nothing
    response.staging_completion.result()
    for v in sd.values():  # the next optimizer step
        v.mul_(-1.0)
    response.upload_completion.result()
    assert bit_equal(_load(tmp_path / "c", want), want)
    assert writer.staging_pool.held_bytes == 0


def test_a_change_to_a_live_tensor_before_the_fence_fails_the_save(tmp_path):
    staging = StagingConfig(overlap=True, budget_bytes=0, check_fence=True)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging)
    # Written in order: 128 MiB first, so the change below comes before the small
    # tensor is written, and well before the fence check after the last live write.
    sd = {"big": torch.ones(32 << 20), "small": torch.zeros(16)}
    response = dcp.async_save(sd, storage_writer=writer)
    sd["small"].add_(1.0)  # no wait for staging_completion: a broken fence
    # Raised by write_data, so DCP's CheckpointException carries it.
    with pytest.raises(
        CheckpointException, match=r"StagingFenceError: .* from the live state \(e.g. '/small'\)"
    ):
        response.upload_completion.result()
    response.staging_completion.result()  # the fence still completes: training goes on
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_save_that_fails_before_writing_still_completes_its_fence(tmp_path):
    staging = StagingConfig(overlap=True, budget_bytes=0)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging)
    sd = {"w": torch.randn(1000)}
    first = dcp.async_save(sd, storage_writer=writer)
    first.staging_completion.result()
    first.upload_completion.result()
    again = dcp.async_save(sd, storage_writer=writer)  # a committed checkpoint: refused
    again.staging_completion.result(timeout=60)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        again.upload_completion.result()
