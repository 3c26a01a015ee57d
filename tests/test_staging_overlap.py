"""``StagingConfig(overlap=True)``: copies behind a fence, while training goes on.

``dcp.async_save`` returns before the copies are done, with DCP's
``AsyncSaveResponse``; the caller waits for ``staging_completion`` (the fence)
before the next in-place change, as torchtitan's ``maybe_wait_for_staging``
does. With ``check_fence=True`` a change before the fence fails the save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
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


def test_training_with_overlapped_saves_is_bit_exact(tmp_path):
    """Forward and backward run while the copies do; the optimizer step waits for the
    fence. Every checkpoint holds the state of the step it was taken at."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    writer = MultiLevelWriter(tmp_path / "unused", staging=StagingConfig(overlap=True))
    snapshots, pending, fence = {}, [], None
    for step in range(1, 9):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()  # overlaps the copies of the last save
        if fence is not None:
            fence.result()
            fence = None
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            # What the checkpoint must hold: the weights of this step.
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
    assert pool is not None and len(pool.sets) <= 2  # reused, not one per save
