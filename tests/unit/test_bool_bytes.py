"""Bool tensors keep their bytes on every save path and into every load destination.

A bool tensor viewed from raw bytes may hold bytes other than 0 and 1; torch's
bool copy kernels (``contiguous()``, ``copy_`` between strided bools) rewrite
them as 1, and a save keeps bits. (CUDA: ``tests/unit/test_cuda.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_multilevel import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter, StagingConfig
from dcp_multilevel.format.tensor_bytes import value_tensor
from dcp_multilevel.planning.fingerprint import fingerprint


def _raw_bools() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (48,), generator=g, dtype=torch.uint8)
    flags = raw.view(torch.bool)
    return {
        "contiguous": flags.reshape(6, 8),
        "transposed": flags.reshape(6, 8).t(),
        "stepped": flags[1::3],
        "large_strided": torch.randint(0, 256, (3 << 20,), generator=g, dtype=torch.uint8)
        .view(torch.bool)
        .reshape(-1, 2)[:, 0],
    }


def _bytes(t: torch.Tensor) -> list[int]:
    """``t``'s bytes in row-major order, read as bytes (no bool copy)."""
    return t.view(torch.uint8).contiguous().reshape(-1).tolist()


def test_the_states_hold_bytes_a_bool_copy_would_rewrite():
    for name, t in _raw_bools().items():
        assert any(b not in (0, 1) for b in _bytes(t)), name
        if not t.is_contiguous():  # what the paths below must not do
            assert _bytes(t.contiguous()) != _bytes(t), name


@pytest.mark.parametrize("how", ["save", "replica check", "async", "overlap", "fence check"])
def test_bool_tensors_of_every_layout_store_their_bytes(tmp_path, how):
    state = _raw_bools()
    want = {k: _bytes(v) for k, v in state.items()}
    if how in ("save", "replica check"):
        planner = BalancedSavePlanner(verify_replicas=how == "replica check")
        dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"), planner=planner)
    else:
        staging = StagingConfig(overlap=how != "async", check_fence=how == "fence check")
        writer = MultiLevelWriter(tmp_path / "c", staging=staging)
        r = dcp.async_save(state, storage_writer=writer)
        (r if how == "async" else r.upload_completion).result()
        writer.close()
    out = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in state.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    for k in state:
        assert _bytes(out[k]) == want[k], k


def test_value_tensor_and_fingerprint_of_a_strided_bool_are_of_its_bytes():
    t = _raw_bools()["transposed"]
    assert _bytes(value_tensor(t)) == _bytes(t)
    assert fingerprint(t) == fingerprint(t.view(torch.uint8).contiguous().view(torch.bool))
    assert fingerprint(t) != fingerprint(t.contiguous())  # the bool copy's 0s and 1s


def test_a_load_into_strided_bool_destinations_keeps_the_bytes(tmp_path):
    # The destination is not the read buffer: the bytes land in scratch memory and
    # are copied into it, which must not be a bool copy.
    state = _raw_bools()
    want = {k: _bytes(v) for k, v in state.items()}
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    out = {k: torch.zeros(v.shape[::-1], dtype=torch.bool).t() for k, v in state.items()}
    assert all(not t.is_contiguous() for t in out.values() if t.dim() == 2 and t.numel() > 1)
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    for k in state:
        assert _bytes(out[k]) == want[k], k
