"""Nothing committed on a level is replaced unasked: drains (store levels on a local
folder and on a real S3 server, delta levels, levels between nodes), ``dcp-multilevel
copy`` and restores onto a node refuse a step committed as another save, naming the
level, the step and both saves; ``overwrite=True`` replaces it atomically (the old
step stays loadable until the new manifest commits); the same save again is fine.

The scenario throughout: a first run saves steps with a first level and a remote
level; a second run (a fresh first level, the same remote: new machines) saves the
same step numbers with other contents.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _faulty_fs  # noqa: F401 - registers faulty://
import fsspec
import pytest
import torch
from click.testing import CliRunner
from conftest import assert_bit_equal

from dcp_multilevel import CheckpointManager, DrainError, Level
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.cli import main
from dcp_multilevel.levels import DrainJob, Lanes, driver_for

if TYPE_CHECKING:
    from _s3 import S3Server

pytest_plugins = ["_s3"]


def state(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(128, 96, generator=g), "b": torch.arange(500) + v, "v": v}


def blank() -> dict:
    return {"w": torch.zeros(128, 96), "b": torch.zeros(500, dtype=torch.long), "v": -1}


def check(loaded: dict, v: int) -> None:
    expected = state(v)
    assert_bit_equal(loaded["w"], expected["w"], "w")
    assert_bit_equal(loaded["b"], expected["b"], "b")
    assert loaded["v"] == v


def snapshot(url: str, options: dict | None = None) -> dict[str, bytes]:
    """Every object below ``url``, by its path relative to it, with its bytes."""
    fs, root = fsspec.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    return {p[len(root) :].lstrip("/"): fs.cat_file(p) for p in fs.find(root)}


def save_id(url: str, options: dict | None = None) -> str:
    return StoredCheckpoint.at(url, options).manifest().save_id


def run(first: Path, remote: Level, values: dict[int, int]) -> CheckpointManager:
    """A run: a manager on a first level at ``first`` and ``remote``, saving
    ``state(values[step])`` at each step; returned with its drains finished or failed."""
    mgr = CheckpointManager([Level(str(first)), remote], drain_policy="wait")
    for step, v in values.items():
        mgr.save(state(v), step=step)
    return mgr


def load_remote(tmp_path: Path, remote: Level) -> tuple[int | None, dict, dict]:
    """``load_latest`` from a fresh first level (new machines) and ``remote``."""
    mgr = CheckpointManager([Level(str(tmp_path / f"fresh-{uuid.uuid4().hex[:6]}")), remote])
    loaded = blank()
    step = mgr.load_latest(loaded)
    sources = dict(mgr.last_load_sources)
    mgr.close()
    return step, loaded, sources


@pytest.fixture(params=["local", "s3"])
def remote_url(request, tmp_path) -> tuple[str, dict]:
    """A remote level's URL and storage options: a local folder, or a bucket on S3."""
    if request.param == "local":
        return str(tmp_path / "remote"), {}
    server: S3Server = request.getfixturevalue("s3_server")
    return f"s3://{server.new_bucket()}/run", server.storage_options


REFUSED = (
    "step 4 to {url}: DrainError: step 4 is committed on level {url} as save {old}; the "
    "drain of save {new} would replace it, so the level keeps it as it is. Move or delete "
    "that step there, or pass Level(..., overwrite=True) to replace it (the old one stays "
    "loadable until the new one commits). The first level still holds these checkpoints."
)


def test_a_second_run_never_replaces_the_remotes_step(tmp_path, remote_url):
    url, options = remote_url
    remote = Level(url, every=2, storage_options=options)
    first = run(tmp_path / "a", remote, {1: 1, 2: 2, 3: 3, 4: 4})
    first.wait()
    first.close()
    old = save_id(f"{url}/step-4", options)
    before = snapshot(f"{url}/step-4", options)

    second = run(tmp_path / "b", remote, {4: 104})
    new = save_id(str(tmp_path / "b" / "step-4"))
    with pytest.raises(DrainError) as info:
        second.wait()
    assert str(info.value) == REFUSED.format(url=url, old=old, new=new)
    (result,) = [r for r in second.drain_results if r.step == 4]
    assert not result.committed
    assert f"step 4 to {url}: {result.error}. The first level" in str(info.value)
    second.close()
    assert snapshot(f"{url}/step-4", options) == before  # bit for bit, no file added
    step, loaded, sources = load_remote(tmp_path, remote)
    assert step == 4 and sources == {StoredCheckpoint.at(f"{url}/step-4", options).url: 3}
    check(loaded, 4)  # the first run's bytes


def test_overwrite_replaces_the_remotes_step_atomically(tmp_path, remote_url):
    url, options = remote_url
    first = run(tmp_path / "a", Level(url, every=2, storage_options=options), {2: 2, 4: 4})
    first.wait()
    first.close()
    old_files = set(snapshot(f"{url}/step-4", options))

    remote = Level(url, every=2, storage_options=options, overwrite=True)
    second = run(tmp_path / "b", remote, {4: 104})
    assert [r.step for r in second.wait() if r.committed] == [4]
    second.close()
    assert save_id(f"{url}/step-4", options) == save_id(str(tmp_path / "b" / "step-4"))
    now = set(snapshot(f"{url}/step-4", options))
    # The old data files are gone after the commit; the new ones had names of their own.
    assert {f for f in old_files if f.startswith("data/")}.isdisjoint(now)
    step, loaded, _ = load_remote(tmp_path, remote)
    assert step == 4
    check(loaded, 104)


def test_a_manager_that_says_overwrite_replaces_on_every_level(tmp_path):
    url = str(tmp_path / "remote")
    first = run(tmp_path / "a", Level(url, every=2), {2: 2})
    first.wait()
    first.close()
    mgr = CheckpointManager([Level(str(tmp_path / "b")), Level(url, every=2)], overwrite=True)
    assert [lv.overwrite for lv in mgr.levels] == [True, True]
    mgr.save(state(102), step=2)
    mgr.save(state(202), step=2)  # the first level's own step too, atomically
    results = mgr.wait()  # each drain replaced the step there (or was superseded)
    assert {r.step for r in results if r.committed} == {2}
    assert [r.error for r in results] == [None] * len(results)
    mgr.close()
    step, loaded, _ = load_remote(tmp_path, Level(url))
    assert step == 2
    check(loaded, 202)


def test_a_replacing_drain_stopped_before_its_commit_leaves_the_old_step(tmp_path, remote_url):
    url, options = remote_url
    first = run(tmp_path / "a", Level(url, every=2, storage_options=options), {2: 2, 4: 4})
    first.wait()
    first.close()
    before = snapshot(f"{url}/step-4", options)
    # The same place through a store whose manifest uploads fail: every data file
    # of the new save arrives, its commit never does.
    protocol, _, path = url.rpartition("://")
    broken = dict(
        target_protocol=protocol or "file",
        target_options=options,
        retries=0,
        skip_instance_cache=True,
        fail_first={"pipe_file": 10**9},
    )
    remote = Level(f"faulty://{path}", every=2, storage_options=broken, overwrite=True)
    second = run(tmp_path / "b", remote, {4: 104})
    with pytest.raises(DrainError, match="RemoteStoreError"):
        second.wait()
    second.close()
    after = snapshot(f"{url}/step-4", options)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing old touched
    assert len(set(after) - set(before)) >= 1  # the new save's files, never committed
    step, loaded, _ = load_remote(tmp_path, Level(url, every=2, storage_options=options))
    assert step == 4
    check(loaded, 4)


def test_draining_the_same_save_again_is_no_replacement(tmp_path):
    first = run(tmp_path / "a", Level(str(tmp_path / "remote"), every=2), {2: 2})
    first.wait()
    first.close()
    target = driver_for(Level(str(tmp_path / "remote")))
    source = StoredCheckpoint.at(str(tmp_path / "a" / "step-2"))
    lanes = Lanes()
    for n in range(2):  # a retry of a drain that had committed, then another
        lanes.submit(DrainJob(2, source, target, f"again-{n}", time.time()))
        results = lanes.wait()
    lanes.close()
    assert [(r.committed, r.error) for r in results] == [(True, None), (True, None)]
    assert save_id(str(tmp_path / "remote" / "step-2")) == source.manifest().save_id
    step, loaded, _ = load_remote(tmp_path, Level(str(tmp_path / "remote")))
    assert step == 2
    check(loaded, 2)


# --------------------------------------------------------------------------- delta levels


def delta_remote(url: str, **kw: Any) -> Level:
    return Level(url, every=2, codec="bytegroup", keyframe_every=2, **kw)


def test_a_delta_drain_never_rebases_onto_a_committed_step(tmp_path):
    # The first run leaves the remote with step 2 whole and step 4 a delta against
    # it. The second run's step 4 would be coded against the remote's step 2 (its
    # reference there): that rebased copy must not replace the first run's step 4.
    url = str(tmp_path / "remote")
    first = run(tmp_path / "a", delta_remote(url), {2: 2, 4: 4})
    first.wait()
    first.close()
    assert StoredCheckpoint.at(f"{url}/step-4").manifest().reference_step == 2
    old = {s: save_id(f"{url}/step-{s}") for s in (2, 4)}
    before = snapshot(url)

    second = run(tmp_path / "b", delta_remote(url), {2: 102, 4: 104})
    with pytest.raises(DrainError) as info:
        second.wait()
    second.close()
    new = {s: save_id(str(tmp_path / "b" / f"step-{s}")) for s in (2, 4)}
    for s in (2, 4):
        assert (
            f"step {s} is committed on level {url} as save {old[s]}; the drain of save "
            f"{new[s]} would replace it" in str(info.value)
        )
    assert snapshot(url) == before
    step, loaded, _ = load_remote(tmp_path, delta_remote(url))
    assert step == 4
    check(loaded, 4)

    third = run(tmp_path / "c", delta_remote(url, overwrite=True), {2: 202, 4: 204})
    assert [r.step for r in third.wait() if r.committed] == [2, 4]
    third.close()
    assert StoredCheckpoint.at(f"{url}/step-4").manifest().reference_step == 2
    step, loaded, _ = load_remote(tmp_path, delta_remote(url))
    assert step == 4
    check(loaded, 204)


# --------------------------------------------------------------------------- copy


def cli(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_copy_onto_another_committed_step_is_refused_and_overwrite_replaces_it(tmp_path):
    first = run(tmp_path / "a", Level(str(tmp_path / "remote"), every=2), {2: 2})
    first.wait()
    first.close()
    other = CheckpointManager([Level(str(tmp_path / "b"))])
    other.save(state(102), step=2)
    other.close()
    dest = tmp_path / "remote" / "step-2"
    before = snapshot(str(dest))
    old, new = save_id(str(dest)), save_id(str(tmp_path / "b" / "step-2"))

    refused = cli("copy", tmp_path / "b" / "step-2", tmp_path / "remote", "--into-root")
    assert refused.exit_code == 1
    assert refused.stderr == (
        f"error: Checkpoint already exists at file://{dest}: it holds a different committed "
        f"checkpoint (save {old}, copying save {new}), and nothing there was changed. Pass "
        "--overwrite to replace it (the old one stays loadable until the new one commits), "
        "delete it first, or pick another destination\n"
    )
    assert snapshot(str(dest)) == before

    done = cli(
        "copy",
        tmp_path / "b" / "step-2",
        tmp_path / "remote",
        "--into-root",
        "--overwrite",
        "--json",
    )
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "replaced"
    assert save_id(str(dest)) == new
    assert snapshot(str(dest)).keys() == snapshot(str(tmp_path / "b" / "step-2")).keys()
    step, loaded, _ = load_remote(tmp_path, Level(str(tmp_path / "remote")))
    assert step == 2
    check(loaded, 102)
    # The same checkpoint again: nothing to do, with or without --overwrite.
    again = cli("copy", tmp_path / "b" / "step-2", dest, "--overwrite", "--json")
    assert json.loads(again.stdout)["status"] == "already-present"


def test_copy_with_overwrite_never_rewrites_a_file_the_old_step_names(tmp_path):
    # A destination whose old checkpoint names a data file the new one names too,
    # with other bytes: replacing it in place would break the old step before the
    # commit, so even --overwrite refuses.
    src = CheckpointManager([Level(str(tmp_path / "src"))])
    src.save(state(1), step=1)
    src.close()
    dest = tmp_path / "dest"
    shutil.copytree(tmp_path / "src" / "step-1" / "data", dest / "data")
    m = StoredCheckpoint.at(str(tmp_path / "src" / "step-1")).manifest()
    StoredCheckpoint.at(str(dest)).commit(  # another save, the same file names
        m.metadata,
        m.locations,
        m.files,
        save_id="20260101T000000-0123456789ab",
        world_size=m.world_size,
    )
    (data,) = (dest / "data").iterdir()
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 0xFF
    data.write_bytes(bytes(damaged))
    before = snapshot(str(dest))
    result = cli("copy", tmp_path / "src" / "step-1", dest, "--overwrite")
    assert result.exit_code == 1
    assert re.fullmatch(
        f"error: Checkpoint already exists at file://{dest}, and replacing it would rewrite "
        r"its data file 'data/[^']+' before the new manifest commits \(the old checkpoint "
        r"would be damaged if the copy stopped\); nothing there was changed. Delete it "
        r"first, or pick another destination\n",
        result.stderr,
    ), result.stderr
    assert snapshot(str(dest)) == before
    assert os.path.exists(dest / "manifest.json")


# --------------------------------------------------------------------------- between nodes

# Two ranks, one per simulated node (``DCP_ML_NODE``; ``{node}`` in the paths).


def node_levels(root: str, first: str, **partner: Any) -> list[Level]:
    return [
        Level(f"{root}/n{{node}}/{first}"),
        Level(f"partner:{root}/n{{node}}/partner", replicas=2, **partner),
    ]


def _node_save_job(
    rank: int, world: int, root: str, first: str, v: int, overwrite: bool
) -> tuple[str | None, str]:
    """Save step 1 as ``state(v)``; (the drain error or None, this node's save id)."""
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(node_levels(root, first, overwrite=overwrite), drain_policy="wait")
    mgr.save(state(v), step=1)
    try:
        mgr.wait()
        error = None
    except DrainError as e:
        error = str(e)
    mgr.close()
    return error, save_id(f"{root}/n{rank}/{first}/step-1") if rank == 0 else ""


def _node_load_job(rank: int, world: int, root: str, first: str) -> tuple[Any, ...]:
    """load_latest: (step, the first value, None) or (None, None, the error's text)."""
    os.environ["DCP_ML_NODE"] = str(rank)
    mgr = CheckpointManager(node_levels(root, first))
    loaded = blank()
    try:
        step = mgr.load_latest(loaded)
    except Exception as e:  # noqa: BLE001 - the test compares every rank's error
        mgr.close()
        return None, None, f"{type(e).__name__}: {e}"
    mgr.close()
    return step, int(loaded["v"]), None


@pytest.mark.multiprocess
def test_a_partner_drain_never_replaces_another_saves_copies(tmp_path):
    from _dist import run_ranks

    root = str(tmp_path)
    out = run_ranks(_node_save_job, 2, root, "l1a", 1, False, timeout=240)
    assert [o[0] for o in out] == [None, None]
    partner = {n: snapshot(f"{root}/n{n}/partner") for n in (0, 1)}
    old = save_id(f"{root}/n0/partner/step-1")

    out = run_ranks(_node_save_job, 2, root, "l1b", 101, False, timeout=240)
    new = out[0][1]
    expected = [
        f"step 1 to {url}: DrainError: step 1 is committed on level {url} as save {old}; "
        f"the drain of save {new} would replace it, so the level keeps it as it is. Move or "
        "delete that step there, or pass Level(..., overwrite=True) to replace it (the old "
        "one stays loadable until the new one commits). The first level still holds these "
        "checkpoints."
        for url in (f"partner:{root}/n0/partner", f"partner:{root}/n1/partner")
    ]  # each rank names the level as it sees it ({node}: its own)
    assert [o[0] for o in out] == expected
    assert {n: snapshot(f"{root}/n{n}/partner") for n in (0, 1)} == partner

    out = run_ranks(_node_save_job, 2, root, "l1c", 201, True, timeout=240)
    assert [o[0] for o in out] == [None, None]
    for n in (0, 1):
        assert save_id(f"{root}/n{n}/partner/step-1") == out[0][1]
    # Node 1 is replaced: its files come back from node 0's copies of the new save.
    shutil.rmtree(tmp_path / "n1")
    assert run_ranks(_node_load_job, 2, root, "l1c", timeout=240) == [(1, 201, None)] * 2


@pytest.mark.multiprocess
def test_a_restore_never_writes_into_another_saves_step_on_a_node(tmp_path):
    from _dist import run_ranks

    root = str(tmp_path)
    out = run_ranks(_node_save_job, 2, root, "l1", 1, False, timeout=240)
    assert [o[0] for o in out] == [None, None]
    # Node 1 is replaced by a machine whose disk holds step 1 of another run.
    shutil.rmtree(tmp_path / "n1")
    other = CheckpointManager([Level(str(tmp_path / "other"))])
    other.save(state(77), step=1)
    other.close()
    shutil.copytree(tmp_path / "other" / "step-1", tmp_path / "n1" / "l1" / "step-1")
    before = snapshot(str(tmp_path / "n1"))
    stale, wanted = save_id(str(tmp_path / "other" / "step-1")), out[0][1]

    out = run_ranks(_node_load_job, 2, root, "l1", timeout=240)
    url = f"file://{root}/n1/l1/step-1"
    expected = (
        f"CheckpointExistsError: Checkpoint already exists at {url} (node 1's first level "
        f"holds step 1 as save {stale}); restoring save {wanted} of step 1 there would "
        "replace it, so the restore stops before anything moves. Move that step aside on "
        "that node (it may be the only copy of an earlier run), then load again."
    )
    assert out == [(None, None, expected)] * 2
    assert snapshot(str(tmp_path / "n1")) == before
    # Moved aside, the step restores.
    shutil.move(tmp_path / "n1" / "l1" / "step-1", tmp_path / "stale-step-1")
    assert run_ranks(_node_load_job, 2, root, "l1", timeout=240) == [(1, 1, None)] * 2


def _erasure_save_job(
    rank: int, world: int, root: str, first: str, v: int, overwrite: bool
) -> str | None:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = [
        Level(f"{root}/n{{node}}/{first}"),
        Level(f"erasure:{root}/n{{node}}/erasure", data=2, parity=1, overwrite=overwrite),
    ]
    mgr = CheckpointManager(levels, drain_policy="wait")
    mgr.save(state(v), step=1)
    try:
        mgr.wait()
        return None
    except DrainError as e:
        return str(e)
    finally:
        mgr.close()


def _erasure_load_job(rank: int, world: int, root: str, first: str) -> tuple[int | None, int]:
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = [
        Level(f"{root}/n{{node}}/{first}"),
        Level(f"erasure:{root}/n{{node}}/erasure", data=2, parity=1),
    ]
    mgr = CheckpointManager(levels)
    loaded = blank()
    step = mgr.load_latest(loaded)
    mgr.close()
    check(loaded, int(loaded["v"]))
    return step, int(loaded["v"])


@pytest.mark.multiprocess
def test_an_erasure_drain_refuses_or_replaces_with_parity_of_its_own(tmp_path):
    from _dist import run_ranks

    root = str(tmp_path)
    assert run_ranks(_erasure_save_job, 3, root, "l1a", 1, False, timeout=300) == [None] * 3
    parity = {n: snapshot(f"{root}/n{n}/erasure") for n in range(3)}
    errors = run_ranks(_erasure_save_job, 3, root, "l1b", 101, False, timeout=300)
    assert all(
        "step 1 is committed on level erasure:" in e and "would replace it" in e for e in errors
    ), errors
    assert {n: snapshot(f"{root}/n{n}/erasure") for n in range(3)} == parity

    assert run_ranks(_erasure_save_job, 3, root, "l1c", 201, True, timeout=300) == [None] * 3
    # The new save's blocks and descriptions have names of their own; the old ones went.
    names = sorted(p.name for p in (tmp_path / "n2/erasure/step-1/parity").iterdir())
    assert len(names) == 3 and not set(names) & {"0-2.bin", "group-0.json", "group-1.json"}
    assert all(re.fullmatch(r"(0-2|group-[01])\.[0-9a-f]{12}\.(bin|json)", n) for n in names)
    # Node 0 is replaced: its files are rebuilt from the new save's parity.
    shutil.rmtree(tmp_path / "n0")
    assert run_ranks(_erasure_load_job, 3, root, "l1c", timeout=300) == [(1, 201)] * 3
