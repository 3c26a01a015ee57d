"""Loading one checkpoint from several copies: ``MultiLevelReader(path, fallbacks=[...])``.

Fallback copies are made the way CheckpointManager makes them: one save (raw,
two files per rank), drained to other levels with other codecs (byte grouping,
zstd), so the copies share one save_id and differ in encoding, file names and
offsets. Damage to one copy is repaired, item
by item, from the next; what cannot be repaired fails closed, naming every
copy tried.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from _dist import run_ranks
from conftest import rank_errors
from test_roundtrip import assert_state_equal, zeros_like_state
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.errors import ChecksumMismatchError, ManifestError
from dcp_multilevel.format import frames
from dcp_multilevel.levels import DrainJob, driver_for, run_one

if TYPE_CHECKING:
    from _s3 import S3Server

pytest_plugins = ["_s3"]

MISSING_MANIFEST = (
    "manifest.json is missing (a save that did not finish leaves none). Check the path, "
    "or load an earlier checkpoint."
)


def make_state(rows: int = 64) -> dict[str, Any]:
    """Floats that byte grouping compresses, integers, and two non-tensor items."""
    g = torch.Generator().manual_seed(5)
    return {
        "layer": {"w": torch.randn(rows, 64, generator=g), "b": torch.randn(64, generator=g)},
        "emb": torch.randn(256, 32, generator=g).to(torch.bfloat16),
        "ids": torch.arange(3000),
        "meta": {"step": 100, "tags": ["a", "b"]},
    }


@dataclass(frozen=True)
class Copy:
    """One copy of the checkpoint on local disk."""

    path: Path

    @property
    def url(self) -> str:
        return f"file://{self.path}"

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / "manifest.json").read_text())

    def item(self, fqn: str) -> dict[str, Any]:
        return next(i for i in self.manifest()["items"] if i["fqn"] == fqn)

    def n_items(self) -> int:
        return len(self.manifest()["items"])

    def corrupt(self, fqn: str) -> str:
        """Flip one stored byte of ``fqn``; return the reason the reader will give."""
        item = self.item(fqn)
        data_file = self.path / item["file"]
        raw = bytearray(data_file.read_bytes())
        start, end = item["pos"], item["pos"] + item["length"]
        if item["transforms"]:
            raw[start + frames.HEADER.size + frames.CHUNK.size + 3] ^= 0x01  # chunk 0's payload
            data_file.write_bytes(raw)
            return (
                f"compressed item {fqn!r} in {item['file']!r} of checkpoint {self.url} is "
                "corrupt: chunk 0: its checksum does not match its bytes. Load from another copy."
            )
        raw[start + 17] ^= 0x01
        data_file.write_bytes(raw)
        return (
            f"checksum mismatch for item {fqn!r} in {item['file']!r} of checkpoint {self.url} "
            f"(bytes {start}..{end}): stored {item['checksum']}, read "
            f"xxh3_64:{xxhash.xxh3_64_hexdigest(bytes(raw[start:end]))}. The data is corrupt; "
            "load from another copy."
        )


def drained(source: Path | str, tier_root: str, codec: str | None, **options: Any) -> None:
    """Copy the step-100 checkpoint at ``source`` to ``<tier_root>/step-100`` (a drain).

    Collective with a process group: every rank calls it with the same arguments.
    """
    target = driver_for(Level(tier_root, codec=codec, storage_options=options))
    job = DrainJob(100, StoredCheckpoint.at(source), target, f"test-{tier_root}", time.time())
    assert run_one(job, timeout_s=60).committed


def save_copies(root: Path, state: dict[str, Any], *, packed_first: bool) -> tuple[Copy, Copy]:
    """(primary, fallback): a raw copy written with two files per rank, a bytegroup one."""
    raw, packed = Copy(root / "nvme" / "step-100"), Copy(root / "remote" / "step-100")
    dcp.save(state, storage_writer=MultiLevelWriter(raw.path, thread_count=2))
    drained(raw.path, str(root / "remote"), "bytegroup")
    # The copies really differ in encoding and layout, and are one save.
    assert packed.item("layer.w")["transforms"] and not raw.item("layer.w")["transforms"]
    assert set(raw.manifest()["files"]).isdisjoint(packed.manifest()["files"])
    assert raw.manifest()["save_id"] == packed.manifest()["save_id"]
    return (packed, raw) if packed_first else (raw, packed)


@pytest.fixture(params=["raw_first", "packed_first"])
def copies(request, tmp_path) -> tuple[Copy, Copy]:
    return save_copies(tmp_path, make_state(), packed_first=request.param == "packed_first")


@pytest.fixture
def raw_then_packed(tmp_path) -> tuple[Copy, Copy]:
    return save_copies(tmp_path, make_state(), packed_first=False)


@pytest.fixture
def logged(caplog) -> Callable[[], list[str]]:
    """``logged()``: the WARNING messages dcp_multilevel logged so far, in order."""
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")

    def warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("dcp_multilevel")
        ]

    return warnings


def load(primary: Copy, fallback: Copy, target=None, **options) -> MultiLevelReader:
    """dcp.load through a reader with one fallback; checks the result bit for bit."""
    reader = MultiLevelReader(primary.path, fallbacks=[fallback.path], **options)
    loaded = target if target is not None else zeros_like_state(make_state())
    dcp.load(loaded, storage_reader=reader)
    assert_state_equal(loaded, make_state())
    return reader


def load_error(primary: Copy, fallback: Copy, target=None) -> BaseException:
    reader = MultiLevelReader(primary.path, fallbacks=[fallback.path])
    with pytest.raises(CheckpointException) as info:
        dcp.load(target or zeros_like_state(make_state()), storage_reader=reader)
    (err,) = rank_errors(info.value)
    return err


# --------------------------------------------------------------------------- repair


def test_intact_primary_serves_everything_and_the_fallback_is_never_read(copies, logged):
    primary, fallback = copies
    shutil.rmtree(fallback.path)  # would fail the load if it were touched
    reader = load(primary, fallback)
    assert reader.last_load_sources == {primary.url: primary.n_items()}
    assert reader.metadata_source == primary.url
    assert logged() == []


def test_whole_primary_deleted_loads_from_the_fallback(copies, logged):
    primary, fallback = copies
    shutil.rmtree(primary.path.parent)  # the node was replaced
    reader = load(primary, fallback)
    assert reader.last_load_sources == {fallback.url: fallback.n_items()}
    assert reader.metadata_source == fallback.url
    assert logged() == [
        f"dcp_multilevel: cannot use the copy at {primary.url} (no committed checkpoint at "
        f"{primary.url}: {MISSING_MANIFEST}); reading the checkpoint from {fallback.url}"
    ]


@pytest.mark.parametrize("fqn", ["layer.w", "meta.tags"])
@pytest.mark.parametrize("destination", ["direct", "via_scratch_buffer"])
@pytest.mark.parametrize("thread_count", [1, 3])
def test_one_corrupt_item_is_read_from_the_fallback(copies, logged, fqn, destination, thread_count):
    primary, fallback = copies
    reason = primary.corrupt(fqn)
    target = zeros_like_state(make_state())
    if destination == "via_scratch_buffer":
        target["layer"]["w"] = torch.zeros(64, 64).t()  # non-contiguous: read, then copied
    reader = load(primary, fallback, target, thread_count=thread_count)
    n = primary.n_items()
    assert reader.last_load_sources == {primary.url: n - 1, fallback.url: 1}
    assert logged() == [
        f"dcp_multilevel: item {fqn!r} in {primary.item(fqn)['file']} of {primary.url} is "
        f"corrupt ({reason}); reading it from {fallback.url}"
    ]


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_primary_data_file_is_read_from_the_fallback(raw_then_packed, logged, damage):
    primary, fallback = raw_then_packed
    name, size = next(iter(primary.manifest()["files"].items()))
    in_file = sorted(
        (i for i in primary.manifest()["items"] if i["file"] == name), key=lambda i: i["pos"]
    )
    assert 0 < len(in_file) < primary.n_items()  # the other file still serves its items
    if damage == "truncated":
        with open(primary.path / name, "r+b") as f:
            f.truncate(size - 3)
        reason = (
            f"data file {name!r} of checkpoint {primary.url} is {size - 3} bytes, the "
            f"manifest says {size}; the checkpoint is damaged"
        )
    else:
        (primary.path / name).unlink()
        reason = (
            f"data file {name!r} of checkpoint {primary.url} is missing (needed for "
            f"{in_file[0]['fqn']!r}); the checkpoint is damaged"
        )
    reader = load(primary, fallback)
    assert reader.last_load_sources == {
        primary.url: primary.n_items() - len(in_file),
        fallback.url: len(in_file),
    }
    assert logged() == [
        f"dcp_multilevel: data file {name} of {primary.url} cannot be read ({reason}); "
        f"reading its {len(in_file)} item(s) from {fallback.url}"
    ]


def test_invalid_primary_manifest_takes_metadata_and_data_from_the_fallback(copies, logged):
    primary, fallback = copies
    (primary.path / "manifest.json").write_text('{"format": "other"}')
    reader = load(primary, fallback)
    assert reader.metadata_source == fallback.url
    assert reader.last_load_sources == {fallback.url: fallback.n_items()}
    assert logged() == [
        f"dcp_multilevel: cannot use the copy at {primary.url} (manifest of checkpoint "
        f"{primary.url!r} is invalid: field 'format' is 'other', expected 'dcp_multilevel'. "
        "The checkpoint is damaged or was not written by dcp_multilevel; load it from "
        f"another level or copy.); reading the checkpoint from {fallback.url}"
    ]


def test_each_item_goes_down_the_chain_until_a_copy_has_it_intact(tmp_path, logged):
    primary, second = save_copies(tmp_path, make_state(), packed_first=False)
    third = Copy(tmp_path / "archive" / "step-100")
    drained(primary.path, str(tmp_path / "archive"), "zstd")
    primary.corrupt("layer.w")
    primary.corrupt("emb")
    second.corrupt("emb")
    reader = MultiLevelReader(primary.path, fallbacks=[second.path, third.path])
    loaded = zeros_like_state(make_state())
    dcp.load(loaded, storage_reader=reader)
    assert_state_equal(loaded, make_state())
    n = primary.n_items()
    assert reader.last_load_sources == {primary.url: n - 2, second.url: 1, third.url: 1}
    assert len(logged()) == 3


# --------------------------------------------------------------------------- fail closed


def test_item_corrupt_on_every_copy_fails_naming_every_copy(copies, logged):
    primary, fallback = copies
    reason_primary = primary.corrupt("layer.w")
    reason_fallback = fallback.corrupt("layer.w")
    target = zeros_like_state(make_state())
    target["layer"]["w"] = torch.zeros(64, 64).t()  # via a scratch buffer
    err = load_error(primary, fallback, target)
    expected_type = (
        CorruptCheckpointError
        if fallback.item("layer.w")["transforms"]
        else (ChecksumMismatchError)
    )
    assert type(err) is expected_type  # the last copy's error
    assert str(err) == (
        f"item 'layer.w' cannot be read from any copy of checkpoint {primary.url}; load an "
        f"earlier checkpoint. Tried 2 locations, in order: (1) {primary.url}: "
        f"{reason_primary}; (2) {fallback.url}: {reason_fallback}"
    )
    assert (err.checkpoint, err.file, err.fqn) == (
        fallback.url,
        fallback.item("layer.w")["file"],
        "layer.w",
    )
    assert torch.count_nonzero(target["layer"]["w"]) == 0  # no unverified byte reached it
    assert len(logged()) == 1  # primary -> fallback; the failure itself is the error


def test_fallback_of_another_checkpoint_is_not_used(tmp_path, logged):
    primary = Copy(tmp_path / "nvme" / "step-100")
    other = Copy(tmp_path / "remote" / "step-96")
    dcp.save(make_state(), storage_writer=MultiLevelWriter(primary.path))
    dcp.save(make_state(rows=32), storage_writer=MultiLevelWriter(other.path, codec="bytegroup"))
    reason = primary.corrupt("layer.w")
    err = load_error(primary, other)
    assert isinstance(err, ChecksumMismatchError)  # the last copy that had the item
    assert str(err) == (
        f"item 'layer.w' cannot be read from any copy of checkpoint {primary.url}; load an "
        f"earlier checkpoint. Tried 2 locations, in order: (1) {primary.url}: {reason}; "
        f"(2) {other.url}: the copy at {other.url} holds another checkpoint than the copy "
        f"in use ({primary.url}) and is not used: their DCP metadata differ (it stores "
        "'layer.w' as a float32 tensor of size [32, 64] (chunks [[32, 64]]), the copy in use "
        "as a float32 tensor of size [64, 64] (chunks [[64, 64]])). Check that the fallbacks "
        "name copies of the same checkpoint "
        "(same step)."
    )
    assert logged()[-1].startswith(
        f"dcp_multilevel: item 'layer.w' in {primary.item('layer.w')['file']} of "
        f"{primary.url} is corrupt ("
    )


def test_fallback_of_another_save_of_the_same_step_is_not_used(tmp_path, logged):
    primary, other = Copy(tmp_path / "nvme" / "step-100"), Copy(tmp_path / "remote" / "step-100")
    dcp.save(make_state(), storage_writer=MultiLevelWriter(primary.path))
    # Same step, same shapes, another save (e.g. the step saved again by another run).
    dcp.save(make_state(), storage_writer=MultiLevelWriter(other.path, codec="bytegroup"))
    archive = Copy(tmp_path / "archive" / "step-100")
    drained(primary.path, str(tmp_path / "archive"), "zstd")
    ours, theirs = primary.manifest()["save_id"], other.manifest()["save_id"]
    assert ours != theirs
    reason = primary.corrupt("layer.w")
    err = load_error(primary, other)
    assert isinstance(err, ChecksumMismatchError)  # the last copy that had the item
    refusal = (
        f"the copy at {other.url} holds another save than the copy in use ({primary.url}) "
        f"and is not used: its save_id is {theirs!r}, the copy in use has {ours!r}. Only "
        "copies drained from the same save can stand in for each other."
    )
    assert str(err) == (
        f"item 'layer.w' cannot be read from any copy of checkpoint {primary.url}; load an "
        f"earlier checkpoint. Tried 2 locations, in order: (1) {primary.url}: {reason}; "
        f"(2) {other.url}: {refusal}"
    )
    # With a copy after it, the refused one is skipped with a log line.
    reader = MultiLevelReader(primary.path, fallbacks=[other.path, archive.path])
    loaded = zeros_like_state(make_state())
    dcp.load(loaded, storage_reader=reader)
    assert_state_equal(loaded, make_state())
    assert reader.last_load_sources == {primary.url: primary.n_items() - 1, archive.url: 1}
    assert logged()[-1] == (
        f"dcp_multilevel: cannot use the copy at {other.url} for 1 item(s) ({refusal}); "
        f"reading them from {archive.url}"
    )


def test_no_copy_at_all_is_checkpoint_not_found_listing_every_location(tmp_path, logged):
    a, b = Copy(tmp_path / "a"), Copy(tmp_path / "b")
    reader = MultiLevelReader(a.path, fallbacks=[b.path])
    with pytest.raises(CheckpointNotFoundError) as info:
        reader.read_metadata()
    assert str(info.value) == (
        f"no copy of checkpoint {a.url} exists; check the locations, or load an earlier "
        f"checkpoint. Tried 2 locations, in order: (1) {a.url}: "
        f"no committed checkpoint at {a.url}: {MISSING_MANIFEST}; (2) {b.url}: no committed "
        f"checkpoint at {b.url}: {MISSING_MANIFEST}"
    )
    assert info.value.checkpoint == a.url
    assert logged() == [
        f"dcp_multilevel: cannot use the copy at {a.url} (no committed checkpoint at {a.url}: "
        f"{MISSING_MANIFEST}); reading the checkpoint from {b.url}"
    ]


def test_missing_primary_and_damaged_fallback_is_a_manifest_error(raw_then_packed):
    primary, fallback = raw_then_packed
    shutil.rmtree(primary.path)
    (fallback.path / "manifest.json").write_text("[]")
    with pytest.raises(ManifestError) as info:
        MultiLevelReader(primary.path, fallbacks=[fallback.path]).read_metadata()
    assert str(info.value) == (
        f"no copy of checkpoint {primary.url} can be used; check the locations, or load an "
        "earlier checkpoint. Tried 2 locations, in order: "
        f"(1) {primary.url}: no committed checkpoint at {primary.url}: {MISSING_MANIFEST}; "
        f"(2) {fallback.url}: manifest of checkpoint {fallback.url!r} is invalid: the top "
        "level must be an object. The checkpoint is damaged or was not written by "
        "dcp_multilevel; load it from another level or copy."
    )
    assert info.value.checkpoint == fallback.url


def test_without_fallbacks_errors_are_unchanged(raw_then_packed):
    primary, _ = raw_then_packed
    reason = primary.corrupt("layer.w")
    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like_state(make_state()), storage_reader=MultiLevelReader(primary.path))
    (err,) = rank_errors(info.value)
    assert isinstance(err, ChecksumMismatchError)
    assert str(err) == reason


# --------------------------------------------------------------------------- options


def test_options_are_checked(tmp_path):
    with pytest.raises(ConfigError) as info:
        MultiLevelReader(tmp_path / "a", fallbacks=str(tmp_path / "b"))
    assert str(info.value) == (
        f"fallbacks must be a sequence of locations, got the single location "
        f"{str(tmp_path / 'b')!r}; pass fallbacks=[{str(tmp_path / 'b')!r}]"
    )
    with pytest.raises(ConfigError) as info:
        MultiLevelReader(tmp_path / "a", fallbacks=["b", "c"], fallback_storage_options=[None])
    assert str(info.value) == (
        "fallback_storage_options has 1 entries for 2 fallbacks; give one (a dict or None) "
        "per fallback"
    )


def test_checkpoint_id_may_only_respell_the_primary_when_there_are_fallbacks(
    raw_then_packed, tmp_path
):
    primary, fallback = raw_then_packed
    reader = MultiLevelReader(primary.path, fallbacks=[fallback.path])
    loaded = zeros_like_state(make_state())
    dcp.load(loaded, checkpoint_id=primary.url, storage_reader=reader)  # same place, a URL
    assert_state_equal(loaded, make_state())
    assert reader.fallbacks == (fallback.url,)
    with pytest.raises(ConfigError) as info:
        reader.reset(tmp_path / "elsewhere")
    assert str(info.value) == (
        f"this MultiLevelReader reads checkpoint {primary.url} with fallbacks "
        f"[{fallback.url!r}]; dcp.load(checkpoint_id=...) asked for file://{tmp_path}/"
        "elsewhere, whose copies it does not know. Build a MultiLevelReader for that "
        "checkpoint (with its own fallbacks)."
    )


# --------------------------------------------------------------------------- S3


@pytest.mark.parametrize("damage", ["primary_deleted", "one_item_corrupt"])
def test_fallback_on_s3_compressed(tmp_path, s3_server: S3Server, s3_bucket, logged, damage):
    primary = Copy(tmp_path / "nvme" / "step-100")
    remote = f"s3://{s3_bucket}/run1/step-100"
    options = s3_server.storage_options
    dcp.save(make_state(), storage_writer=MultiLevelWriter(primary.path))
    drained(primary.path, f"s3://{s3_bucket}/run1", "bytegroup", **options)
    if damage == "primary_deleted":
        shutil.rmtree(primary.path)
    else:
        primary.corrupt("emb")
    reader = MultiLevelReader(
        primary.path, fallbacks=[remote], fallback_storage_options=[options], thread_count=2
    )
    loaded = zeros_like_state(make_state())
    dcp.load(loaded, storage_reader=reader)
    assert_state_equal(loaded, make_state())
    n = 6  # layer.w, layer.b, emb, ids, meta.step, meta.tags
    if damage == "primary_deleted":
        assert reader.last_load_sources == {remote: n}
        assert reader.metadata_source == remote
    else:
        assert reader.last_load_sources == {primary.url: n - 1, remote: 1}
        assert logged()[-1].endswith(f"; reading it from {remote}")
    assert len(logged()) == 1


# --------------------------------------------------------------------------- 2 ranks


def _two_ranks_fall_back(rank: int, world_size: int, root: str) -> list[dict[str, int]]:
    primary, fallback = Copy(Path(root) / "nvme" / "step-100"), Copy(Path(root) / "s" / "step-100")
    dcp.save(make_state(), storage_writer=MultiLevelWriter(primary.path))
    drained(primary.path, str(Path(root) / "s"), "bytegroup")  # each rank copies its files
    sources = []
    for damage in ("one_item_corrupt", "primary_deleted"):
        dist.barrier()
        if rank == 0:
            if damage == "one_item_corrupt":
                primary.corrupt("layer.w")
            else:
                shutil.rmtree(primary.path)
        dist.barrier()
        reader = MultiLevelReader(primary.path, fallbacks=[fallback.path])
        loaded = zeros_like_state(make_state())
        dcp.load(loaded, storage_reader=reader)
        assert_state_equal(loaded, make_state())
        sources.append(reader.last_load_sources)
    return sources


@pytest.mark.multiprocess
def test_every_rank_falls_back_on_its_own(tmp_path):
    results = run_ranks(_two_ranks_fall_back, 2, str(tmp_path))
    p_url, f_url = f"file://{tmp_path}/nvme/step-100", f"file://{tmp_path}/s/step-100"
    for corrupt_one, deleted in results:  # every rank loads the whole (replicated) state
        assert corrupt_one == {p_url: 5, f_url: 1}
        assert deleted == {f_url: 6}
