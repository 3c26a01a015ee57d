"""Levels between nodes: partner copies and erasure parity restore a lost node (issue 14).

Real processes (gloo), real files: each simulated node is a directory
(``DCP_ML_NODE`` per process, ``{node}`` in the level paths), and losing a
node is deleting its directory.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dcp_multilevel import CheckpointManager, Level
from tests._dist import run_ranks

pytestmark = pytest.mark.multiprocess


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(256, 256, generator=g),
        "b": torch.randn(4096, generator=g).to(torch.bfloat16),
        "layers": {str(i): torch.randn(64, 128, generator=g) for i in range(6)},
        "step": step,
    }


def _blank() -> dict:
    return {
        "w": torch.zeros(256, 256),
        "b": torch.zeros(4096, dtype=torch.bfloat16),
        "layers": {str(i): torch.zeros(64, 128) for i in range(6)},
        "step": -1,
    }


def _same(a: dict, b: dict) -> bool:
    """Bit-exact equality of two nested state dicts."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
        elif x != y:
            return False
    return True


def _levels(root: str, kind: str, **options) -> list[Level]:
    return [
        Level(f"{root}/n{{node}}/l1", keep=2),
        Level(f"{kind}:{root}/n{{node}}/{kind}", keep=2, **options),
    ]


def _save_job(
    rank: int, world: int, root: str, per_node: int, kind: str, options: dict, steps: list[int]
) -> None:
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    mgr = CheckpointManager(_levels(root, kind, **options), drain_policy="wait")
    for step in steps:
        mgr.save(_state(step), step=step)
    results = mgr.wait()
    mgr.close()
    assert all(r.committed for r in results if r.step == steps[-1]), results


def _load_job(
    rank: int, world: int, root: str, per_node: int, kind: str, options: dict
) -> tuple[int | None, bool, dict]:
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    mgr = CheckpointManager(_levels(root, kind, **options))
    state = _blank()
    step = mgr.load_latest(state)
    mgr.close()
    received = mgr.last_restore.received if mgr.last_restore else {}
    return step, _same(state, _state(step)) if step is not None else False, received


def test_partner_level_restores_a_replaced_node_and_a_shrunk_world(tmp_path):
    root = str(tmp_path)
    opts = {"replicas": 2}
    run_ranks(_save_job, 4, root, 2, "partner", opts, [1, 2], timeout=240)
    # Node 1 holds copies of node 0's files, and its own files (hard links).
    held = sorted(p.name.split("-")[0] for p in (tmp_path / "n1/partner/step-2/data").iterdir())
    assert held == ["0", "1", "2", "3"]
    assert (tmp_path / "n1/partner/step-2/manifest.json").exists()
    shutil.rmtree(tmp_path / "n1")  # node 1 is lost with its disk; a new one replaces it
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, timeout=240)
    assert [o[0] for o in out] == [2, 2, 2, 2]
    assert all(o[1] for o in out), "not bit-exact"
    # The replaced node got node 1's files from the copies on node 0, and node 0's
    # from node 0's first level; node 0 linked node 1's copies into its first level.
    assert out[2][2] == {
        f"partner:{root}/n{{node}}/partner (node 0)": 2,
        f"{root}/n{{node}}/l1 (node 0)": 2,
    }, out[2][2]
    assert out[0][2] == {f"partner:{root}/n{{node}}/partner (this node)": 2}, out[0][2]
    # The replaced node's first level holds its files again.
    names = sorted(p.name[:2] for p in (tmp_path / "n1/l1/step-2/data").iterdir())
    assert names == ["0-", "1-", "2-", "3-"]

    # Fewer ranks: the job restarts with 2 ranks, one on node 0 and one on a new,
    # empty node 1; DCP reshards from the restored files.
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, timeout=240)
    assert [o[:2] for o in out] == [(2, True), (2, True)]


def test_erasure_level_rebuilds_any_lost_node(tmp_path):
    root = str(tmp_path)
    opts = {"data": 2, "parity": 1}
    run_ranks(_save_job, 3, root, 1, "erasure", opts, [1, 2], timeout=240)
    # Groups: nodes {0, 1} with parity on node 2; node {2} with parity on node 0.
    assert sorted(p.name for p in (tmp_path / "n2/erasure/step-2/parity").iterdir()) == [
        "0-2.bin", "group-0.json", "group-1.json",
    ]  # fmt: skip
    saved = tmp_path.parent / f"{tmp_path.name}-saved"
    shutil.copytree(tmp_path, saved)
    for lost in range(3):  # a restore adds files to the survivors too: start over each time
        shutil.rmtree(tmp_path)
        shutil.copytree(saved, tmp_path)
        shutil.rmtree(tmp_path / f"n{lost}")
        out = run_ranks(_load_job, 3, root, 1, "erasure", opts, timeout=240)
        assert [o[:2] for o in out] == [(2, True)] * 3, (lost, out)
        assert any("rebuilt" in source for source in out[lost][2]), (lost, out[lost][2])
