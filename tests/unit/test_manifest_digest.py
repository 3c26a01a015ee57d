"""The manifest's digest of its own bytes: any edit or flipped byte of a manifest is refused,
at every place that reads one (decode, load and its fallback, the manager, a drain's
source, the command-line tool, convert), and so is a manifest without a digest."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_roundtrip import assert_state_equal, zeros_like_state
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import (
    CheckpointManager,
    CheckpointNotFoundError,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.cli import main
from dcp_multilevel.convert import convert
from dcp_multilevel.errors import ManifestDigestError, ManifestError
from dcp_multilevel.format import checksum_of, decode_manifest, seal_manifest
from dcp_multilevel.levels import DrainJob, driver_for, run_one

WHAT_TO_DO = (
    "The checkpoint's manifest was modified or damaged after it was written; load the "
    "checkpoint from another level's copy, or an earlier checkpoint."
)


def make_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(16, 8, generator=g),
        "h": torch.randn(8, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10),
        "meta": {"step": 7, "name": "run é"},
    }


def saved(path: Path) -> Path:
    dcp.save(make_state(), storage_writer=MultiLevelWriter(path, sync_files=False))
    return path


@pytest.fixture(scope="module")
def real_manifest(tmp_path_factory) -> bytes:
    """The manifest of a real small save: tensors of three dtypes and a bytes item."""
    return (saved(tmp_path_factory.mktemp("m") / "c") / "manifest.json").read_bytes()


def _mismatch(path: str, edited: bytes) -> str:
    """The message for ``edited`` (a manifest whose bytes before its digest changed)."""
    recorded = json.loads(edited)["digest"]
    actual = checksum_of(edited[: edited.rindex(b'"xxh3_64:') + 1])
    return (
        f"manifest {path} does not match its digest: it records {recorded}, its bytes "
        f"hash to {actual}. {WHAT_TO_DO}"
    )


def _float32_to_int32(path: Path) -> bytes:
    """Edit the manifest at ``path``: its float32 tensor becomes int32 (same width)."""
    raw = (path / "manifest.json").read_bytes()
    edited = raw.replace(b'"dtype":"float32"', b'"dtype":"int32"')
    assert edited != raw
    (path / "manifest.json").write_bytes(edited)
    return edited


# --------------------------------------------------------------------------- the digest


def test_a_written_manifest_ends_with_the_digest_of_its_bytes(real_manifest):
    head, sep, tail = real_manifest.rpartition(b',"digest":"')
    assert sep and tail.endswith(b'"}') and len(tail) == len("xxh3_64:") + 16 + 2
    assert tail[:-2].decode() == checksum_of(head + sep)
    assert decode_manifest(real_manifest).digest == tail[:-2].decode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_single_byte_change_is_refused(real_manifest, data):
    at = data.draw(st.integers(0, len(real_manifest) - 1), label="offset")
    value = data.draw(st.integers(0, 255).filter(lambda v: v != real_manifest[at]), label="byte")
    damaged = bytearray(real_manifest)
    damaged[at] = value
    # pytest.raises lets any other exception (JSONDecodeError, UnicodeError, KeyError) through.
    with pytest.raises(ManifestError) as info:
        decode_manifest(bytes(damaged), checkpoint="file:///x/c")
    if at < real_manifest.rindex(b',"digest":"'):  # hashed, and the digest field intact
        assert isinstance(info.value, ManifestDigestError)
    assert info.value.checkpoint == "file:///x/c"


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda doc: json.dumps(json.loads(doc), indent=1).encode(), id="indented"),
        pytest.param(
            lambda doc: json.dumps(
                dict(reversed(json.loads(doc).items())), separators=(",", ":")
            ).encode(),
            id="keys_reordered",
        ),
        pytest.param(lambda doc: doc + b"\n", id="newline_appended"),
        pytest.param(lambda doc: doc.replace(b'{"format"', b'{ "format"', 1), id="space_inside"),
    ],
)
def test_whitespace_and_key_order_edits_are_refused(real_manifest, edit):
    # The same document to a JSON parser: only the digest tells them apart.
    assert json.loads(edit(real_manifest)) == json.loads(real_manifest)
    with pytest.raises(ManifestDigestError):
        decode_manifest(edit(real_manifest), checkpoint="ck")


def test_a_damaged_digest_field_is_refused(real_manifest):
    renamed = real_manifest.replace(b',"digest":"', b',"digesu":"')
    with pytest.raises(ManifestDigestError) as info:
        decode_manifest(renamed, checkpoint="s3://b/run/step-3")
    assert str(info.value) == (
        "manifest s3://b/run/step-3/manifest.json has no digest: every manifest "
        'dcp_multilevel writes ends with ,"digest":"xxh3_64:<16 hex digits>"}. ' + WHAT_TO_DO
    )
    not_hex = real_manifest[:-3] + b'g"}'
    with pytest.raises(ManifestDigestError) as info:
        decode_manifest(not_hex, checkpoint="s3://b/run/step-3")
    assert str(info.value) == (
        "manifest s3://b/run/step-3/manifest.json has a malformed digest: the field 'digest' "
        'must be the file\'s last bytes, ,"digest":"xxh3_64:<16 hex digits>"}. ' + WHAT_TO_DO
    )


def test_seal_manifest_reseals_an_edited_document(real_manifest):
    doc = json.loads(real_manifest)
    assert seal_manifest(doc) == real_manifest  # what the writer wrote, digest and all
    doc["extra"] = {"note": 1}
    assert decode_manifest(seal_manifest(doc)).extra == {"note": 1}


# --------------------------------------------------------------------------- no digest


def test_a_manifest_without_a_digest_is_refused(tmp_path):
    path = saved(tmp_path / "c")
    doc = json.loads((path / "manifest.json").read_text())
    del doc["digest"], doc["health"]
    (path / "manifest.json").write_text(json.dumps(doc, separators=(",", ":")))
    with pytest.raises(ManifestDigestError) as info:
        MultiLevelReader(path).read_metadata()
    assert str(info.value) == (
        f"manifest file://{path}/manifest.json has no digest: every manifest dcp_multilevel "
        'writes ends with ,"digest":"xxh3_64:<16 hex digits>"}. ' + WHAT_TO_DO
    )
    assert info.value.checkpoint == f"file://{path}"
    with pytest.raises(CheckpointException, match="has no digest"):
        dcp.load(zeros_like_state(make_state()), storage_reader=MultiLevelReader(path))


def test_a_new_manifest_loads_without_a_warning(tmp_path, caplog):
    path = saved(tmp_path / "c")
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")
    dcp.load(zeros_like_state(make_state()), storage_reader=MultiLevelReader(path))
    assert not [r for r in caplog.records if r.name.startswith("dcp_multilevel")]


# --------------------------------------------------------------------------- every reader


def test_float32_edited_to_int32_is_refused_by_the_reader(tmp_path):
    path = saved(tmp_path / "c")
    edited = _float32_to_int32(path)
    with pytest.raises(ManifestDigestError) as info:
        MultiLevelReader(path).read_metadata()
    assert str(info.value) == _mismatch(f"file://{path}/manifest.json", edited)
    assert info.value.checkpoint == f"file://{path}"
    with pytest.raises(CheckpointException, match="does not match its digest"):
        dcp.load(zeros_like_state(make_state()), storage_reader=MultiLevelReader(path))


def test_an_edited_manifest_sends_the_load_to_the_next_copy(tmp_path, caplog):
    primary = saved(tmp_path / "nvme" / "c")
    fallback = tmp_path / "remote" / "c"
    shutil.copytree(primary, fallback)
    edited = _float32_to_int32(primary)
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")
    reader = MultiLevelReader(primary, fallbacks=[fallback])
    loaded = zeros_like_state(make_state())
    dcp.load(loaded, storage_reader=reader)
    assert_state_equal(loaded, make_state())
    assert reader.metadata_source == f"file://{fallback}"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"dcp_multilevel: cannot use the copy at file://{primary} "
        f"({_mismatch(f'file://{primary}/manifest.json', edited)}); reading the checkpoint "
        f"from file://{fallback}"
    ]


def test_load_latest_passes_over_an_edited_first_level_manifest_for_the_next_copy(tmp_path, caplog):
    # The first level's copy is damaged: the step loads, bit-exact, from the
    # level above, and the log names the file passed over. Never what the edited
    # manifest describes.
    levels = [Level(str(tmp_path / "l1")), Level(str(tmp_path / "l2"))]
    mgr = CheckpointManager(levels)
    mgr.save(make_state(), step=4)
    mgr.close()
    step = tmp_path / "l1" / "step-4"
    edited = _float32_to_int32(step)
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")
    mgr = CheckpointManager(levels)
    out = zeros_like_state(make_state())
    assert mgr.load_latest(out) == 4
    mgr.close()
    assert_state_equal(out, make_state())
    passed_over = f"dcp_multilevel: {_mismatch(f'file://{step}/manifest.json', edited)}"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("dcp_multilevel")] == [
        f"{passed_over} Passing over this copy of step 4."
    ]


def test_load_latest_with_no_other_copy_refuses_an_edited_manifest_naming_it(tmp_path):
    # As for a manifest that does not decode at all: no step is loaded, and the
    # error says which file is damaged.
    levels = [Level(str(tmp_path / "l1"))]
    mgr = CheckpointManager(levels)
    mgr.save(make_state(), step=4)
    mgr.close()
    step = tmp_path / "l1" / "step-4"
    edited = _float32_to_int32(step)
    mgr = CheckpointManager(levels)
    with pytest.raises(CheckpointNotFoundError) as info:
        mgr.load_latest(zeros_like_state(make_state()))
    assert f"({_mismatch(f'file://{step}/manifest.json', edited)}; step 4: some rank " in str(
        info.value
    )
    (step / "manifest.json").write_text("[]")
    with pytest.raises(CheckpointNotFoundError, match="the top level must be an object"):
        mgr.load_latest(zeros_like_state(make_state()))
    mgr.close()


def test_a_drain_refuses_a_source_whose_manifest_was_edited(tmp_path):
    source = saved(tmp_path / "l1" / "step-1")
    edited = _float32_to_int32(source)
    target = driver_for(Level(str(tmp_path / "l2"), codec="zstd"))
    job = DrainJob(1, StoredCheckpoint.at(source), target, "test-digest", time.time())
    with pytest.raises(ManifestDigestError) as info:
        run_one(job, timeout_s=60)
    assert str(info.value) == _mismatch(f"file://{source}/manifest.json", edited)
    assert not (tmp_path / "l2" / "step-1" / "manifest.json").exists()


def test_convert_refuses_a_checkpoint_whose_manifest_was_edited(tmp_path):
    path = saved(tmp_path / "c")
    edited = _float32_to_int32(path)
    with pytest.raises(ManifestDigestError) as info:
        convert(path, tmp_path / "out.pt", to="torch")
    assert str(info.value) == _mismatch(f"file://{path}/manifest.json", edited)
    assert not (tmp_path / "out.pt").exists()


def _run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_cli_verify_inspect_and_ls_report_an_edited_manifest(tmp_path):
    root = tmp_path / "run"
    saved(root / "step-1")
    path = saved(root / "step-2")
    edited = _float32_to_int32(path)
    message = _mismatch(f"file://{path}/manifest.json", edited)
    for command in ("verify", "inspect"):
        result = _run(command, path)
        assert (result.exit_code, result.stdout) == (1, ""), command
        assert result.stderr == f"error: {message}\n", command
    listing = json.loads(_run("ls", root, "--json").stdout)["roots"][0]["checkpoints"]
    assert [(c["step"], c["complete"], c["error"]) for c in listing] == [
        (1, True, None),
        (2, False, message),
    ]
    assert "unreadable: manifest" in _run("ls", root).stdout
    intact = json.loads(_run("inspect", root / "step-1", "--json").stdout)
    manifest = json.loads((root / "step-1" / "manifest.json").read_text())
    assert intact["manifest_digest"] == manifest["digest"]
