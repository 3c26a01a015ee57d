"""Every due step reaches its level (the default drain policy "latest").

A save due on a level whose previous drain still runs waits in that level's
one slot; a newer due step replaces it there (reported as superseded);
``wait()``/``close()`` return once the newest step due on each level is
there. Slow levels are real ones whose uploads stall until the test opens a
gate (``faulty://`` with ``wait_for``, a file every process can see), so
nothing here depends on how fast this machine is.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _faulty_fs  # noqa: F401 - registers faulty://
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from conftest import assert_bit_equal

from dcp_multilevel import CheckpointManager, Level, MultiLevelReader
from dcp_multilevel.checkpoint import CheckpointRoot
from dcp_multilevel.levels import LEVEL_KINDS, DrainJob, DrainResult, Lanes, LevelDriver
from dcp_multilevel.levels.partner import PartnerLevel

HERE = Path(__file__).parents[1]  # tests/


def state(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(128, 128, generator=g), "b": torch.arange(500) + v, "step": v}


def blank() -> dict:
    return {"w": torch.zeros(128, 128), "b": torch.zeros(500, dtype=torch.long), "step": -1}


def check(loaded: dict, v: int) -> None:
    expected = state(v)
    assert_bit_equal(loaded["w"], expected["w"], "w")
    assert_bit_equal(loaded["b"], expected["b"], "b")
    assert loaded["step"] == v


def gated(root: Path, gate: Path, **level) -> Level:
    """A remote level below ``root`` whose uploads stall until ``gate`` exists."""
    options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "wait_for": {"put_file": str(gate)},
        "skip_instance_cache": True,
    }
    return Level(f"faulty://{root}/run", storage_options=options, **level)


def test_the_final_checkpoint_reaches_the_remote_when_saves_outpace_the_drain(tmp_path):
    # The first scenario: four saves in a row while the remote is busy.
    gate = tmp_path / "gate"
    l1 = Level(str(tmp_path / "l1"), every=1, keep=2)
    remote = gated(tmp_path / "remote", gate, every=1, keep=5)
    records: list[dict] = []
    mgr = CheckpointManager([l1, remote], on_metrics=records.append)
    saved = [mgr.save(state(s), step=s) for s in (1, 2, 3, 4)]
    # save() returned four times while step 1's upload is stalled: it never waits.
    assert [m.drains_started for m in saved] == [[remote.url]] * 4
    assert [m.drains_queued for m in saved] == [[], [remote.url], [remote.url], [remote.url]]
    # Steps 2-4 wait for the remote; retention (keep=2) keeps what drains will read.
    assert mgr.steps(0) == [1, 2, 3, 4]
    gate.touch()
    mgr.wait()
    mgr.close()
    assert mgr.steps(1) == [1, 4]
    outcome = {r.step: (r.committed, r.superseded_by, r.error) for r in mgr.drain_results}
    assert outcome == {
        1: (True, None, None),
        2: (False, 4, None),
        3: (False, 4, None),
        4: (True, None, None),
    }
    drains = {r["step"]: r for r in records if r["kind"] == "drain"}
    assert drains[2]["superseded_by"] == 4 and drains[3]["superseded_by"] == 4
    # The lag a user watches: commit on the first level -> durable on the remote,
    # which includes the time step 4 waited for step 1's drain.
    assert drains[4]["lag_seconds"] >= drains[4]["queued_seconds"] > 0
    # Losing the node (the first level) loses nothing: step 4 comes from the remote.
    shutil.rmtree(tmp_path / "l1")
    again = CheckpointManager(
        [
            l1,
            Level(
                remote.url,
                storage_options={"target_protocol": "file", "target_options": {"auto_mkdir": True}},
            ),
        ]
    )
    loaded = blank()
    assert again.load_latest(loaded) == 4
    check(loaded, 4)
    again.close()


def test_retention_keeps_what_a_waiting_or_running_drain_reads(tmp_path):
    gate = tmp_path / "gate"
    mgr = CheckpointManager([Level(str(tmp_path / "l1"), keep=1), gated(tmp_path / "remote", gate)])
    for s in (1, 2, 3):
        mgr.save(state(s), step=s)
    assert mgr.steps(0) == [1, 2, 3]  # 1 is being drained, 2 and 3 wait: all kept
    gate.touch()
    mgr.wait()
    assert mgr.steps(1) == [1, 3]
    mgr.save(state(4), step=4)
    mgr.wait()
    # 1 and 3 are on the remote, 2 was superseded: only the newest stays.
    assert mgr.steps(0) == [4]
    assert mgr.steps(1) == [1, 3, 4]
    mgr.close()


def test_wait_covers_every_level_and_skip_and_wait_stay_options(tmp_path):
    # Two slow levels, different intervals: wait() returns with each one's newest due step.
    gate = tmp_path / "gate"
    levels = [
        Level(str(tmp_path / "l1"), keep=1),
        gated(tmp_path / "a", gate),
        gated(tmp_path / "b", gate, every=2),
    ]
    mgr = CheckpointManager(levels)
    for s in range(1, 8):
        mgr.save(state(s), step=s)
    gate.touch()
    mgr.wait()
    assert mgr.steps(1)[-1] == 7 and mgr.steps(2)[-1] == 6
    assert mgr.steps(1) == [1, 7] and mgr.steps(2) == [2, 6]
    mgr.close()
    for policy, expected in (("skip", [1]), ("wait", [1, 2, 3])):
        gate = tmp_path / f"gate-{policy}"
        remote = gated(tmp_path / f"r-{policy}", gate)
        mgr = CheckpointManager(
            [Level(str(tmp_path / f"l1-{policy}")), remote], drain_policy=policy
        )
        if policy == "wait":
            gate.touch()  # "wait" blocks save() until the level is free
        for s in (1, 2, 3):
            mgr.save(state(s), step=s)
        gate.touch()
        mgr.wait()
        assert mgr.steps(1) == expected
        mgr.close()


# ---------------------------------------------------------------- a partner level


class GatedPartner(PartnerLevel):
    """A partner level whose drains start once the file ``<level path>.gate`` exists."""

    def drain(self, job, manifest, link):
        gate = Path(self.url.split(":", 1)[1]).parent.parent / "gate"
        deadline = time.monotonic() + 120
        while not gate.exists():
            assert time.monotonic() < deadline, f"{gate} never opened"
            time.sleep(0.01)
        return super().drain(job, manifest, link)


def _partner_levels(root: str) -> list[Level]:
    return [Level(f"{root}/n{{node}}/l1", keep=2), Level(f"gated:{root}/n{{node}}/partner", keep=2)]


def _partner_save(rank: int, world: int, root: str) -> list[tuple[int, bool, int | None]]:
    os.environ["DCP_ML_NODE"] = str(rank)
    LEVEL_KINDS.register("gated", GatedPartner, clobber=True)
    mgr = CheckpointManager(_partner_levels(root))
    mgr.save(state(10), step=10)
    mgr.save(state(20), step=20)  # step 10's copy has not started: 20 waits
    if rank == 0:
        Path(root, "gate").touch()
    mgr.wait()
    mgr.close()
    return [(r.step, r.committed, r.superseded_by) for r in mgr.drain_results]


def _partner_load(rank: int, world: int, root: str) -> tuple[int | None, bool]:
    os.environ["DCP_ML_NODE"] = str(rank)
    LEVEL_KINDS.register("gated", GatedPartner, clobber=True)
    Path(root, "gate").touch()
    mgr = CheckpointManager(_partner_levels(root))
    loaded = blank()
    step = mgr.load_latest(loaded)
    mgr.close()
    expected = state(step) if step is not None else {}
    same = step is not None and all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))
    return step, same


@pytest.mark.multiprocess
def test_a_partner_level_gets_the_newest_step_and_a_lost_node_resumes_from_it(tmp_path):
    # The second scenario: saves at steps 10 and 20, wait(), lose a node.
    root = str(tmp_path)
    results = run_ranks(_partner_save, 2, root, timeout=120)
    # Every rank took the same decision: 10 was running, 20 waited and went next.
    assert results[0] == results[1] == [(10, True, None), (20, True, None)]
    shutil.rmtree(tmp_path / "n1")
    assert run_ranks(_partner_load, 2, root, timeout=120) == [(20, True), (20, True)]


def _superseding(rank: int, world: int, root: str) -> list[tuple[int, bool, int | None]]:
    # Rank 1's lane is free long before rank 0's (rank 0's upload stalls), so each
    # rank alone would start step 2 on rank 1 and step 4 on rank 0.
    gate = Path(root, "gate")
    options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "skip_instance_cache": True,
    }
    if rank == 0:
        options["wait_for"] = {"put_file": str(gate)}
    remote = Level(f"faulty://{root}/remote", storage_options=options)
    mgr = CheckpointManager([Level(f"{root}/l1-{rank}"), remote], drain_timeout_s=60)
    for s in (1, 2, 3, 4):
        mgr.save(state(s), step=s)
        if rank == 1:
            time.sleep(0.2)
    if rank == 0:
        gate.touch()
    mgr.wait()
    mgr.close()
    return [(r.step, r.committed, r.superseded_by) for r in mgr.drain_results]


@pytest.mark.multiprocess
def test_every_rank_supersedes_the_steps_rank_0_supersedes(tmp_path):
    out = run_ranks(_superseding, 2, str(tmp_path), timeout=120)
    assert out[0] == out[1], out
    assert out[0][0] == (1, True, None) and out[0][-1] == (4, True, None)
    assert all(sup == 4 for _, ok, sup in out[0][1:-1])
    assert (tmp_path / "remote" / "step-4" / "manifest.json").exists()


class Handshake(LevelDriver):
    """A level whose drain is one exchange through the drain's link: ranks that
    run different drains wait on different keys and time out."""

    def drain(self, job, manifest, link):
        Path(self.url, f"started-{link.rank}-{job.step}").touch()
        gate = Path(self.url) / "gate"
        while not gate.exists():
            time.sleep(0.01)
        if link.rank == 0:
            link.gather()
        else:
            link.send(job.step)
        return DrainResult(job.step, self.url, committed=True)


def _lanes_agree(rank: int, world: int, root: str) -> list[tuple[int, bool, int | None]]:
    source = CheckpointRoot(f"{root}/l1")
    target = Handshake(Level(f"{root}/target"))
    lanes = Lanes(policy="latest", timeout_s=20, key="agree")
    job = lambda s: DrainJob(s, source.checkpoint(s), target, f"agree-{s}", 0.0)  # noqa: E731
    lanes.submit(job(1))
    while not Path(root, "target", f"started-{rank}-1").exists():
        time.sleep(0.01)
    lanes.submit(job(2))
    if rank == 0:
        lanes.submit(job(3))
        Path(root, "target", "gate").touch()  # rank 0 picks 3 while rank 1 holds only 2
    else:  # the gate: rank 0's lane has picked 3 and started its drain
        deadline = time.monotonic() + 30
        while not Path(root, "target", "started-0-3").exists():
            assert time.monotonic() < deadline, "rank 0 never started the drain of step 3"
            time.sleep(0.01)
        lanes.submit(job(3))
    lanes.wait()
    lanes.close()
    return [(r.step, r.committed, r.superseded_by) for r in lanes.results]


@pytest.mark.multiprocess
def test_a_lane_runs_the_job_rank_0_picked_even_before_this_rank_has_it(tmp_path):
    mgr = CheckpointManager([Level(str(tmp_path / "l1"))])
    for s in (1, 2, 3):
        mgr.save(state(s), step=s)
    mgr.close()
    (tmp_path / "target").mkdir()
    out = run_ranks(_lanes_agree, 2, str(tmp_path), timeout=120)
    assert out[0] == out[1] == [(1, True, None), (2, False, 3), (3, True, None)], out


# ---------------------------------------------------------------- crashes


def _kill_when(marker: Path, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, f"child exited early with {child.returncode}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()


@pytest.mark.slow
@pytest.mark.parametrize("waiting", [False, True], ids=["mid-drain", "step-waiting"])
def test_sigkill_loses_no_promise_the_restart_drains_the_newest_due_step(tmp_path, waiting):
    l1, remote = tmp_path / "l1", tmp_path / "remote"
    marker = tmp_path / "marker"
    steps = "2,3" if waiting else "2"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "_latest_child.py"), str(l1), str(remote), str(marker), steps]
    )
    try:
        _kill_when(marker, child)
    finally:
        child.kill()
        child.wait()
    level = Level(
        f"faulty://{remote}/run",
        storage_options={"target_protocol": "file", "target_options": {"auto_mkdir": True}},
    )
    mgr = CheckpointManager([Level(str(l1), keep=1), level])
    assert mgr.steps(1) == [1]  # the drain of 2 died mid-upload; 3 (if any) waited
    newest = 3 if waiting else 2
    loaded = blank()
    assert mgr.load_latest(loaded) == newest
    check(loaded, newest)
    mgr.wait()  # covers the resumed drain: the newest due step, not an older one
    assert mgr.steps(1) == [1, newest]
    mgr.close()


# ---------------------------------------------------------------- bookkeeping


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_saves_with_slow_drains_keep_every_promise(tmp_path, seed):
    # Random schedules of saves and waits over three levels with slow, jittery
    # uploads and retention everywhere. After each wait(): the newest due step is
    # on each level, every kept step there restores bit-exact, and each due step
    # was accounted for exactly once (committed, or superseded by a newer one).
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:6]

    def slow(name: str, **level) -> Level:
        options = {
            "target_protocol": "file",
            "target_options": {"auto_mkdir": True},
            "delay": {"put_file": rng.choice([0.0, 0.01, 0.05])},
            "skip_instance_cache": True,
        }
        return Level(f"faulty://{tmp_path}/{name}-{tag}", storage_options=options, **level)

    levels = [
        Level(str(tmp_path / "l1"), keep=2),
        slow("a", keep=3),
        slow("b", every=3, keep=2, codec="bytegroup"),
    ]
    mgr = CheckpointManager(levels)
    due: dict[int, list[int]] = {1: [], 2: []}
    step = 0
    for _ in range(4):
        for _ in range(rng.randint(1, 6)):
            step += rng.randint(1, 2)
            metrics = mgr.save(state(step), step=step)
            for i in (1, 2):
                if levels[i].url in metrics.drains_started:
                    due[i].append(step)
            if rng.random() < 0.3:
                time.sleep(rng.choice([0.0, 0.05]))
        mgr.wait()
        results = mgr.drain_results
        for i in (1, 2):
            mine = [r for r in results if r.level == levels[i].url]
            assert sorted(r.step for r in mine) == due[i], "each due step accounted for once"
            for r in mine:
                assert r.error is None and not r.skipped
                assert r.committed != r.superseded
                assert r.superseded_by is None or r.superseded_by > r.step
            committed = {r.step for r in mine if r.committed}
            held = mgr.steps(i)
            if due[i]:
                assert held[-1] == due[i][-1], (i, held, due[i])
            assert set(held) <= committed and len(held) == min(levels[i].keep, len(committed))
            for s in held:
                loaded = blank()
                reader = MultiLevelReader(
                    levels[i].checkpoint_url(s), storage_options=levels[i].storage_options
                )
                dcp.load(loaded, storage_reader=reader)
                check(loaded, s)
    mgr.close()
