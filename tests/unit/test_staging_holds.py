"""An overlapped async save keeps the state it has not copied yet alive, and only that long.

``StagingConfig(overlap=True)``: ``async_save`` returns before the state is
copied; the copies run on the stager's overlap thread. A state made for the
save (a full state dict gathered from shards, a ``Stateful``'s fresh
``state_dict()``) may be dropped by the caller at once: then the stager's hold
is the only thing keeping its tensors alive until they are copied. Here both
buffer sets are taken by earlier saves held at their write (a gated planner),
so the third save's copies cannot start until the gate opens; weak references
show who keeps its tensors. (CUDA: ``tests/unit/test_cuda.py``.)
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch
import torch.distributed.checkpoint as dcp
from _gate import GatedPlanner

from dcp_multilevel import MultiLevelReader, MultiLevelWriter, StagingConfig


def _made_for_the_save(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": (torch.randn(256, 256, generator=g) * 2).to(device) for i in range(4)}


def held_until_copied(tmp_path, device: str = "cpu", snapshot_bytes: int = 0) -> None:
    """The test, on ``device`` (shared with the CUDA test; ``snapshot_bytes``: its
    ``StagingConfig.device_snapshot_bytes``)."""
    gate = threading.Event()
    planner = GatedPlanner(gate)
    staging = StagingConfig(overlap=True, device_snapshot_bytes=snapshot_bytes)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging)
    earlier = []
    for s in (1, 2):
        r = dcp.async_save(
            _made_for_the_save(s, device),
            storage_writer=writer,
            planner=planner,
            checkpoint_id=tmp_path / f"s{s}",
        )
        earlier.append(r)
    for r in earlier:  # staged into the two buffer sets; their writes wait at the gate
        r.staging_completion.result()
    state = _made_for_the_save(3, device)
    expected = {k: v.cpu().clone() for k, v in state.items()}
    refs = [weakref.ref(v) for v in state.values()]
    third = dcp.async_save(
        state, storage_writer=writer, planner=planner, checkpoint_id=tmp_path / "s3"
    )
    del state  # the caller's last reference: DCP keeps none of the tensors
    gc.collect()
    # No buffer set is free: nothing of the third save is copied yet, and the
    # stager's hold alone keeps its tensors.
    assert not third.staging_completion.done()
    assert all(ref() is not None for ref in refs)
    # Memory a freed tensor gave back would be taken by these (CUDA: the caching
    # allocator hands the same blocks out on the same stream).
    reuse = [torch.full((256, 256), -1.0, device=device) for _ in range(4)]
    gate.set()
    for r in [*earlier, third]:
        r.upload_completion.result()
    out = {k: torch.zeros(256, 256) for k in expected}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "s3"))
    assert all(torch.equal(out[k], expected[k]) for k in expected)
    assert all(bool(r.eq(-1).all()) for r in reuse)
    # Let go once copied: held no longer. (The overlap thread copies one save at
    # a time, in order: once a fourth save's copy is done, the third's is over.)
    fourth = dcp.async_save(
        {"x": torch.ones(3, device=device)},
        storage_writer=writer,
        planner=planner,
        checkpoint_id=tmp_path / "s4",
    )
    fourth.upload_completion.result()
    writer.close()
    del third
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_an_overlapped_save_holds_a_dropped_state_until_it_is_copied(tmp_path):
    held_until_copied(tmp_path)
