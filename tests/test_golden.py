"""Checkpoints written by earlier releases (tests/golden/) load bit-exactly, every run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_bit_equal
from golden_state import golden_delta_states, golden_state

from dcp_multilevel import ManifestDigestError, MultiLevelReader
from dcp_multilevel.codecs import CODECS
from dcp_multilevel.format import decode_manifest, frames

GOLDEN = Path(__file__).parent / "golden"
#: ``v<N>-<codec>``: state version N, written by the release that wrote that codec version.
CHECKPOINTS = sorted(
    p.name for p in GOLDEN.iterdir() if p.name.startswith("v") and (p / "manifest.json").exists()
)
#: Every golden checkpoint written before manifests carried a digest.
UNSEALED = [*CHECKPOINTS, "fmt2-delta/step-0", "fmt2-delta/step-1"]


def _blank(state):
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_blank(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def test_every_codec_version_has_a_golden_checkpoint():
    descriptors = set()
    for name in CHECKPOINTS:
        manifest = json.loads((GOLDEN / name / "manifest.json").read_text())
        descriptors |= {t for item in manifest["items"] for t in item["transforms"]}
    # Every version a built-in codec reads was written once, by a release that wrote it.
    for name in ("dcp_multilevel.zstd", "dcp_multilevel.bytegroup"):
        cls = CODECS.get(name)
        for version in cls.read_versions or {cls.version}:
            assert f"{name}/{version}" in descriptors
    assert "v1-raw" in CHECKPOINTS


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
            if rec.method == frames.METHOD_CODED:
                payload = data[pos : pos + rec.stored_len]
                methods |= {payload[1 + 5 * p] for p in range(payload[0])}
            pos += rec.stored_len
    return methods


def test_the_bytegroup_3_golden_holds_every_plane_method():
    # Raw, zstd and both splits: what a v3 reader must decode forever.
    assert _plane_methods(GOLDEN / "v3-bytegroup") == {0, 1, 2, 3}


def test_the_bytegroup_4_golden_holds_sparse_planes():
    # Plane method 4 (a bitmap and the non-zero bytes), beside the older ones.
    assert _plane_methods(GOLDEN / "v4-bytegroup") >= {0, 1, 4}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_golden_checkpoint_loads_bit_exact(name):
    expected = golden_state(int(name.split("-")[0].removeprefix("v")))
    loaded = _blank(expected)
    dcp.load(loaded, storage_reader=MultiLevelReader(GOLDEN / name))
    for key, value in expected["model"].items():
        assert_bit_equal(loaded["model"][key], value, f"{name}: model.{key}")
    assert loaded["step"] == 42
    assert loaded["info"] == expected["info"]


def test_golden_delta_checkpoint_loads_bit_exact():
    """Format version 2: a delta checkpoint and its reference, as first written."""
    root = GOLDEN / "fmt2-delta"
    manifest = json.loads((root / "step-1" / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert {i["fqn"] for i in manifest["items"] if "ref" in i} >= {"model.w", "model.sq"}
    for step, expected in enumerate(golden_delta_states()):
        loaded = _blank(expected)
        dcp.load(loaded, storage_reader=MultiLevelReader(root / f"step-{step}"))
        for key, value in expected["model"].items():
            assert_bit_equal(loaded["model"][key], value, f"fmt2-delta step {step}: {key}")
        assert loaded["step"] == expected["step"]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("dcp_multilevel")]


@pytest.mark.parametrize("name", UNSEALED)
def test_golden_manifests_without_a_digest_load_with_a_warning(name, caplog):
    """Written before manifests carried a digest: read unchecked, and the log says so."""
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")
    raw = (GOLDEN / name / "manifest.json").read_bytes()
    assert b'"digest"' not in raw
    manifest = decode_manifest(raw, checkpoint=f"file://{GOLDEN / name}")
    assert manifest.digest is None
    assert _warnings(caplog) == [
        f"the manifest of checkpoint file://{GOLDEN / name} has no digest (written by "
        f"dcp_multilevel {manifest.plugin_version}, before manifests carried one): it is read "
        "unchecked, so a change to it would go unnoticed. Save the state again to have a "
        "checked manifest."
    ]


def test_golden_manifest_with_a_digest_is_checked_and_loads_bit_exact(caplog):
    """A manifest sealed by its digest, as first written: the digest keeps verifying."""
    root = GOLDEN / "manifest-digest"
    raw = (root / "manifest.json").read_bytes()
    assert decode_manifest(raw).digest == json.loads(raw)["digest"]
    caplog.set_level(logging.WARNING, logger="dcp_multilevel")
    expected = golden_state(4)
    loaded = _blank(expected)
    dcp.load(loaded, storage_reader=MultiLevelReader(root))
    for key, value in expected["model"].items():
        assert_bit_equal(loaded["model"][key], value, f"manifest-digest: model.{key}")
    assert loaded["step"] == 42 and loaded["info"] == expected["info"]
    assert _warnings(caplog) == []
    damaged = bytearray(raw)
    damaged[raw.index(b'"float32"') + 1] = ord("i")  # "float32" -> "iloat32": same length
    with pytest.raises(ManifestDigestError):
        decode_manifest(bytes(damaged))
