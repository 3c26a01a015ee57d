"""Levels through the plugin alone: plain ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``
with ``MultiLevelWriter(levels=...)`` / ``MultiLevelReader(levels=...)``.

Real processes (gloo), real files, a real S3-speaking server on loopback: each
simulated node is a directory (``DCP_ML_NODE`` per process, ``{node}`` in the
level paths), losing a node is deleting its directory. A new writer is built
for every save, as training stacks do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_node_loss import _blank, _state
from torch.distributed.checkpoint.api import CheckpointException

import dcp_multilevel
from dcp_multilevel import (
    CheckpointManager,
    ConfigError,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.levels import Topology
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import run_ranks

pytest_plugins = ["_s3"]

HERE = Path(__file__).parents[1]  # tests/


def _levels(root: str, kind: str, options: dict, remote: str, remote_options: dict) -> list:
    return [
        Level(f"{root}/n{{node}}/l1", keep=2),
        Level(f"{kind}:{root}/n{{node}}/{kind}", keep=2, **options),
        Level(remote, every=2, keep=2, codec="bytegroup", storage_options=remote_options),
    ]


def _save_job(rank: int, world: int, per_node: int, levels: list, steps: list[int]) -> list:
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    for step in steps:  # a new writer for every save
        writer = MultiLevelWriter(f"step-{step}", levels=levels)
        dcp.save(_state(step), storage_writer=writer)
    results = dcp_multilevel.wait()
    return sorted((r.step, r.level, r.committed, r.superseded_by, r.error) for r in results)


def _load_job(rank: int, world: int, per_node: int, levels: list, path: str | None) -> tuple:
    os.environ["DCP_ML_NODE"] = str(rank // per_node)
    newest = dcp_multilevel.newest_step(levels)
    state = _blank()
    reader = MultiLevelReader(path, levels=levels)
    dcp.load(state, storage_reader=reader)
    dcp_multilevel.wait()  # the copies a restore makes again
    assert reader.loads is not None and reader.loads.restore is not None
    step = reader.loads.restore.step
    received = reader.loads.last_restore.received if reader.loads.last_restore else {}
    return step, bit_equal(state, _state(step)), received, reader.last_load_sources, newest


@pytest.mark.multiprocess
@pytest.mark.parametrize("remote_kind", ["folder", "s3"])
def test_plain_dcp_saves_reach_every_level_and_a_lost_node_loads_bit_exact(
    tmp_path, remote_kind, request
):
    root = str(tmp_path)
    if remote_kind == "s3":
        server = request.getfixturevalue("s3_server")
        remote, remote_options = f"s3://{server.new_bucket()}/run", server.storage_options
    else:
        remote, remote_options = f"{root}/remote", {}
    levels = _levels(root, "partner", {"replicas": 2}, remote, remote_options)
    out = run_ranks(_save_job, 4, 2, levels, [1, 2, 3, 4], timeout=240)
    drained = {(step, level) for step, level, ok, _, err in out[0] if ok and err is None}
    assert {s for s, lv in drained if lv == remote} == {2, 4}  # every 2nd save of the list
    assert all(err is None for o in out for *_, err in o), out
    for node in (0, 1):  # keep=2 (the first level keeps a step until it is above too)
        assert {"step-3", "step-4"} <= set(os.listdir(tmp_path / f"n{node}/l1"))
        assert len(os.listdir(tmp_path / f"n{node}/l1")) <= 3
        assert sorted(os.listdir(tmp_path / f"n{node}/partner")) == ["step-3", "step-4"]
    shutil.rmtree(tmp_path / "n1")  # lost; a new, empty node replaces it
    out = run_ranks(_load_job, 4, 2, levels, None, timeout=240)
    assert [o[:2] for o in out] == [(4, True)] * 4, out
    assert [o[4] for o in out] == [4] * 4  # newest_step: what node 0 lists, on every rank
    partner = f"partner:{root}/n{{node}}/partner (node 0)"
    assert all(partner in o[2] for o in out[2:]), out  # node 1's files from node 0's copies
    # The restore made node 1's copies again: losing node 0 now still loads step 4.
    shutil.rmtree(tmp_path / "n0")
    out = run_ranks(_load_job, 4, 2, levels, "step-4", timeout=240)
    assert [o[:2] for o in out] == [(4, True)] * 4, out


@pytest.mark.multiprocess
def test_plain_dcp_saves_with_erasure_rebuild_a_lost_node(tmp_path):
    root = str(tmp_path)
    levels = _levels(root, "erasure", {"data": 2, "parity": 1}, f"{root}/remote", {})
    out = run_ranks(_save_job, 3, 1, levels, [1, 2, 3], timeout=240)
    for node, results in enumerate(out):  # one rank per node
        erasure = f"erasure:{root}/n{node}/erasure"
        # Drain policy "latest": step 2 waited for the erasure level while step 1
        # drained there, and step 3, due there too, may have gone in its place.
        assert results[2] in [(2, erasure, True, None, None), (2, erasure, False, 3, None)]
        assert results[:2] + results[3:] == [
            (1, erasure, True, None, None),
            (2, f"{root}/remote", True, None, None),  # every 2nd save
            (3, erasure, True, None, None),
        ], results
        held = sorted(f"step-{s}" for s, level, ok, *_ in results if level == erasure and ok)
        assert sorted(os.listdir(tmp_path / f"n{node}/erasure")) == held[-2:]  # keep=2
    assert os.listdir(tmp_path / "remote") == ["step-2"]
    shutil.rmtree(tmp_path / "n2")
    out = run_ranks(_load_job, 3, 1, levels, None, timeout=240)
    assert [o[:2] for o in out] == [(3, True)] * 3, out
    erasure = f"erasure:{root}/n{{node}}/erasure (rebuilt from nodes "
    assert any(source.startswith(erasure) for source in out[2][2]), out[2][2]


def _async_job(rank: int, world: int, root: str) -> list:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = [Level(f"{root}/n{{node}}/l1"), Level(f"partner:{root}/n{{node}}/partner")]
    group = dist.new_group(backend="gloo")  # DCP's background thread saves over its own
    writer = MultiLevelWriter(levels=levels)  # one writer, reused: its buffers too
    for step in (1, 2):
        state = _state(step)
        future = dcp.async_save(
            state, storage_writer=writer, checkpoint_id=f"step-{step}", process_group=group
        )
        for t in (state["w"], *state["layers"].values()):
            t.add_(1000.0)  # training goes on: the save holds the staged values
        future.result()
    return sorted((r.step, r.committed, r.error) for r in dcp_multilevel.wait())


@pytest.mark.multiprocess
def test_async_saves_through_the_plugin_drain_and_restore(tmp_path):
    root = str(tmp_path)
    out = run_ranks(_async_job, 2, root, timeout=240)
    assert out[0] == [(1, True, None), (2, True, None)], out
    shutil.rmtree(tmp_path / "n1")
    levels = [Level(f"{root}/n{{node}}/l1"), Level(f"partner:{root}/n{{node}}/partner")]
    out = run_ranks(_load_job, 2, 1, levels, "latest", timeout=240)
    assert [o[:2] for o in out] == [(2, True)] * 2, out


def _differing_job(rank: int, world: int, root: str) -> str:
    levels = [Level(f"{root}/l1"), Level(f"{root}/remote", every=rank + 1)]
    with pytest.raises(ConfigError) as info:
        MultiLevelWriter("step-1", levels=levels)
    return str(info.value)


@pytest.mark.multiprocess
def test_level_lists_that_differ_between_ranks_are_refused_naming_each_rank(tmp_path):
    root = str(tmp_path)
    out = run_ranks(_differing_job, 2, root, timeout=120)
    assert (
        out[0]
        == out[1]
        == (
            "MultiLevelWriter(levels=...): the level lists differ between ranks; every rank must "
            f"pass the same levels: rank 0: [Level('{root}/l1'), Level('{root}/remote')]; "
            f"rank 1: [Level('{root}/l1'), Level('{root}/remote', every=2)]"
        )
    )
    assert not (tmp_path / "l1").exists()  # nothing was written


def test_a_changed_level_list_under_the_same_first_level_is_refused(tmp_path):
    first = Level(str(tmp_path / "l1"))
    dcp.save(_state(1), storage_writer=MultiLevelWriter("step-1", levels=[first]))
    other = [first, Level(str(tmp_path / "remote"))]
    with pytest.raises(ConfigError) as info:
        MultiLevelWriter("step-2", levels=other)
    assert str(info.value) == (
        f"MultiLevelWriter(levels=[Level('{tmp_path}/l1'), Level('{tmp_path}/remote')]): this "
        f"process saves under the first level '{tmp_path}/l1' with the levels "
        f"[Level('{tmp_path}/l1')]; a process keeps one level list per first level (its drains "
        "and retention follow that list). Pass the same levels, or close the "
        "CheckpointManager using the others first"
    )
    assert sorted(os.listdir(tmp_path / "l1")) == ["step-1"]


def test_a_path_outside_the_first_level_or_naming_no_step_is_refused(tmp_path):
    levels = [Level(str(tmp_path / "l1")), Level(str(tmp_path / "remote"))]
    with pytest.raises(ConfigError) as info:
        MultiLevelWriter(str(tmp_path / "elsewhere" / "step-3"), levels=levels)
    assert str(info.value) == (
        f"'{tmp_path}/elsewhere/step-3' is not below the first level's root '{tmp_path}/l1': "
        "with levels, pass the step's name alone ('step-3': the same name below every level's "
        f"root), or a path or URL whose folder is '{tmp_path}/l1'"
    )
    with pytest.raises(ConfigError) as info:
        MultiLevelReader("checkpoint_3", levels=levels)
    assert str(info.value) == (
        "'checkpoint_3' names no step: with levels, a checkpoint is 'step-<N>' below each "
        f"level's root (the first: '{tmp_path}/l1'); pass 'step-<N>' (the same name on every "
        "level), or that name below the first level's root"
    )
    # Below the first level's root, spelled as a path: the same step.
    writer = MultiLevelWriter(str(tmp_path / "l1" / "step-3"), levels=levels)
    assert writer.checkpoint_id == f"{tmp_path}/l1/step-3"
    assert not (tmp_path / "l1").exists() and not (tmp_path / "remote").exists()


def test_a_partner_level_on_one_node_is_refused(tmp_path):
    levels = [Level(f"{tmp_path}/{{node}}/l1"), Level(f"partner:{tmp_path}/{{node}}/p")]
    with pytest.raises(ConfigError, match="keeps copies on other nodes, but every rank is on"):
        MultiLevelWriter("step-1", levels=levels, topology=Topology((0,)))
    assert not os.path.exists(tmp_path / "0")


def test_every_counts_the_saves_of_the_level_list(tmp_path):
    levels = [Level(str(tmp_path / "l1"), keep=1), Level(str(tmp_path / "remote"), every=3)]
    for step in (10, 20, 30, 40, 50, 60):
        dcp.save(_state(step), storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
    dcp_multilevel.wait()
    assert sorted(os.listdir(tmp_path / "remote")) == ["step-30", "step-60"]
    assert sorted(os.listdir(tmp_path / "l1")) == ["step-60"]
    # A restarted job goes on counting from the step it loads (the manifest kept it).
    state = _blank()
    dcp.load(state, storage_reader=MultiLevelReader(levels=levels))
    assert bit_equal(state, _state(60))


def test_a_manager_and_plain_writers_of_the_same_levels_share_their_drains(tmp_path):
    levels = [Level(str(tmp_path / "l1")), Level(str(tmp_path / "remote"))]
    mgr = CheckpointManager(levels, drain_policy="wait")
    mgr.save(_state(1), step=1)
    dcp.save(_state(2), storage_writer=MultiLevelWriter("step-2", levels=levels))
    results = [r for r in dcp_multilevel.wait() if r.level == levels[1].url]
    assert [(r.step, r.committed) for r in results] == [(1, True), (2, True)]
    assert [r.step for r in mgr.drain_results] == [1, 2]  # one runtime: the manager sees both
    mgr.close()
    state = _blank()
    dcp.load(state, storage_reader=MultiLevelReader(levels=levels))
    assert bit_equal(state, _state(2))


CHILD = """
import sys, torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, {tests!r})
import _faulty_fs  # registers faulty://
from dcp_multilevel import Level, MultiLevelWriter
levels = [Level({l1!r}), Level({remote!r}, storage_options={options!r})]
for step in (1, 2):
    state = {{"w": torch.full((64, 64), float(step))}}
    dcp.save(state, storage_writer=MultiLevelWriter(f"step-{{step}}", levels=levels))
# no dcp_multilevel.wait(): the process exits right after its last save
"""


def _exit_after_save(tmp_path, remote: str, options: dict) -> subprocess.CompletedProcess:
    code = textwrap.dedent(CHILD).format(
        tests=str(HERE), l1=str(tmp_path / "l1"), remote=remote, options=options
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_process_that_exits_right_after_its_last_save_finishes_its_drains(tmp_path):
    options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "delay": {"put_file": 0.5},
    }
    remote = f"faulty://{tmp_path}/remote"
    done = _exit_after_save(tmp_path, remote, options)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "remote" / "step-2" / "manifest.json").exists()
    assert (tmp_path / "remote" / "step-1" / "manifest.json").exists()


def test_a_process_that_exits_with_drains_failing_names_what_did_not_land(tmp_path):
    options = {
        "target_protocol": "file",
        "target_options": {"auto_mkdir": True},
        "fail_first": {"put_file": 1000},
    }
    remote = f"faulty://{tmp_path}/remote"
    done = _exit_after_save(tmp_path, remote, options)
    assert done.returncode == 0, done.stderr
    assert "at exit, checkpoints did not reach their levels" in done.stderr, done.stderr
    for step in (1, 2):
        assert f"step {step} to {remote}:" in done.stderr, done.stderr
    assert not (tmp_path / "remote" / "step-2" / "manifest.json").exists()


def test_reading_the_latest_step_without_any_is_an_error_not_a_fresh_start(tmp_path):
    levels = [Level(str(tmp_path / "l1")), Level(str(tmp_path / "remote"))]
    assert dcp_multilevel.newest_step(levels) is None  # what a resume asks first
    with pytest.raises(CheckpointException) as info:  # DCP's, quoting the reader's error
        dcp.load(_blank(), storage_reader=MultiLevelReader(levels=levels))
    (failure,) = info.value.failures.values()
    assert "no level holds a checkpoint" in str(
        failure[0] if isinstance(failure, tuple) else failure
    )


def _books_job(rank: int, world: int, root: str, saves: int) -> tuple:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = [Level(f"{root}/n{{node}}/l1", keep=2), Level(f"{root}/remote", keep=2)]
    state = {f"w{rank}": torch.zeros(16)}
    for step in range(1, saves + 1):
        state[f"w{rank}"].fill_(step)
        dcp.save(state, storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
    dcp_multilevel.wait()
    (runtime,) = dcp_multilevel.levels.runtime.runtimes()
    books = runtime.books
    pending = runtime.follower.pending() + list(runtime.follower._unswept)
    return len(books._decided), max(len(s) for s in books._known.values()), len(pending)


@pytest.mark.multiprocess
def test_a_ladder_keeps_no_books_per_save(tmp_path):
    # 40 saves onto two levels, on every rank: what the process keeps about them is
    # bounded by what the levels hold (keep=2, and a step kept until it is above too),
    # not by the number of saves; rank 0 removed every save's values from the store
    # but the last one's (which the next save removes).
    out = run_ranks(_books_job, 2, str(tmp_path), 40, timeout=240)
    for decided, known, pending in out:
        assert decided <= 3 and known <= 3 and pending <= 1, out
    remote = os.listdir(tmp_path / "remote")  # keep=2; a busy lane takes the newest step
    assert len(remote) == 2 and "step-40" in remote, remote


def test_a_level_writer_takes_what_the_first_level_sets_from_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        MultiLevelWriter("step-1", levels=[Level(str(tmp_path / "l1"))], codec="zstd")
    assert str(info.value) == (
        "MultiLevelWriter(levels=...) takes codec from the first level: set them on it "
        "(Level(..., codec=..., storage_options=...); deltas: keyframe_every)"
    )
    with pytest.raises(ConfigError, match=r"^MultiLevelWriter needs a path \(or levels=\[...\]\)$"):
        MultiLevelWriter()


RANKS_CHILD = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from dcp_multilevel import Level, MultiLevelWriter
root, rank = sys.argv[1], int(os.environ["RANK"])
os.environ["DCP_ML_NODE"] = str(rank)
dist.init_process_group("gloo")
levels = [Level(f"{root}/n{{node}}/l1"), Level(f"partner:{root}/n{{node}}/partner"),
          Level(f"{root}/remote")]
for step in (1, 2):
    state = {"w": torch.full((256, 256), float(step + rank))}
    dcp.save(state, storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
# exits right after its last save: no dcp_multilevel.wait(), no destroy_process_group
"""


@pytest.mark.multiprocess
def test_ranks_that_exit_right_after_their_last_save_finish_every_levels_copy(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(RANKS_CHILD)
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for level in ("n0/partner", "n1/partner", "remote"):
        assert (tmp_path / level / "step-2" / "manifest.json").exists(), level


def test_due_levels_must_be_higher_levels(tmp_path):
    levels = [Level(str(tmp_path / "l1")), Level(str(tmp_path / "remote"))]
    with pytest.raises(ConfigError) as info:
        MultiLevelWriter("step-1", levels=levels, due=[0, 2])
    assert str(info.value) == (
        f"due=[0, 2]: [0, 2] are not indices of higher levels of [Level('{tmp_path}/l1'), "
        f"Level('{tmp_path}/remote')] (1 to 1; the first level takes every save)"
    )
    writer = MultiLevelWriter("step-1", levels=levels, due=[])  # the first level alone
    dcp.save({"w": torch.ones(4)}, storage_writer=writer)
    dcp_multilevel.wait()
    assert not (tmp_path / "remote").exists()


def test_first_level_retention_spares_the_saves_in_progress(tmp_path):
    # Retention runs in the background after each commit, beside the next save: the
    # directory of a save in progress (no manifest yet) of a step older than the
    # newest committed one is not taken for one a crash abandoned.
    levels = [Level(str(tmp_path / "l1"), keep=1)]
    for step in (10, 11):
        dcp.save(_state(step), storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
    dcp_multilevel.wait()
    (runtime,) = [lad for lad in dcp_multilevel.levels.runtime.runtimes() if lad.given == levels]
    runtime.begin(5)  # a save of step 5 has begun: its files are being written
    (tmp_path / "l1" / "step-5" / "data").mkdir(parents=True)
    (tmp_path / "l1" / "step-5" / "data" / "0-0.abc.bin").write_bytes(b"x" * 64)
    (tmp_path / "l1" / "step-3").mkdir()  # a crash's leftover: swept
    assert runtime.books.retain(0) == [3]
    assert sorted(os.listdir(tmp_path / "l1")) == ["step-11", "step-5"]
    dcp_multilevel.wait()  # the save of step 5 never ends: its ticket is dropped
    assert runtime.follower.pending() == []


def _process_mode_job(rank: int, world: int, root: str) -> str:
    import multiprocessing

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's daemon rendezvous
    multiprocessing.current_process().daemon = False  # ranks are daemonic: DCP starts one
    levels = [Level(f"{root}/l1"), Level(f"{root}/remote")]
    writer = MultiLevelWriter(levels=levels)
    future = dcp.async_save(
        {"w": torch.ones(8)},
        storage_writer=writer,
        checkpoint_id="step-1",
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    with pytest.raises(ConfigError) as info:
        future.result()
    return str(info.value)


def test_async_saves_with_levels_refuse_dcps_daemon_process(tmp_path):
    (message,) = run_ranks(_process_mode_job, 1, str(tmp_path), timeout=180)
    assert message == (
        "dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS) with "
        "MultiLevelWriter(levels=...): the levels' drains run in this process, which DCP's "
        "daemon would never tell that a save committed; use AsyncCheckpointerType.THREAD "
        "(the default)"
    )
    assert not (tmp_path / "l1" / "step-1" / "manifest.json").exists()
