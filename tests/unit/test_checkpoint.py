"""StoredCheckpoint and CheckpointRoot: one object per stored checkpoint, on every store."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_bit_equal

from dcp_multilevel import CheckpointNotFoundError, MultiLevelWriter
from dcp_multilevel.checkpoint import CheckpointRoot, StoredCheckpoint, blocks_of
from dcp_multilevel.errors import ChecksumMismatchError
from dcp_multilevel.format import MANIFEST_NAME, step_dir
from dcp_multilevel.format.tensor_bytes import byte_view


@pytest.fixture(params=["local", "memory"])
def root_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://dcp-ml-{uuid.uuid4().hex[:8]}/run"


def _state(v: int) -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32) + v, "meta": {"v": v}}


def _save(root: CheckpointRoot, step: int, codec: str | None = None) -> StoredCheckpoint:
    dcp.save(_state(step), storage_writer=MultiLevelWriter(root.location(step), codec=codec))
    return root.checkpoint(step)


def test_a_root_lists_committed_steps_and_deletes_manifest_first(root_url):
    root = CheckpointRoot(root_url)
    assert root.steps() == []
    for s in (3, 1, 2):
        _save(root, s)
    assert root.steps() == [1, 2, 3]
    half = root.checkpoint(2)
    half.store.remove_tree(MANIFEST_NAME)  # a delete that died after its first step
    assert not half.is_committed()
    assert root.steps() == [1, 3] and root.uncommitted() == [2]
    root.delete(2)
    root.checkpoint(3).delete()
    assert root.steps() == [1] and root.uncommitted() == []
    assert step_dir(3) not in root.store.listdir("")


def test_a_missing_manifest_is_checkpoint_not_found(root_url):
    ckpt = CheckpointRoot(root_url).checkpoint(7)
    with pytest.raises(CheckpointNotFoundError) as info:
        ckpt.manifest()
    assert str(info.value) == (
        f"no committed checkpoint at {ckpt.url}: manifest.json is missing (a save that did "
        "not finish leaves none). Check the path, or load an earlier checkpoint."
    )
    with pytest.raises(CheckpointNotFoundError):  # remembered until forget()
        ckpt.manifest()


@pytest.mark.parametrize("codec", [None, "bytegroup"])
def test_read_item_decodes_and_read_stored_streams_verified_bytes(root_url, codec):
    ckpt = _save(CheckpointRoot(root_url), 5, codec)
    manifest = ckpt.manifest()
    index, loc = next((i, loc) for i, loc in manifest.locations.items() if i.fqn == "w")
    out = torch.empty(4096, dtype=torch.float32)
    with ckpt.open_data(loc.file, "w") as handle:
        ckpt.read_item(handle, index, loc, byte_view(out))
        streamed = bytearray()
        ckpt.read_stored(
            handle,
            "w",
            loc,
            blocks_of(memoryview(bytearray(1000)), loc.length),
            streamed.extend,
        )
    assert_bit_equal(out, _state(5)["w"], "w")
    assert len(streamed) == loc.length
    assert bytes(streamed) == ckpt.store.read_bytes(loc.file)[loc.offset : loc.offset + loc.length]
    assert (codec is None) == (not loc.transforms)


def test_read_stored_refuses_a_flipped_byte(tmp_path):
    ckpt = _save(CheckpointRoot(str(tmp_path)), 1)
    loc = next(loc for i, loc in ckpt.manifest().locations.items() if i.fqn == "w")
    raw = bytearray(ckpt.store.read_bytes(loc.file))
    raw[loc.offset + 3] ^= 1
    with ckpt.store.open_write(loc.file) as f:
        f.write(raw)
    with ckpt.open_data(loc.file, "w") as handle, pytest.raises(ChecksumMismatchError) as info:
        ckpt.read_stored(handle, "w", loc, [memoryview(bytearray(loc.length))])
    assert str(info.value).startswith(f"checksum mismatch for item 'w' in {loc.file!r} of ")


def test_sweep_keeps_what_the_manifest_names_and_drops_the_rest(tmp_path):
    ckpt = _save(CheckpointRoot(str(tmp_path)), 1)
    named = set(ckpt.manifest().files)
    with ckpt.store.open_write("data/9-0.stale.bin") as f:
        f.write(b"old")
    (tmp_path / step_dir(1) / "manifest.json.tmp-abc").write_bytes(b"{")
    assert ckpt.data_files() == named | {"data/9-0.stale.bin"}
    ckpt.sweep(keep=named)
    assert ckpt.data_files() == named
    assert sorted(ckpt.store.listdir("")) == [".metadata", "data", "manifest.json"]


def test_a_manifest_is_decoded_once_for_every_copy_with_the_same_bytes(tmp_path):
    # A load looks at one manifest through several copies (the agreement, each
    # level of a restore, the reader): the same bytes give the same decoded object,
    # a re-saved checkpoint (other bytes) a new one, and a broken manifest raises
    # every time, naming the copy it was read from.
    from dcp_multilevel.checkpoint import decoded_manifest
    from dcp_multilevel.errors import ManifestError

    dcp.save({"a": torch.arange(10.0)}, storage_writer=MultiLevelWriter(str(tmp_path / "x")))
    raw = (tmp_path / "x" / MANIFEST_NAME).read_bytes()
    one = StoredCheckpoint.at(str(tmp_path / "x")).manifest()
    other = StoredCheckpoint.at(str(tmp_path / "y"), manifest_bytes=bytes(raw)).manifest()
    assert other is one and decoded_manifest(raw, "z") is one
    writer = MultiLevelWriter(str(tmp_path / "x"), overwrite=True)
    dcp.save({"a": torch.arange(10.0)}, storage_writer=writer)
    again = StoredCheckpoint.at(str(tmp_path / "x")).manifest()
    assert again is not one and again.save_id != one.save_id
    for where in ("first", "second"):
        with pytest.raises(ManifestError, match=where):
            decoded_manifest(raw[:-5], where)
