"""The 0.1.0 ways that have one way now still work, with a DeprecationWarning naming it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_multilevel import MultiLevelReader, MultiLevelWriter


def test_a_writers_reference_still_codes_deltas_and_names_the_level_way(tmp_path):
    dcp.save({"w": torch.zeros(4096)}, storage_writer=MultiLevelWriter(tmp_path / "step-1"))
    with pytest.warns(DeprecationWarning) as caught:
        writer = MultiLevelWriter(
            tmp_path / "step-2", codec="bytegroup", reference=tmp_path / "step-1"
        )
    assert str(caught[0].message) == (
        "MultiLevelWriter(reference=...) is deprecated: deltas are a level's "
        "(levels=[Level(root, codec='bytegroup', keyframe_every=N)], docs/delta.md); "
        "reference goes in the next major release"
    )
    dcp.save({"w": torch.ones(4096)}, storage_writer=writer)
    out = {"w": torch.empty(4096)}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "step-2"))
    assert torch.equal(out["w"], torch.ones(4096))


def test_a_readers_fallbacks_still_read_and_name_the_level_way(tmp_path):
    dcp.save({"w": torch.arange(8.0)}, storage_writer=MultiLevelWriter(tmp_path / "slow"))
    with pytest.warns(DeprecationWarning) as caught:
        reader = MultiLevelReader(tmp_path / "gone", fallbacks=[tmp_path / "slow"])
    assert str(caught[0].message) == (
        "MultiLevelReader(fallbacks=...) is deprecated: give the copies as levels "
        "(MultiLevelReader('step-<N>', levels=[Level(fast), Level(slow), ...]), "
        "docs/levels.md); fallbacks go in the next major release"
    )
    out = {"w": torch.empty(8)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], torch.arange(8.0))
