"""``StagingConfig(overlap=True)``: copies behind a fence, while training goes on.

``dcp.async_save`` returns before the copies are done, with DCP's
``AsyncSaveResponse``; the caller waits for ``staging_completion`` (the fence)
before the next in-place change, as torchtitan's ``maybe_wait_for_staging``
does. With ``check_fence=True`` a change before the fence fails the save.
Over the staging budget (``budget_bytes=0``: no copy at all) the fence also
waits until the tensors left live are written.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _gate import GatedPlanner
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_multilevel import ConfigError, MultiLevelReader, MultiLevelWriter, StagingConfig
from dcp_multilevel.errors import SaveInFlightError, StagingFenceError
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


@pytest.mark.parametrize("policy", ["wait", "raise"])
def test_with_both_buffer_sets_taken_async_save_returns_and_the_fence_waits_or_fails(
    tmp_path, policy
):
    """With overlap, waiting for a buffer set is the overlap thread's, not async_save's:
    the third save returns while two saves hold both sets; its fence completes once
    one of them ended ("wait") or fails with SaveInFlightError ("raise")."""
    staging = StagingConfig(overlap=True, in_flight=policy, wait_timeout_s=30)
    writer = MultiLevelWriter(tmp_path / "unused", staging=staging)
    sd = {"w": torch.arange(4096.0)}
    gate = threading.Event()
    try:
        held = []
        for name in ("a", "b"):  # "a" writes nothing until the gate opens; "b" waits for it
            response = dcp.async_save(
                sd,
                storage_writer=writer,
                checkpoint_id=tmp_path / name,
                planner=GatedPlanner(gate),
            )
            response.staging_completion.result(timeout=30)
            held.append(response.upload_completion)
        sd["w"].add_(1.0)
        third = dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / "c")
        if policy == "raise":
            with pytest.raises(SaveInFlightError, match="is still being written"):
                third.upload_completion.result(timeout=30)
            # Done, failed or not: DCP reports a fence that failed before async_save
            # returned as a success (torch 2.13 checks done(), not the exception).
            assert third.staging_completion.done()
        else:
            time.sleep(0.2)
            assert not third.staging_completion.done()  # no set is free yet
    finally:
        gate.set()
    for f in held:
        f.result(timeout=60)
    if policy == "wait":
        third.staging_completion.result(timeout=60)
        sd["w"].add_(1.0)  # after the fence: not in the checkpoint
        third.upload_completion.result(timeout=60)
        assert torch.equal(_load(tmp_path / "c", sd)["w"], torch.arange(4096.0) + 1)
    else:
        assert not (tmp_path / "c" / "manifest.json").exists()
    assert torch.equal(_load(tmp_path / "b", sd)["w"], torch.arange(4096.0))


def test_async_save_arms_the_fence_so_the_copies_begin_once_it_returned(tmp_path):
    """The overlap thread begins copying once DCP wrapped the fence for
    ``staging_completion``, the last step of ``async_save`` (so as not to take the
    GIL from the training thread before it returns); else only after a fallback
    wait. A torch whose ``async_save`` stopped doing so would delay every copy."""
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=True))
    fences = []
    stage = writer.stage
    writer.stage = lambda sd: fences.append(stage(sd)) or fences[-1]
    response = dcp.async_save({"w": torch.randn(1000)}, storage_writer=writer)
    assert fences[0].armed.is_set()
    response.upload_completion.result()


def test_a_device_snapshot_needs_overlap_and_leaves_a_cpu_state_alone(tmp_path):
    with pytest.raises(ConfigError, match="device_snapshot_bytes needs overlap=True"):
        StagingConfig(device_snapshot_bytes=1 << 20)
    with pytest.raises(ConfigError, match="device_snapshot_bytes must be an int >= 0, got -1"):
        StagingConfig(overlap=True, device_snapshot_bytes=-1)
    # A CPU state has nothing to copy on a device: saved as without the option.
    staging = StagingConfig(overlap=True, device_snapshot_bytes=1 << 20)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging)
    sd = {"w": torch.randn(256, 256), "b": torch.arange(10.0)}
    want = {k: v.clone() for k, v in sd.items()}
    response = dcp.async_save(sd, storage_writer=writer)
    response.staging_completion.result()
    sd["w"].mul_(-1.0)
    response.upload_completion.result()
    assert bit_equal(_load(tmp_path / "c", want), want)
    assert writer._stager._staging.device.held_bytes == 0


def test_an_optimizer_step_before_the_fence_waits_for_it(tmp_path):
    """A loop that forgets to wait for staging_completion: its optimizer step waits
    anyway (torch's global step pre-hook), so the save holds the state of its call,
    not one mixed from two steps. close() takes the hook away."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    hooks_before = len(_global_optimizer_pre_hooks)
    torch.manual_seed(0)
    model = nn.Linear(4096, 4096)  # 64 MiB of weights: their copy takes a while
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(8, 4096)).square().mean().backward()
    staging = StagingConfig(overlap=True, copy_threads=1)
    writer = MultiLevelWriter(tmp_path / "unused", staging=staging)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    response = dcp.async_save(
        {"model": model.state_dict()}, storage_writer=writer, checkpoint_id=tmp_path / "c"
    )
    opt.step()  # no wait for staging_completion
    assert response.staging_completion.done()  # the step waited for it
    response.upload_completion.result()
    assert not torch.equal(model.weight, want["weight"])  # the step did change the weights
    assert bit_equal(_load(tmp_path / "c", {"model": want})["model"], want)
    assert len(_global_optimizer_pre_hooks) == hooks_before + 1
    writer.close()
    assert len(_global_optimizer_pre_hooks) == hooks_before


def test_a_fence_completed_before_its_copies_are_made_does_not_wait_for_them(tmp_path):
    """With a device snapshot the fence completes once the state was read on the
    GPU, before the same thread copies it to the host. DCP's callback that turns
    the fence into ``staging_completion`` asks for its result then: it must not
    wait for the copies (it did, and every such save hung on the H100). On a CPU
    the order comes from a stager of its own, through DCP's ``async_stager``."""
    from torch.distributed.checkpoint.staging import AsyncStager

    from dcp_multilevel.staging.live import LiveFence

    sd = {"w": torch.randn(1000)}
    want = {k: v.clone() for k, v in sd.items()}
    fence = LiveFence()
    completed_first = threading.Event()
    copier: list[threading.Thread] = []

    class FenceFirst(AsyncStager):
        def stage(self, state_dict):
            def copy():
                fence.armed.wait(5)
                read = {k: v.clone() for k, v in state_dict.items()}  # (on the device)
                fence.complete()  # the state was read: it may change now
                completed_first.set()
                fence.hand_over(read)  # (once copied to the host)

            copier.append(threading.Thread(target=copy, daemon=True))
            copier[0].start()
            return fence

        def synchronize_staging(self):
            pass

    writer = MultiLevelWriter(tmp_path / "c")
    response = dcp.async_save(sd, storage_writer=writer, async_stager=FenceFirst())
    if not completed_first.wait(10):
        fence.hand_over(want)  # unblock DCP's thread, then fail
        pytest.fail("the fence's complete() waited for the copies it comes before")
    assert response.staging_completion.result(timeout=10) is None
    sd["w"].mul_(-1.0)
    response.upload_completion.result(timeout=30)
    assert bit_equal(_load(tmp_path / "c", want), want)
    # The save's thread read the staged dict; the callback on the copy thread did not count.
    assert fence.reader not in (None, copier[0], threading.current_thread())
