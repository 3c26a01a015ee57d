"""Checkpoints written by releases (tests/golden/) load bit-exactly, every run."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_bit_equal
from golden_state import golden_delta_states, golden_state
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import MultiLevelReader
from dcp_multilevel.codecs import CODECS
from dcp_multilevel.errors import ManifestDigestError, ManifestError
from dcp_multilevel.format import decode_manifest, frames, seal_manifest

GOLDEN = Path(__file__).parents[1] / "golden"
#: Every golden checkpoint holding :func:`golden_state`: ``<release>-<kind>``
#: (``make_golden.py``) and ``manifest-digest``, 0.1.0's bytegroup checkpoint.
CHECKPOINTS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").exists())
#: ``<release>-delta``: a delta checkpoint (``step-1``) and its reference (``step-0``).
DELTAS = sorted(p.name for p in GOLDEN.glob("*-delta"))
#: Every golden manifest.
MANIFESTS = [*CHECKPOINTS, *(f"{name}/step-{step}" for name in DELTAS for step in (0, 1))]


def _blank(state):
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_blank(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("dcp_multilevel")]


def _load(path: Path, expected: dict, caplog) -> None:
    """Load the checkpoint at ``path`` and compare it with ``expected``, bit for bit."""
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")
    loaded = _blank(expected)
    dcp.load(loaded, storage_reader=MultiLevelReader(path))
    for key, value in expected["model"].items():
        assert_bit_equal(loaded["model"][key], value, f"{path.name}: model.{key}")
    assert loaded["step"] == expected["step"]
    assert loaded["info"] == expected["info"]
    assert _warnings(caplog) == []


def test_every_codec_version_has_a_golden_checkpoint():
    descriptors = set()
    for name in MANIFESTS:
        manifest = json.loads((GOLDEN / name / "manifest.json").read_text())
        descriptors |= {t for item in manifest["items"] for t in item["transforms"]}
    # Every version a built-in codec reads was written by a release.
    for name in ("dcp_multilevel.zstd", "dcp_multilevel.bytegroup"):
        cls = CODECS.get(name)
        for version in cls.read_versions or {cls.version}:
            assert f"{name}/{version}" in descriptors
    assert {"0.1.0-raw", "0.1.0-zstd", "manifest-digest"} <= set(CHECKPOINTS)
    assert "0.1.0-delta" in DELTAS


def _plane_methods(checkpoint: Path) -> set[int]:
    """The plane methods of every coded bytegroup chunk in a checkpoint."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    methods = set()
    for item in manifest["items"]:
        if not any(t.startswith("dcp_multilevel.bytegroup/") for t in item["transforms"]):
            continue
        data = (checkpoint / item["file"]).read_bytes()[item["pos"] :][: item["length"]]
        pos = frames.HEADER.size
        while not (rec := frames.unpack_chunk(data[pos : pos + frames.CHUNK.size])).is_terminator:
            pos += frames.CHUNK.size
            if rec.method in (frames.METHOD_CODED, frames.METHOD_DELTA):
                payload = data[pos : pos + rec.stored_len]
                methods |= {payload[1 + 5 * p] for p in range(payload[0])}
            pos += rec.stored_len
    return methods


def test_the_bytegroup_golden_holds_every_plane_method():
    # Raw, zstd, both splits and sparse: what a bytegroup/4 reader must decode.
    assert _plane_methods(GOLDEN / "manifest-digest") == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_golden_checkpoint_loads_bit_exact(name, caplog):
    _load(GOLDEN / name, golden_state(), caplog)


@pytest.mark.parametrize("name", DELTAS)
def test_golden_delta_checkpoint_loads_bit_exact(name, caplog):
    """Format version 2: a delta checkpoint and its reference."""
    root = GOLDEN / name
    manifest = json.loads((root / "step-1" / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert {i["fqn"] for i in manifest["items"] if "ref" in i} >= {"model.w", "model.sq"}
    for step, expected in enumerate(golden_delta_states()):
        _load(root / f"step-{step}", expected, caplog)


@pytest.mark.parametrize("name", MANIFESTS)
def test_golden_manifests_are_sealed_and_checked(name):
    raw = (GOLDEN / name / "manifest.json").read_bytes()
    assert decode_manifest(raw).digest == json.loads(raw)["digest"]
    damaged = bytearray(raw)
    damaged[raw.index(b'"float32"') + 1] = ord("i")  # "float32" -> "iloat32": same length
    with pytest.raises(ManifestDigestError):
        decode_manifest(bytes(damaged))


@pytest.mark.parametrize("version", ["1", "2", "3"])
def test_a_pre_release_bytegroup_version_is_refused(tmp_path, version):
    # Versions before bytegroup/4 were never released: a manifest naming one
    # (sealed, so only the descriptor is wrong) loads nothing.
    path = tmp_path / "c"
    shutil.copytree(GOLDEN / "manifest-digest", path)
    doc = json.loads((path / "manifest.json").read_text())
    for item in doc["items"]:
        item["transforms"] = [t.replace("/4", f"/{version}") for t in item["transforms"]]
    (path / "manifest.json").write_bytes(seal_manifest(doc))
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(golden_state()), storage_reader=MultiLevelReader(path))
    error = info.value.failures[0][0]
    assert isinstance(error, ManifestError)
    assert str(error) == (
        f"item 'model.w' in '{doc['items'][0]['file']}' of checkpoint file://{path} needs "
        f"codec 'dcp_multilevel.bytegroup/{version}': codec 'dcp_multilevel.bytegroup' "
        f"version '{version}' is not readable by the installed codec (version 4); an older "
        "version that this release no longer reads: load it with the release that wrote it "
        "and save it again"
    )
