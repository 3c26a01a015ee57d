"""A restore between nodes prints nothing of torch's into the user's log.

torch warns (once per process, into the log) when it wraps a read-only buffer
as a tensor, which a send over gloo does: the sends of a restore must hand it
writable buffers only, damaged sources (padded streams) included. Real
processes (gloo), real files; each node is a directory.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _damage import flip_byte
from _dist import run_ranks

from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.testing.levels import bit_equal

pytestmark = pytest.mark.multiprocess

#: The start of torch's warning (torch/csrc/utils/tensor_new.cpp).
NOT_WRITABLE = "The given buffer is not writable"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 128, generator=g), "b": torch.randn(999, generator=g).half()}


def _levels(root: str) -> list[Level]:
    return [Level(f"{root}/n{{node}}/l1"), Level(f"partner:{root}/n{{node}}/partner", replicas=2)]


def _save_job(rank: int, world: int, root: str) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(_levels(root), drain_policy="wait")
    for step in (1, 2):
        mgr.save(_state(step), step=step)
    results = mgr.wait()
    mgr.close()
    assert all(r.committed and r.error is None for r in results), results


def _load_job(rank: int, world: int, root: str) -> tuple[int | None, bool, dict, list[str]]:
    """(step loaded, bit-exact, what the restore brought, every warning this rank saw)."""
    os.environ["DCP_ML_NODE"] = str(rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # torch's own warns once per process anyway
        mgr = CheckpointManager(_levels(root))
        state = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        step = mgr.load_latest(state)
        mgr.close()
    received = mgr.last_restore.received if mgr.last_restore else {}
    exact = step is not None and bit_equal(state, _state(step))
    return step, exact, received, [f"{w.category.__name__}: {w.message}" for w in seen]


@pytest.mark.parametrize("source", ["intact", "damaged"])
def test_a_partner_restore_sends_without_torch_warnings(tmp_path, source):
    root = str(tmp_path)
    run_ranks(_save_job, 2, root, timeout=180)
    shutil.rmtree(tmp_path / "n1")  # node 1 is lost with its disk
    if source == "damaged":
        # Node 0's copy of node 1's file: the send finds it damaged half-way and
        # pads the stream to its length; the restore then takes step 1.
        (copy,) = (tmp_path / "n0/partner/step-2/data").glob("1-*")
        flip_byte(Path(copy), copy.stat().st_size // 2, 0x40)
    out = run_ranks(_load_job, 2, root, timeout=180)
    want = 2 if source == "intact" else 1
    assert [o[:2] for o in out] == [(want, True)] * 2, [o[:3] for o in out]
    assert sum(out[1][2].values()) >= 1, out[1][2]  # node 1 got files from node 0
    for rank, (*_, seen) in enumerate(out):
        assert [w for w in seen if NOT_WRITABLE in w] == [], rank
