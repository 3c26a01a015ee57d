"""Streaming an item through a reading thread's two blocks (``destinations.Bounce``).

The reader streams a raw item into a whole CUDA tensor of its dtype this way
(``tests/unit/test_cuda.py`` runs that end to end where a GPU is lent). Here the
same blocks, offsets and checks run into CPU tensors, read from a real
checkpoint: the bytes land whole for any size against the block size, and a
flipped byte fails the item after its last block.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _damage import flip_byte

from dcp_multilevel import MultiLevelWriter
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.checkpoint.destinations import Bounce
from dcp_multilevel.errors import ChecksumMismatchError

STATE = {
    "empty": torch.empty(0),
    "scalar": torch.tensor(3.5),
    "under": torch.arange(100.0),  # 400 bytes: less than a block
    "exact": torch.arange(768, dtype=torch.int32),  # 3,072 bytes: three blocks
    "over": torch.randn(1000, generator=torch.Generator().manual_seed(0)),  # 3 blocks + 928
    "bf16": torch.arange(999.0).to(torch.bfloat16),
}


def _stream(path, bounce: Bounce, fqn: str, out: torch.Tensor, committed: list[str]) -> None:
    copy = StoredCheckpoint.at(path)
    loc = next(v for k, v in copy.manifest().locations.items() if k.fqn == fqn)
    landing = bounce.landing(out, loc.length, lambda: committed.append(fqn))
    with copy.open_data(loc.file, fqn) as handle:
        copy.read_stored(handle, fqn, loc, landing.blocks, landing.on_block)
    landing.commit()  # as the reader does, once the read verified the bytes


def test_items_of_any_size_land_whole_through_two_alternating_blocks(tmp_path):
    dcp.save(STATE, storage_writer=MultiLevelWriter(tmp_path / "c"))
    bounce = Bounce(block_bytes=1024)  # one pair for every item, as one reading thread
    committed: list[str] = []
    for fqn, want in STATE.items():
        out = torch.full_like(want, -1)
        _stream(tmp_path / "c", bounce, fqn, out, committed)
        assert torch.equal(out, want), fqn
    bounce.drain()
    assert committed == list(STATE)


def test_a_flipped_byte_fails_the_streamed_item_and_commits_nothing(tmp_path):
    dcp.save(STATE, storage_writer=MultiLevelWriter(tmp_path / "c"))
    copy = StoredCheckpoint.at(tmp_path / "c")
    loc = next(v for k, v in copy.manifest().locations.items() if k.fqn == "over")
    flip_byte(tmp_path / "c" / loc.file, loc.offset + 2500, 0x10)  # in the third block of four
    committed: list[str] = []
    with pytest.raises(ChecksumMismatchError, match="'over'"):
        _stream(tmp_path / "c", Bounce(block_bytes=1024), "over", torch.zeros(1000), committed)
    assert committed == []
