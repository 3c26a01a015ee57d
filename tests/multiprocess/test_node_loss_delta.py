"""First-level deltas with levels between nodes (issues 14 and 17).

A first level with ``keyframe_every`` stores deltas; partner and erasure
levels copy its files as they are, so each delta must reach a level beside
its reference, retention there keeps the references of kept steps, and a
restore onto a replaced node brings the reference before the step. Real
processes (gloo), real files; a simulated node is a directory
(``DCP_ML_NODE``, ``{node}`` in the paths), and losing one is deleting it.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from test_node_loss import (
    _blank,
    _flip_byte,
    load_latest_report,
    save_then_die_in_last_copy,
)

from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import RankError, run_ranks

pytestmark = pytest.mark.multiprocess


def _state(step: int) -> dict:
    """The state after ``step`` small updates: consecutive steps differ a little."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    b = torch.randn(4096, generator=g)
    layers = {str(i): torch.randn(64, 128, generator=g) for i in range(6)}
    bump = step * 1e-3
    return {
        "w": w + bump,
        "b": (b + bump).to(torch.bfloat16),
        "layers": {k: v + bump for k, v in layers.items()},
        "step": step,
    }


def _levels(root: str, kind: str, options: dict, every: int, remote: bool) -> list[Level]:
    levels = [
        Level(f"{root}/n{{node}}/l1", keep=2, codec="bytegroup", keyframe_every=4),
        Level(f"{kind}:{root}/n{{node}}/{kind}", every=every, keep=1, **options),
    ]
    if remote:  # a store every node reaches (a shared path stands in for s3://)
        levels.append(Level(f"{root}/remote", every=1, keep=2))
    return levels


def _save_job(
    rank: int,
    world: int,
    root: str,
    per_node: int,
    kind: str,
    options: dict,
    every: int,
    steps: list[int],
    remote: bool = False,
) -> list[tuple[int, bool, str | None]]:
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    mgr = CheckpointManager(_levels(root, kind, options, every, remote), drain_policy="wait")
    for step in steps:
        mgr.save(_state(step), step=step)
    results = mgr.wait()
    mgr.close()
    return [(r.step, r.committed, r.error) for r in results if r.level.startswith(kind)]


def _load_job(
    rank: int,
    world: int,
    root: str,
    per_node: int,
    kind: str,
    options: dict,
    every: int,
    remote: bool = False,
) -> tuple[int | None, bool, dict, dict | str]:
    """(step, bit-exact, what the restore brought, the reader's sources or the error)."""
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    return load_latest_report(_levels(root, kind, options, every, remote), _state)


def _steps(path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def _reference(path) -> str | None:
    link = json.loads((path / "manifest.json").read_text()).get("reference")
    return None if link is None else link["checkpoint"]


def _node_local_first_level_job(rank: int, world: int, root: str) -> tuple:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = [
        Level(f"{root}/n{{node}}/l1", keep=3, codec="bytegroup", keyframe_every=4),
        Level(f"{root}/remote", every=1, keep=3),
    ]
    mgr = CheckpointManager(levels, drain_policy="wait")
    for step in (1, 2, 3):
        mgr.save(_state(step), step=step)
    mgr.wait()  # DrainError if a drain could not read a delta's reference
    mgr.close()
    mgr = CheckpointManager(levels)
    state = _blank()
    step = mgr.load_latest(state)
    mgr.close()
    return step, bit_equal(state, _state(step)), mgr.last_load_sources


def test_deltas_on_a_node_local_first_level_drain_and_load_on_every_node(tmp_path):
    # Only rank 0's node gets a step's manifest from DCP: before the fix, node 1
    # found no manifest beside its deltas for their reference, and every drain
    # of a delta failed on its ranks.
    root = str(tmp_path)
    out = run_ranks(_node_local_first_level_job, 2, root, timeout=240)
    assert [o[:2] for o in out] == [(3, True)] * 2
    for node, (_, _, sources) in enumerate(out):  # each rank's own file, from its own disk
        assert f"file://{root}/n{node}/l1/step-3" in sources, sources
        # The reference's manifest is on every node (the delta's is not needed there).
        assert (tmp_path / f"n{node}/l1/step-1/manifest.json").exists()
    assert _reference(tmp_path / "n0/l1/step-3") == "step-1"


def test_a_partner_level_receives_each_delta_beside_its_reference(tmp_path):
    # keyframe_every=4: steps 1 and 5 are whole, the others deltas against them.
    # The partner level takes every 2nd step, so step 1 and step 5 are copied
    # there first (before 2 and 6); keep=1 keeps step 6 and its reference.
    root, opts = str(tmp_path), {"replicas": 2}
    drained = run_ranks(_save_job, 4, root, 2, "partner", opts, 2, [1, 2, 3, 4, 5, 6], timeout=300)
    assert [s for s, ok, err in drained[0] if ok and err is None] == [1, 2, 4, 5, 6]
    for node in (0, 1):
        part = tmp_path / f"n{node}/partner"
        assert _steps(part) == ["step-5", "step-6"]
        assert _reference(part / "step-6") == "step-5" and _reference(part / "step-5") is None
        for step in ("step-5", "step-6"):  # every rank's file on every node
            assert [f[:2] for f in _steps(part / step / "data")] == ["0-", "1-", "2-", "3-"]
    shutil.rmtree(tmp_path / "n1")  # lost; a new, empty node replaces it
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, 2, timeout=300)
    assert [o[:2] for o in out] == [(6, True)] * 4, out
    # Node 1's ranks got step 5's files and step 6's: 2 + 2 from node 0's copies,
    # 2 + 2 of node 0's own from its first level.
    assert out[2][2] == {
        f"partner:{root}/n{{node}}/partner (node 0)": 4,
        f"{root}/n{{node}}/l1 (node 0)": 4,
    }, out[2][2]
    assert _steps(tmp_path / "n1/l1") == ["step-5", "step-6"]
    # The restore made the partner copies of both steps again on node 1: losing
    # node 0 now still restores step 6, from node 1 alone.
    assert _steps(tmp_path / "n1/partner") == ["step-5", "step-6"]
    shutil.rmtree(tmp_path / "n0")
    out = run_ranks(_load_job, 4, root, 2, "partner", opts, 2, timeout=300)
    assert [o[:2] for o in out] == [(6, True)] * 4, out
    # Fewer ranks: 2, one on node 0 and one on a new, empty node 1; DCP reshards
    # from the delta and its reference, both restored.
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, 2, timeout=300)
    assert [o[:2] for o in out] == [(6, True)] * 2, out


def test_an_erasure_level_rebuilds_a_delta_and_its_reference(tmp_path):
    root, opts = str(tmp_path), {"data": 2, "parity": 1}
    run_ranks(_save_job, 3, root, 1, "erasure", opts, 1, [1, 2, 3], timeout=300)
    for node in range(3):
        assert _steps(tmp_path / f"n{node}/erasure") == ["step-1", "step-3"]
    shutil.rmtree(tmp_path / "n0")  # a member of group 0: rebuilt, for step 1 and step 3
    out = run_ranks(_load_job, 3, root, 1, "erasure", opts, 1, timeout=300)
    assert [o[:2] for o in out] == [(3, True)] * 3, out
    rebuilt = {k: v for o in out for k, v in o[2].items() if "rebuilt" in k}
    assert sum(rebuilt.values()) == 2, out  # node 0's one file, for each of the two steps


def test_a_delta_whose_reference_is_lost_falls_back_or_names_the_chain(tmp_path):
    root, opts = str(tmp_path), {"replicas": 2}
    run_ranks(_save_job, 2, root, 1, "partner", opts, 1, [1, 2], True, timeout=300)
    saved = tmp_path.parent / f"{tmp_path.name}-saved"
    shutil.copytree(tmp_path, saved)
    # Node 1 is lost, and node 0's copy of node 1's files of the reference is
    # damaged beyond use (gone): step 2 cannot be rebuilt on the nodes, and the
    # remote serves it.
    shutil.rmtree(tmp_path / "n1")
    shutil.rmtree(tmp_path / "n0/partner/step-1")
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, 1, True, timeout=300)
    assert [o[:2] for o in out] == [(2, True)] * 2, out
    assert all(f"file://{root}/remote/step-2" in o[3] for o in out), out
    # Without the remote: no step can be restored, and the error says why.
    shutil.rmtree(tmp_path)
    shutil.copytree(saved, tmp_path)
    shutil.rmtree(tmp_path / "remote")
    shutil.rmtree(tmp_path / "n1")
    shutil.rmtree(tmp_path / "n0/partner/step-1")
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, 1, False, timeout=300)
    assert out[0][0] is None, out
    assert "step 2 is a delta against step 1, which cannot be restored" in out[0][3], out[0][3]


def test_a_damaged_reference_on_the_first_level_is_fetched_intact_from_another_node(tmp_path):
    # Step 2 is a delta against step 1. Rank 0's file of step 1 is damaged on
    # node 0 (its partner copy there is the same file, linked); node 1's copy
    # is intact. Before the fix only step 2's own files were checked and
    # fetched again, and load_latest fell back to step 1.
    root, opts = str(tmp_path), {"replicas": 2}
    run_ranks(_save_job, 2, root, 1, "partner", opts, 1, [1, 2], timeout=300)
    assert _reference(tmp_path / "n0/l1/step-2") == "step-1"
    (own,) = (tmp_path / "n0/l1/step-1/data").glob("0-*.bin")
    _flip_byte(own)
    out = run_ranks(_load_job, 2, root, 1, "partner", opts, 1, timeout=300)
    assert [o[:2] for o in out] == [(2, True)] * 2, out
    # The damaged reference file is kept aside, an intact copy from node 1 took its place.
    assert len(list((tmp_path / "n0/l1/step-1/data").glob("0-*.bin.damaged-*"))) == 1
    assert any(k.endswith("(node 1)") for k in out[0][2]), out[0][2]


def _killed_mid_delta_copy_job(rank: int, world: int, root: str) -> None:
    """Saves steps 1 and 2 (copied to partners), then dies by SIGKILL in step 3's copy."""
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(
        _levels(root, "partner", {"replicas": 2}, 1, False), drain_policy="wait"
    )
    save_then_die_in_last_copy(mgr, _state, [1, 2, 3], rank, dying=1)


def test_sigkill_during_a_delta_copy_leaves_the_previous_step_restorable(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankError):
        run_ranks(_killed_mid_delta_copy_job, 2, root, timeout=240)
    for node in (0, 1):
        assert _steps(tmp_path / f"n{node}/partner")[:2] == ["step-1", "step-2"]
        assert not (tmp_path / f"n{node}/partner/step-3/manifest.json").exists()
    shutil.rmtree(tmp_path / "n1")
    out = run_ranks(_load_job, 2, root, 1, "partner", {"replicas": 2}, 1, timeout=240)
    assert [o[:2] for o in out] == [(2, True)] * 2, out
