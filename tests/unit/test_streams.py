"""Stream order of saves and loads (``checkpoint/streams.py``): what runs without a GPU.

The reads of live device state and the copies into device destinations, on
a training stream of its own, are in ``test_cuda_streams.py`` (they skip
without CUDA). Here: the same code paths with host state (the stream order
does nothing, and must change nothing), and the fallbacks staged the stock
way.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import MultiLevelReader, MultiLevelWriter, StagingConfig
from dcp_multilevel.checkpoint.streams import StreamMarks


class Tagged(torch.Tensor):
    """A tensor subclass: the staging copies it the stock way (``.to("cpu")``)."""


def test_marks_without_cuda_in_use_are_empty_and_change_nothing():
    marks = StreamMarks.here({"w": torch.ones(3)})
    assert not marks and marks.events == {}
    with marks.following():
        assert torch.ones(2).add(1).tolist() == [2.0, 2.0]
    marks.adopt()()  # puts back nothing
    marks.finish()


@pytest.mark.parametrize("threads", [1, 3])
def test_saves_and_loads_from_several_threads_follow_the_callers_marks(tmp_path, threads):
    # The writer's and reader's threads each run under the caller's marks (a
    # no-op on the host): every item still lands, from each thread.
    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(6)}
    writer = MultiLevelWriter(tmp_path / "c", thread_count=threads)
    dcp.save(state, storage_writer=writer)
    out = {k: torch.zeros(64, 64) for k in state}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c", thread_count=threads))
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize(
    ("overlap", "budget"), [(False, None), (True, None), (False, 0), (True, 0)]
)
def test_a_tensor_subclass_is_staged_and_saved(tmp_path, overlap, budget):
    # Staged the stock way (the buffers hold plain tensors only), on the overlap
    # thread too; over a zero budget written from the live state.
    values = torch.arange(12.0).reshape(3, 4)
    state = {"tagged": values.clone().as_subclass(Tagged), "plain": torch.ones(5)}
    writer = MultiLevelWriter(
        tmp_path / "c", staging=StagingConfig(overlap=overlap, budget_bytes=budget)
    )
    response = dcp.async_save(state, storage_writer=writer)
    (response.upload_completion if overlap else response).result()
    writer.close()
    out = {"tagged": torch.zeros(3, 4), "plain": torch.zeros(5)}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert torch.equal(out["tagged"], values) and torch.equal(out["plain"], torch.ones(5))


@pytest.mark.parametrize("how", ["save", "async"])
def test_a_sparse_tensor_is_refused_naming_it(tmp_path, how):
    # Stock DCP cannot save one either ("Cannot access storage of SparseTensorImpl").
    state = {"emb": torch.eye(4).to_sparse(), "w": torch.ones(2)}
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=True))
    refused = r"tensor item 'emb' is a torch.sparse_coo tensor; .* \(t.to_dense\(\)\)"
    with pytest.raises(CheckpointException, match=refused):
        if how == "save":
            dcp.save(state, storage_writer=writer)
        else:
            dcp.async_save(state, storage_writer=writer).upload_completion.result()
    writer.close()
