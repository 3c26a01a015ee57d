"""Checkpoints written by earlier releases (tests/golden/) load bit-exactly, every run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_bit_equal
from golden_state import golden_state

from dcp_multilevel import MultiLevelReader

GOLDEN = Path(__file__).parent / "golden"
CHECKPOINTS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").exists())


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
    assert {
        "dcp_multilevel.zstd/1",
        "dcp_multilevel.bytegroup/1",
        "dcp_multilevel.bytegroup/2",
    } <= descriptors
    assert "v1-raw" in CHECKPOINTS


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_golden_checkpoint_loads_bit_exact(name):
    expected = golden_state()
    loaded = _blank(expected)
    dcp.load(loaded, storage_reader=MultiLevelReader(GOLDEN / name))
    for key, value in expected["model"].items():
        assert_bit_equal(loaded["model"][key], value, f"{name}: model.{key}")
    assert loaded["step"] == 42
    assert loaded["info"] == expected["info"]
