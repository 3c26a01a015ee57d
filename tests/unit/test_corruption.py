"""Damaged checkpoints fail closed with errors naming checkpoint, file and item."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from conftest import rank_errors
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import CorruptCheckpointError, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.checkpoint.verify import verify_checkpoint
from dcp_multilevel.errors import ChecksumMismatchError, TruncatedDataError, UnsafeObjectError
from dcp_multilevel.format import seal_manifest


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    state = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, 8), "obj": {"k": 1}}
    dcp.save(state, storage_writer=MultiLevelWriter(path))
    manifest = json.loads((path / "manifest.json").read_text())
    return path, state, manifest


def _target():
    return {"a": torch.zeros(64), "b": torch.zeros(8, 8), "obj": {"k": 0}}


def _load_error(path, target=None) -> BaseException:
    with pytest.raises(CheckpointException) as info:
        dcp.load(target or _target(), storage_reader=MultiLevelReader(path))
    (err,) = rank_errors(info.value)
    return err


def _item(manifest, fqn):
    return next(i for i in manifest["items"] if i["fqn"] == fqn)


@pytest.mark.parametrize("destination", ["direct", "via_scratch_buffer"])
def test_one_flipped_byte_is_caught_and_named(ckpt, destination):
    path, _, manifest = ckpt
    item = _item(manifest, "b")
    data_file = path / item["file"]
    raw = bytearray(data_file.read_bytes())
    raw[item["pos"] + 17] ^= 0x01
    data_file.write_bytes(raw)
    target = _target()
    if destination == "via_scratch_buffer":
        target["b"] = torch.zeros(8, 8).t()  # non-contiguous: read into scratch, then copy
    err = _load_error(path, target)
    assert isinstance(err, ChecksumMismatchError) and isinstance(err, OSError)
    assert str(err).startswith(
        f"checksum mismatch for item 'b' in {item['file']!r} of checkpoint file://{path} "
        f"(bytes {item['pos']}..{item['pos'] + 256}): stored {item['checksum']}, read xxh3_64:"
    )
    assert str(err).endswith("The data is corrupt; load from another copy.")
    assert (err.checkpoint, err.file, err.fqn) == (f"file://{path}", item["file"], "b")
    if destination == "via_scratch_buffer":
        assert torch.count_nonzero(target["b"]) == 0  # corrupt bytes never reached it


def test_truncated_data_file(ckpt):
    path, _, manifest = ckpt
    (name, size), *_ = manifest["files"].items()
    os.truncate(path / name, size - 3)
    err = _load_error(path)
    assert isinstance(err, TruncatedDataError)
    assert str(err) == (
        f"data file {name!r} of checkpoint file://{path} is {size - 3} bytes, the manifest "
        f"says {size}; the checkpoint is damaged"
    )


def test_missing_data_file(ckpt):
    path, _, manifest = ckpt
    (name, _), *_ = manifest["files"].items()
    (path / name).unlink()
    err = _load_error(path)
    assert isinstance(err, TruncatedDataError) and isinstance(err, CorruptCheckpointError)
    assert str(err).startswith(f"data file {name!r} of checkpoint file://{path} is missing")


def test_manifest_claiming_more_bytes_than_the_file_has(ckpt):
    path, _, manifest = ckpt
    (name, size), *_ = manifest["files"].items()
    manifest["files"][name] = size + 300
    _item(manifest, "a")["pos"] = size  # inside the claimed size: passes validation
    (path / "manifest.json").write_bytes(seal_manifest(manifest))
    err = _load_error(path)
    assert isinstance(err, TruncatedDataError)
    assert f"is {size} bytes, the manifest says {size + 300}" in str(err)


class _Payload:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_object_is_refused_and_never_executed(ckpt, tmp_path):
    path, _, manifest = ckpt
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Payload(str(marker)), buf)
    evil = buf.getvalue()
    # Append the payload as a new data file and point the bytes item at it, with a
    # valid checksum: only the weights_only check stands between it and execution.
    item = _item(manifest, "obj.k")
    evil_file = item["file"].rsplit("/", 1)[0] + "/9-0.bin"
    (path / evil_file).write_bytes(evil)
    manifest["files"][evil_file] = len(evil)
    item.update(
        file=evil_file,
        pos=0,
        length=len(evil),
        raw_length=len(evil),
        checksum=f"xxh3_64:{xxhash.xxh3_64_hexdigest(evil)}",
    )
    (path / "manifest.json").write_bytes(seal_manifest(manifest))

    err = _load_error(path)
    assert isinstance(err, UnsafeObjectError)
    assert str(err).startswith(
        f"object 'obj.k' in checkpoint file://{path} cannot be loaded with weights_only=True: "
        "Unsupported global: GLOBAL io.open was not an allowed global by default."
    )
    assert str(err).endswith(
        "If you trust this checkpoint and the type is yours, allow it with "
        "torch.serialization.add_safe_globals([...])."
    )
    assert not marker.exists()


def test_verify_names_each_item_of_a_missing_data_file(tmp_path):
    """Every item stored in a missing file is a problem, each named as itself."""
    path = tmp_path / "ckpt"
    dcp.save({"a": torch.ones(8), "b": torch.zeros(4)}, storage_writer=MultiLevelWriter(path))
    (data,) = (path / "data").glob("*.bin")
    data.unlink()
    ckpt = StoredCheckpoint.at(str(path))
    result = verify_checkpoint(ckpt)
    assert [(p.fqn, p.error) for p in result.problems] == [
        (fqn, "TruncatedDataError") for fqn in ("a", "b")
    ]
    for p in result.problems:
        assert p.message == (
            f"data file 'data/{data.name}' of checkpoint {ckpt.url} is missing "
            f"(needed for {p.fqn!r}); the checkpoint is damaged"
        )
