"""Poisoned state never climbs: health checks, quarantine, retention and resumes.

Real processes (gloo), real files, a real S3-speaking server on loopback; each
simulated node is a directory (``DCP_ML_NODE``, ``{node}`` in the level paths).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _logs import Warnings

import dcp_multilevel
from dcp_multilevel import (
    BalancedSavePlanner,
    CheckpointManager,
    Checks,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.format import seal_manifest
from dcp_multilevel.health import LossSpike
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import run_ranks

pytest_plugins = ["_s3"]


def _state(step: int, poisoned: bool = False) -> dict:
    g = torch.Generator().manual_seed(step)
    state = {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "optim": {"w.exp_avg": torch.randn(64, 32, generator=g).bfloat16()},
        "step": step,
    }
    if poisoned:  # as after a divergence: a NaN in one optimizer tensor
        state["optim"]["w.exp_avg"][3, 4] = float("nan")
    return state


def _blank() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
        "optim": {"w.exp_avg": torch.zeros(64, 32, dtype=torch.bfloat16)},
        "step": -1,
    }


def _steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return sorted(int(p.name[5:]) for p in path.iterdir() if (p / "manifest.json").exists())


# --------------------------------------------------------------------------- the scenario


def _scenario_levels(root: str, remote: str, options: dict, first: str) -> list[Level]:
    # Default settings but for keep: the first level keeps 3, the second 2.
    return [
        Level(f"{root}/{first}", keep=3),
        Level(remote, keep=2, storage_options=options),
    ]


def _on_rank(state: dict, rank: int, sharded: bool) -> dict:
    """``state`` as ``rank`` saves or loads it: replicated, or its own (``sharded``)."""
    return {f"rank{rank}": state} if sharded else state


def _diverging_job(rank: int, world: int, levels: list, via: str) -> tuple:
    """Saves steps 1 to 6 (3 on: poisoned), resumes from the newest clean step, then
    loads step 6 by its number; (resumed step, bit-exact, step 6 bit-exact, the
    warnings logged while step 6 loaded)."""
    os.environ["DCP_ML_NODE"] = str(rank)
    # A node-local first level holds each node's files only, and a quarantined step is
    # on no other level: it loads where each rank reads only what its own node wrote
    # (docs/health.md), so there each rank saves a state of its own, as sharded jobs do.
    sharded = "{node}" in levels[0].url
    if via == "manager":
        mgr = CheckpointManager(levels)
        for step in range(1, 7):
            mgr.save(_on_rank(_state(step, poisoned=step >= 3), rank, sharded), step)
        mgr.wait()
        mgr.close()
    else:
        for step in range(1, 7):  # a new writer per save, as stacks build them
            saved = _on_rank(_state(step, poisoned=step >= 3), rank, sharded)
            dcp.save(saved, storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
        dcp_multilevel.wait()
    # The resume: the newest clean step, passing over the quarantined ones.
    state = _on_rank(_blank(), rank, sharded)
    if via == "manager":
        mgr = CheckpointManager(levels)
        step = mgr.load_latest(state)
        mgr.close()
    else:
        reader = MultiLevelReader("latest", levels=levels)
        dcp.load(state, storage_reader=reader)
        step = reader.loads.restore.step
    clean = bit_equal(state, _on_rank(_state(step), rank, sharded))
    # Asked for by its number, a quarantined step loads (with a warning).
    poisoned = _on_rank(_blank(), rank, sharded)
    with Warnings() as warned:
        if via == "manager":
            mgr = CheckpointManager(levels)
            mgr.load(poisoned, 6)
            mgr.close()
        else:
            dcp.load(poisoned, storage_reader=MultiLevelReader("step-6", levels=levels))
    loaded = bit_equal(poisoned, _on_rank(_state(6, poisoned=True), rank, sharded))
    return step, clean, loaded, warned.messages


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("remote_kind", "via", "first"),
    [
        ("folder", "plugin", "l1"),
        ("s3", "plugin", "l1"),
        ("folder", "manager", "l1"),
        ("s3", "manager", "n{node}/l1"),  # node-local: each node holds its ranks' files
    ],
)
def test_poisoned_steps_stay_on_the_first_level_and_the_resume_takes_the_last_clean_one(
    tmp_path, remote_kind, via, first, request
):
    root = str(tmp_path)
    if remote_kind == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = server.new_bucket()
        remote, options = f"s3://{bucket}/run", server.storage_options
    else:
        remote, options = f"{root}/remote", {}
    levels = _scenario_levels(root, remote, options, first)
    out = run_ranks(_diverging_job, 2, levels, via, timeout=240)
    if "{node}" in first:  # each rank saved a state of its own
        items = ("rank0.optim.w.exp_avg", "rank1.optim.w.exp_avg")
        where = "ranks 0, 1; 'rank0.optim.w.exp_avg', 'rank1.optim.w.exp_avg'"
    else:  # replicated: the rank that wrote the poisoned tensor
        items, where = ("optim.w.exp_avg",), "rank 1; 'optim.w.exp_avg'"
    warning = (
        "dcp_multilevel: loading step 6, which is QUARANTINED (asked for by its number): "
        f"nonfinite: 1 non-finite value in 1 tensor ({where})"
    )
    # Resumed from step 2, bit-exact; step 6 loaded by its number, bit-exact (its NaN
    # too), with one warning on every rank.
    assert out == [(2, True, True, [warning])] * 2, out
    # Clean steps kept; the newest poison too, for inspection.
    firsts = [first.replace("{node}", str(n)) for n in (0, 1)] if "{node}" in first else [first]
    assert _steps(tmp_path / firsts[0]) == [1, 2, 6]
    for path in firsts[1:]:  # (the manifests are on rank 0's node)
        assert sorted(p.name for p in (tmp_path / path).iterdir()) == ["step-1", "step-2", "step-6"]
    manifest = StoredCheckpoint.at(f"{root}/{firsts[0]}/step-6").manifest()
    assert manifest.quarantined
    (finding,) = manifest.health.findings
    assert finding.check == "nonfinite"
    assert finding.items == items
    if remote_kind == "folder":  # no poisoned step ever reached the second level
        assert _steps(tmp_path / "remote") == [1, 2]
    else:
        keys = server.keys(bucket, "run/")
        held = sorted(k.split("/")[-2] for k in keys if k.endswith("/manifest.json"))
        assert held == ["step-1", "step-2"]


# --------------------------------------------------------------------------- replicas


def _replica_job(rank: int, world: int, root: str, flip: bool, verify: bool) -> None:
    state = _state(1)
    if flip and rank == world - 1:  # silent data corruption on one replica
        state["model"]["w"][0, 0] += 1.0
    planner = BalancedSavePlanner(verify_replicas=verify)
    dcp.save(state, storage_writer=MultiLevelWriter(root), planner=planner)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_a_flipped_replica_quarantines_the_step_naming_its_rank(tmp_path, world):
    path = str(tmp_path / "ckpt")
    run_ranks(_replica_job, world, path, True, True, timeout=240)
    manifest = StoredCheckpoint.at(path).manifest()
    assert manifest.quarantined
    (finding,) = manifest.health.findings
    assert finding.check == "replicas"
    assert finding.items == ("model.w",)
    if world == 2:  # no majority: both named
        assert finding.ranks == (0, 1)
        assert "no majority" in finding.message
    else:  # the odd one out is named, and the majority's bytes are written
        assert finding.ranks == (2,)
        state = _blank()
        dcp.load(state, storage_reader=MultiLevelReader(path))
        assert bit_equal(state, _state(1))


@pytest.mark.multiprocess
def test_the_replica_check_turned_off_finds_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_replica_job, 2, path, True, False, timeout=240)
    manifest = StoredCheckpoint.at(path).manifest()
    assert not manifest.quarantined
    assert "replicas" not in manifest.health.checked


@pytest.mark.multiprocess
def test_equal_replicas_are_clean(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_replica_job, 3, path, False, True, timeout=240)
    manifest = StoredCheckpoint.at(path).manifest()
    assert not manifest.quarantined
    assert set(manifest.health.checked) == {"nonfinite", "replicas"}


# --------------------------------------------------------------------------- loss, custom


def _loss_job(rank: int, world: int, root: str, checks: Checks | None, losses: list) -> dict:
    levels = [Level(f"{root}/l1", keep=10), Level(f"{root}/remote")]
    mgr = CheckpointManager(levels, checks=checks)
    for step, loss in enumerate(losses, start=1):
        mgr.step(_state(step), step, loss=loss)
    mgr.wait()
    mgr.close()
    health = {}
    for step in _steps(Path(root) / "l1"):
        m = StoredCheckpoint.at(f"{root}/l1/step-{step}").manifest()
        health[step] = [(f.check, f.message) for f in m.health.findings]
    return {"health": health, "remote": _steps(Path(root) / "remote")}


LOSSES = [2.0, 1.9, 1.8, 1.7, 1.6, 9.0, 1.5, float("nan")]


@pytest.mark.multiprocess
def test_a_loss_spike_and_a_nonfinite_loss_quarantine_their_steps(tmp_path):
    rule = LossSpike(ratio=2.0, window=4, warmup=3)
    (out,) = run_ranks(_loss_job, 1, str(tmp_path), Checks(loss=rule), LOSSES, timeout=240)
    bad = {s for s, found in out["health"].items() if found}
    assert bad == {6, 8}
    ((check, message),) = out["health"][6]
    assert check == "loss" and "over 2x the median 1.75 of the last 4 losses" in message
    assert out["health"][8] == [("loss", "the loss is nan")]
    assert out["remote"] == [1, 2, 3, 4, 5, 7]


@pytest.mark.multiprocess
def test_the_loss_rule_turned_off_judges_nothing(tmp_path):
    (out,) = run_ranks(_loss_job, 1, str(tmp_path), Checks(loss=None), LOSSES, timeout=240)
    assert not any(out["health"].values())
    assert out["remote"] == list(range(1, 9))


def _custom_job(rank: int, world: int, root: str) -> dict:
    seen = []

    def positive_step(state) -> str | None:
        seen.append(state["step"])
        return None if state["step"] != 2 else "step 2 is banned"

    def exploding(state) -> None:
        if state["step"] == 3:
            raise RuntimeError("the check broke")

    levels = [Level(f"{root}/l1"), Level(f"{root}/remote")]
    checks = Checks(custom=[positive_step, exploding])
    for step in (1, 2, 3):
        writer = MultiLevelWriter(f"step-{step}", levels=levels, checks=checks)
        dcp.save(_state(step), storage_writer=writer)
    # With the checks off, the same poison is clean.
    off = MultiLevelWriter("step-4", levels=levels, checks=Checks.off())
    dcp.save(_state(4, poisoned=True), storage_writer=off)
    only = MultiLevelWriter("step-5", levels=levels, checks=Checks(nonfinite=False))
    dcp.save(_state(5, poisoned=True), storage_writer=only)
    dcp_multilevel.wait()
    found = {}
    for step in (1, 2, 3, 4, 5):
        m = StoredCheckpoint.at(f"{root}/l1/step-{step}").manifest()
        found[step] = [(f.check, f.message, f.ranks) for f in m.health.findings]
    return {"found": found, "seen": seen, "remote": _steps(Path(root) / "remote")}


@pytest.mark.multiprocess
def test_a_custom_check_and_one_that_raises_quarantine_naming_the_check(tmp_path):
    (out,) = run_ranks(_custom_job, 1, str(tmp_path), timeout=240)
    assert out["seen"] == [1, 2, 3]
    assert out["found"][1] == []
    assert out["found"][2] == [("positive_step", "step 2 is banned", (0,))]
    assert out["found"][3] == [
        ("exploding", "the check raised RuntimeError: the check broke", (0,))
    ]
    assert out["found"][4] == []  # Checks.off(): the NaN goes unnoticed
    assert out["found"][5] == []  # and with the non-finite count alone turned off
    assert out["remote"] == [1, 4, 5]


def _async_job(rank: int, world: int, root: str) -> list:
    seen = []
    checks = Checks(custom=[lambda state: seen.append(float(state["model.b"][0])) or None])
    state = _state(1)
    state["model"]["b"][0] = 1.0
    writer = MultiLevelWriter(root, checks=checks)
    future = dcp.async_save(state, storage_writer=writer)
    state["model"]["b"][0] = float("nan")  # after the call: not what was staged
    future.result()
    m = StoredCheckpoint.at(root).manifest()
    return [seen, m.quarantined]


@pytest.mark.multiprocess
def test_checks_see_the_state_as_staged_not_a_later_mutation(tmp_path):
    (out,) = run_ranks(_async_job, 1, str(tmp_path / "ckpt"), timeout=240)
    assert out == [[1.0], False]


# --------------------------------------------------------------------------- deltas, old


def _delta_job(rank: int, world: int, root: str) -> dict:
    levels = [Level(f"{root}/l1", codec="bytegroup", keyframe_every=4)]
    for step in (1, 2, 3):
        writer = MultiLevelWriter(f"step-{step}", levels=levels)
        dcp.save(_state(1, poisoned=step == 2) | {"step": step}, storage_writer=writer)
    dcp_multilevel.wait()
    return {s: StoredCheckpoint.at(f"{root}/l1/step-{s}").manifest().reference_step for s in (2, 3)}


@pytest.mark.multiprocess
def test_a_clean_step_is_never_coded_against_a_quarantined_one(tmp_path):
    (refs,) = run_ranks(_delta_job, 1, str(tmp_path), timeout=240)
    assert refs == {2: 1, 3: 1}


def _old_job(rank: int, world: int, root: str) -> tuple:
    levels = [Level(f"{root}/l1", keep=2)]
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
    dcp_multilevel.wait()
    for step in (1, 2):  # as saved before checks existed: no health record
        path = Path(root) / "l1" / f"step-{step}" / "manifest.json"
        doc = json.loads(path.read_text())
        del doc["health"]
        path.write_bytes(seal_manifest(doc))
    mgr = CheckpointManager(levels)
    state = _blank()
    step = mgr.load_latest(state)
    mgr.save(_state(3, poisoned=True), 3)
    mgr.save(_state(4, poisoned=True), 4)  # keep=2 counts the two old, clean steps
    mgr.close()
    return step, bit_equal(state, _state(2)), _steps(Path(root) / "l1")


@pytest.mark.multiprocess
def test_old_checkpoints_without_a_health_record_load_and_count_as_clean(tmp_path):
    (out,) = run_ranks(_old_job, 1, str(tmp_path), timeout=240)
    assert out == (2, True, [1, 2, 4])


def _all_poisoned_job(rank: int, world: int, root: str) -> tuple:
    levels = [Level(f"{root}/l1")]
    for step in (1, 2):
        writer = MultiLevelWriter(f"step-{step}", levels=levels)
        dcp.save(_state(step, poisoned=True), storage_writer=writer)
    dcp_multilevel.wait()
    try:
        dcp.load(_blank(), storage_reader=MultiLevelReader("latest", levels=levels))
        refused = ""
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        refused = str(e)
    state = _blank()
    reader = MultiLevelReader("latest", levels=levels, allow_quarantined=True)
    dcp.load(state, storage_reader=reader)
    return refused, reader.loads.restore.step


@pytest.mark.multiprocess
def test_with_only_quarantined_steps_a_resume_refuses_unless_allowed(tmp_path):
    (out,) = run_ranks(_all_poisoned_job, 1, str(tmp_path), timeout=240)
    refused, step = out
    assert "every checkpoint every rank can restore is quarantined (steps [1, 2]" in refused
    assert "allow_quarantined=True" in refused
    assert step == 2


def _manager_job(
    rank: int, world: int, root: str, keep: tuple, steps: list, poisoned: list, load: bool
) -> int | None:
    """Saves ``steps`` through a manager (those in ``poisoned`` with a NaN), after
    resuming from the newest clean step when ``load``; the step it resumed from."""
    levels = [Level(f"{root}/l1", keep=keep[0]), Level(f"{root}/remote", keep=keep[1])]
    mgr = CheckpointManager(levels)
    loaded = mgr.load_latest(_blank()) if load else None
    for step in steps:
        mgr.save(_state(step, poisoned=step in poisoned), step)
    mgr.wait()
    mgr.close()
    return loaded


@pytest.mark.multiprocess
def test_after_a_restart_retention_still_counts_an_older_quarantined_step_last(tmp_path):
    root = str(tmp_path)
    run_ranks(_manager_job, 1, root, (4, 5), [1, 2, 3, 4], [3], False, timeout=240)
    assert _steps(tmp_path / "l1") == [1, 2, 3, 4]  # 3: quarantined, in a free place
    # A new process: the load learns that step 3, older than the step it loads, is
    # quarantined (its manifest says so), so the next save's retention keeps step 1.
    (loaded,) = run_ranks(_manager_job, 1, root, (4, 5), [5], [], True, timeout=240)
    assert loaded == 4
    assert _steps(tmp_path / "l1") == [1, 2, 4, 5]
    assert _steps(tmp_path / "remote") == [1, 2, 4, 5]


@pytest.mark.multiprocess
def test_a_run_resumed_from_a_clean_step_saves_over_the_quarantined_ones(tmp_path):
    root = str(tmp_path)
    run_ranks(_manager_job, 1, root, (3, 2), [1, 2, 3, 4, 5, 6], [3, 4, 5, 6], False, timeout=240)
    assert _steps(tmp_path / "l1") == [1, 2, 6]
    # Resumed from step 2, the run saves steps 3 to 6 again, clean: step 6 replaces
    # the quarantined one (no CheckpointExistsError) and climbs like any clean step.
    (loaded,) = run_ranks(_manager_job, 1, root, (3, 2), [3, 4, 5, 6], [], True, timeout=240)
    assert loaded == 2
    assert _steps(tmp_path / "l1") == [4, 5, 6]
    assert not StoredCheckpoint.at(f"{root}/l1/step-6").manifest().quarantined
    assert _steps(tmp_path / "remote") == [5, 6]


def _hint_job(rank: int, world: int, root: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(64, 64, generator=g)
    state = {"shared": {"w": shared}, "own": {f"r{rank}": torch.full((32,), float(rank))}}
    planner = BalancedSavePlanner()  # reused across saves, as the manager does
    dcp.save(state, storage_writer=MultiLevelWriter(f"{root}/s1"), planner=planner)
    hint = planner._digests._hint  # what the first save taught this rank
    if rank == world - 1:  # silent data corruption on one replica, after the first save
        shared[3, 3] += 1.0
    dcp.save(state, storage_writer=MultiLevelWriter(f"{root}/s2"), planner=planner)
    return sorted(hint)


@pytest.mark.multiprocess
def test_after_one_save_a_rank_hashes_only_its_replicated_items_and_still_finds_a_flip(tmp_path):
    root = str(tmp_path)
    out = run_ranks(_hint_job, 3, root, timeout=240)
    assert out == [["shared.w"]] * 3  # not its own shard: no other rank holds it
    assert not StoredCheckpoint.at(f"{root}/s1").manifest().quarantined
    manifest = StoredCheckpoint.at(f"{root}/s2").manifest()
    (finding,) = manifest.health.findings
    assert (finding.check, finding.items, finding.ranks) == ("replicas", ("shared.w",), (2,))
    state = {"shared": {"w": torch.zeros(64, 64)}}
    dcp.load(state, storage_reader=MultiLevelReader(f"{root}/s2"))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(state["shared"]["w"], torch.randn(64, 64, generator=g))  # the majority's


def test_the_nonfinite_finding_counts_values_and_tensors_in_words(tmp_path):
    state = {"a": torch.ones(8), "b": torch.ones(8), "c": torch.ones(8)}
    state["a"][3] = float("nan")
    writer = MultiLevelWriter(tmp_path / "one")
    dcp.save(state, storage_writer=writer)
    assert [f.message for f in writer.health.findings] == ["1 non-finite value in 1 tensor"]
    state["b"][0] = float("inf")
    state["b"][5] = float("-inf")
    writer = MultiLevelWriter(tmp_path / "three")
    dcp.save(state, storage_writer=writer)
    (finding,) = writer.health.findings
    assert (finding.message, finding.items) == ("3 non-finite values in 2 tensors", ("a", "b"))
