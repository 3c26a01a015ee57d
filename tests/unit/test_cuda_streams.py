"""Saves and loads while training runs on a CUDA stream of its own.

Each test queues the work that writes the state (or the destination of a
load) on a training stream, behind a spin of about 0.1 s on the device
(``torch.cuda._sleep``), then saves or loads from inside that stream, as a
training loop on its own stream does. A read of the state not ordered after
that work stores the values from before it; a copy into a destination not
ordered after it is overwritten by it, or is not done yet when the load
returns. They skip without a GPU (``.ci/device-check`` runs them); the same
paths with host state run in ``test_streams.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_multilevel import MultiLevelReader, MultiLevelWriter, StagingConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Device cycles the training stream spins before it writes (about 0.1 s at 2 GHz).
SPIN = 200_000_000

SHAPE = (512, 1024)  # 2 MiB of float32 per tensor
N = 6


class Tagged(torch.Tensor):
    """A tensor subclass: staged the stock way (``.to("cpu")``), not through the buffers."""


def _state() -> dict[str, torch.Tensor]:
    state = {f"w{i}": torch.full(SHAPE, -1.0, device="cuda") for i in range(N)}
    torch.cuda.synchronize()
    return state


def _train(stream: torch.cuda.Stream, state: dict[str, torch.Tensor], value: float) -> None:
    """On ``stream``: spin, then write ``value + i`` into the i-th tensor (a step)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        for i, v in enumerate(state.values()):
            v.fill_(value + i)


def _saved(path, names) -> list[list[float]]:
    out = {k: torch.zeros(SHAPE) for k in names}
    dcp.load(out, storage_reader=MultiLevelReader(path))
    return [out[k].unique().tolist() for k in names]


@cuda
@pytest.mark.parametrize("threads", [1, 4])
def test_a_save_from_a_training_stream_stores_what_its_work_wrote(tmp_path, threads):
    # The writer's threads copy and count on streams that wait for the training's.
    state = _state()
    stream = torch.cuda.Stream()
    _train(stream, state, 1.0)
    with torch.cuda.stream(stream):
        state["w2"][0, 0] = math.nan  # counted on the device: the save is quarantined
        writer = MultiLevelWriter(tmp_path / "c", thread_count=threads)
        dcp.save(state, storage_writer=writer)
        for v in state.values():
            v.fill_(99.0)  # the next step
    torch.cuda.synchronize()
    assert writer.health is not None and writer.health.quarantined
    assert "w2" in str(writer.health.findings)
    got = _saved(tmp_path / "c", [f"w{i}" for i in range(N) if i != 2])
    assert got == [[1.0 + i] for i in range(N) if i != 2]


_ASYNC = {
    "staged": StagingConfig(),
    "through": StagingConfig(budget_bytes=0),
    "half": StagingConfig(budget_bytes=6 << 20),
    "overlap": StagingConfig(overlap=True),
    "overlap-through": StagingConfig(overlap=True, budget_bytes=0),
    "overlap-half": StagingConfig(overlap=True, budget_bytes=6 << 20),
    "snapshot": StagingConfig(overlap=True, device_snapshot_bytes=64 << 20),
    "snapshot-half": StagingConfig(overlap=True, device_snapshot_bytes=6 << 20),
}


@cuda
@pytest.mark.parametrize("how", list(_ASYNC))
def test_an_async_save_from_a_training_stream_stores_what_its_work_wrote(tmp_path, how):
    # Staged on the training thread, on the overlap thread, into a device
    # snapshot, or written through from the live state by the save's thread:
    # every read waits for the work queued before async_save.
    staging = _ASYNC[how]
    state = _state()
    writer = MultiLevelWriter(tmp_path / "unused", staging=staging, thread_count=2)
    stream = torch.cuda.Stream()
    for step in range(2):
        _train(stream, state, 10.0 * (step + 1))
        with torch.cuda.stream(stream):
            r = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / f"s{step}")
            if staging.overlap:
                r.staging_completion.result()  # the fence
            for v in state.values():
                v.fill_(-7.0)  # the next optimizer step
        (r.upload_completion if staging.overlap else r).result()
    torch.cuda.synchronize()
    writer.close()
    names = [f"w{i}" for i in range(N)]
    for step in range(2):
        assert _saved(tmp_path / f"s{step}", names) == [
            [10.0 * (step + 1) + i] for i in range(N)
        ], step


@cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_a_tensor_subclass_from_a_training_stream_is_staged_after_its_work(tmp_path, overlap):
    # Staged the stock way, on the overlap thread too: on the staging side stream.
    state = _state()
    state["tagged"] = torch.full(SHAPE, -1.0, device="cuda").as_subclass(Tagged)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    _train(stream, state, 3.0)
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=overlap))
    with torch.cuda.stream(stream):
        r = dcp.async_save(state, storage_writer=writer)
        if overlap:
            r.staging_completion.result()
        for v in state.values():
            v.fill_(-7.0)
    (r.upload_completion if overlap else r).result()
    writer.close()
    assert _saved(tmp_path / "c", list(state)) == [[3.0 + i] for i in range(N + 1)]


@cuda
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("path", ["streamed", "scratch"])
def test_a_load_on_a_training_stream_lands_after_its_work_and_is_done_on_return(
    tmp_path, path, threads
):
    # Streamed: raw items of the destination's dtype, through the pinned blocks;
    # scratch: another dtype, copied from pinned scratch once verified.
    saved = {f"w{i}": torch.full(SHAPE, float(i + 1)) for i in range(N)}
    dcp.save(saved, storage_writer=MultiLevelWriter(tmp_path / "c"))
    dtype = torch.float32 if path == "streamed" else torch.float64
    out = {k: torch.zeros(SHAPE, dtype=dtype, device="cuda") for k in saved}
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        for v in out.values():
            v.fill_(-3.0)  # the training's last write before the load
        dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c", thread_count=threads))
    # Done on return: a stream that waits for nothing sees the loaded values.
    with torch.cuda.stream(torch.cuda.Stream()):
        got = {k: v.to("cpu") for k, v in out.items()}
    assert all(torch.equal(got[k], v.to(dtype)) for k, v in saved.items())


@cuda
@pytest.mark.parametrize("budget", [None, 0], ids=["staged", "through"])
def test_a_state_made_on_a_training_stream_and_dropped_at_once_is_saved(tmp_path, budget):
    # Made for the save on the training stream and dropped as async_save returns:
    # the blocks it held are not handed to the next allocations on that stream
    # while a copy may still read them.
    staging = StagingConfig(overlap=True, budget_bytes=budget)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging, thread_count=2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        state = {f"w{i}": torch.full(SHAPE, float(i + 1), device="cuda") for i in range(N)}
        r = dcp.async_save(state, storage_writer=writer)
        del state
        reuse = [torch.full(SHAPE, -1.0, device="cuda") for _ in range(N)]
    r.upload_completion.result()
    writer.close()
    torch.cuda.synchronize()
    assert _saved(tmp_path / "c", [f"w{i}" for i in range(N)]) == [[i + 1.0] for i in range(N)]
    assert all(bool(v.eq(-1).all()) for v in reuse)
