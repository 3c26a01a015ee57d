"""The fault matrix: a job killed at each phase of a save, a drain or a restore,
one node lost, then resumed as the README shows it; the newest restorable step
loads bit-exact and the next steps commit on every level (``docs/levels.md``,
"What survives each fault").

Real processes (gloo), real files: each simulated node is a directory
(``DCP_ML_NODE``, one rank per node, ``{node}`` in the level paths), losing a
node is deleting its directory. A job dies at a phase by ``DCP_ML_STOP_AT``:
every rank kills itself there (``SIGKILL``), which ``run_ranks`` reports as a
``RankError``.

A step's drains to the level between nodes and to the remote store run side by
side, on a lane each. When the job dies in one of them, what the resume loads
depends on whether the other had committed the step: the tests order the two
lanes (:func:`_order_lanes`) and check both outcomes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_multilevel
from dcp_multilevel import Level, MultiLevelReader, MultiLevelWriter
from dcp_multilevel._phases import STOP_ENV
from dcp_multilevel.levels import node_level as node_local
from dcp_multilevel.levels import store
from dcp_multilevel.testing.levels import bit_equal
from tests._dist import RankError, run_ranks

pytestmark = pytest.mark.multiprocess

#: The step the first job dies in; steps 1-4 before it are on every level.
CRASH = 5

#: Each level kind between nodes: (nodes, one rank each; the level's options).
KINDS = {
    "partner": (2, {"replicas": 2}),
    "erasure": (3, {"data": 2, "parity": 1}),
}

#: The first job's saves and the resumed job's differ (``run``): a step the resume
#: saves again must hold the resumed job's tensors, not the lost timeline's.
FIRST, RESUMED = 0, 1


def _state(step: int, rank: int, run: int) -> dict:
    """Each rank's own tensors (lost with its node) and a replicated one."""
    g = torch.Generator().manual_seed(10_000 * run + 100 * step + rank)
    shared = torch.Generator().manual_seed(10_000 * run + step)
    return {
        f"w{rank}": torch.randn(48, 64, generator=g),
        f"b{rank}": torch.randn(700, generator=g).to(torch.bfloat16),
        "shared": torch.randn(300, generator=shared),
        "step": step,
    }


def _blank(rank: int) -> dict:
    return {
        f"w{rank}": torch.zeros(48, 64),
        f"b{rank}": torch.zeros(700, dtype=torch.bfloat16),
        "shared": torch.zeros(300),
        "step": -1,
    }


def _urls(root: str, kind: str) -> tuple[str, str, str]:
    """The level URLs as the user writes them: first level, between nodes, remote."""
    return f"{root}/n{{node}}/l1", f"{kind}:{root}/n{{node}}/{kind}", f"{root}/remote"


def _levels(root: str, kind: str) -> list[Level]:
    first, between, remote = _urls(root, kind)
    return [
        Level(first, keep=3),
        Level(between, keep=3, **KINDS[kind][1]),
        Level(remote, every=1, keep=3),  # a store every node reaches (stands in for s3://)
    ]


def _save(rank: int, step: int, levels: list[Level], mode: str, run: int) -> list:
    """Save ``step`` as a user does, then wait for its drains; their outcomes."""
    writer = MultiLevelWriter(f"step-{step}", levels=levels)
    if mode == "async":
        dcp.async_save(_state(step, rank, run), storage_writer=writer).result()
    else:
        dcp.save(_state(step, rank, run), storage_writer=writer)
    return dcp_multilevel.wait()


def _committed(paths: list[str], bound_s: float = 60.0) -> None:
    """Wait until every manifest in ``paths`` exists (a level committed the step there)."""
    deadline = time.monotonic() + bound_s
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"not committed within {bound_s:g} s: {paths}"
        time.sleep(0.02)


def _order_lanes(root: str, kind: str, stop: str, other: str, nodes: int) -> None:
    """Order step 5's two drains in this rank's process: the one killed at ``stop``
    reaches its phase only after the other lane committed (``other="committed"``),
    or the other lane is held before its commit until the kill (``"pending"``)."""
    between = [f"{root}/n{n}/{kind}/step-{CRASH}/manifest.json" for n in range(nodes)]
    remote = [f"{root}/remote/step-{CRASH}/manifest.json"]
    if stop == kind:  # killed in the copy between nodes; the other lane drains to remote
        killed, held, held_phase, other_manifests = node_local, store, "drain", remote
    else:  # killed in the remote drain; the other lane copies between nodes
        killed, held, held_phase, other_manifests = store, node_local, kind, between
    real = killed.reached

    if other == "committed":

        def after_the_other(phase: str, step: int | None) -> None:
            if phase == stop and step == CRASH:
                _committed(other_manifests)
            real(phase, step)

        killed.reached = after_the_other
    else:

        def hold(phase: str, step: int | None) -> None:
            if phase == held_phase and step == CRASH:
                time.sleep(120)  # until the other lane's phase kills this process
            real(phase, step)

        held.reached = hold


def _first_job(
    rank: int, world: int, root: str, kind: str, mode: str, stop: str | None, other: str | None
) -> None:
    """Steps 1-4 on every level, then step 5, killed at ``stop`` (None: not killed)."""
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = _levels(root, kind)
    for step in range(1, CRASH):
        _save(rank, step, levels, mode, FIRST)
    if stop is not None:
        if other is not None:
            _order_lanes(root, kind, stop, other, world)
        os.environ[STOP_ENV] = f"{stop}@{CRASH}"
    _save(rank, CRASH, levels, mode, FIRST)


def _resume(levels: list[Level], rank: int) -> int:
    """The README's resume; the step every rank loaded, checked bit-exact."""
    assert dcp_multilevel.newest_step(levels) is not None
    state = _blank(rank)
    reader = MultiLevelReader("latest", levels=levels)
    dcp.load(state, storage_reader=reader)
    step = reader.loads.restore.step
    assert bit_equal(state, _state(step, rank, FIRST)), f"rank {rank}: step {step} not bit-exact"
    return step


def _killed_in_restore(rank: int, world: int, root: str, kind: str) -> None:
    os.environ["DCP_ML_NODE"] = str(rank)
    os.environ[STOP_ENV] = "restore"
    _resume(_levels(root, kind), rank)


def _resumed_job(rank: int, world: int, root: str, kind: str, mode: str) -> dict:
    """Resume, save the next 3 steps (each waited for), then load afresh the newest
    step and the first one saved again."""
    os.environ["DCP_ML_NODE"] = str(rank)
    levels = _levels(root, kind)
    resumed = _resume(levels, rank)
    drains, again = {}, set()
    for step in range(resumed + 1, resumed + 4):
        results = _save(rank, step, levels, mode, RESUMED)
        drains[step] = sorted((r.level, r.committed, r.error) for r in results if r.step == step)
        again |= {(r.level, r.committed, r.error) for r in results if r.step == resumed}
    exact = {}
    for step in (resumed + 1, resumed + 3):
        state = _blank(rank)
        dcp.load(state, storage_reader=MultiLevelReader(f"step-{step}", levels=levels))
        exact[step] = bit_equal(state, _state(step, rank, RESUMED))
    return {"resumed": resumed, "drains": drains, "exact": exact, "again": sorted(again)}


#: (phase, the other lane's state at the kill, the step the resume loads, the levels
#: that step is drained to again after the resume). "level" is the kind's own phase
#: (partner copy, erasure parity), "drain" the remote's. A restore onto the replaced
#: node makes the copies or parity it held for the others again ("between").
CASES = [
    ("write", None, CRASH - 1, {"between"}),  # step 5 was never committed
    ("commit", None, CRASH - 1, {"between"}),  # on the first level only: node 1's part lost
    # The remote holds step 5; the load reads node 1's part from there, so its first
    # level lacks those files, and nothing is copied again (the next save is).
    ("level", "committed", CRASH, set()),
    ("level", "pending", CRASH - 1, {"between"}),
    # The level between nodes holds step 5; the remote's drain of it is made again.
    ("drain", "committed", CRASH, {"between", "remote"}),
    ("drain", "pending", CRASH - 1, {"between"}),
    ("restore", None, CRASH, {"between"}),  # step 5 is on every level; restored again
]


def _params():
    for kind in KINDS:
        for mode in ("sync", "async"):
            for phase, other, expected, again in CASES:
                words = {"level": kind, "drain": "remote-drain"}.get(phase, phase)
                after = {"level": "remote", "drain": kind}.get(phase, "")
                name = f"{kind}-{mode}-{words}" + (f"-{after}-{other}" if other else "")
                yield pytest.param(kind, mode, phase, other, expected, again, id=name)


def _step_dirs(root: Path) -> tuple[set[str], set[str]]:
    """The levels' directories of step 5 (``n0/l1``, ``remote``): those committed (with
    a manifest), and those holding only files (an unfinished save or drain)."""
    committed, unfinished = set(), set()
    for step_dir in root.glob(f"**/step-{CRASH}"):
        where = str(step_dir.parent.relative_to(root))
        if (step_dir / "manifest.json").exists():
            committed.add(where)
        elif any(p.is_file() for p in step_dir.rglob("*")):
            unfinished.add(where)
    return committed, unfinished


def _killed(fn, nodes: int, *args) -> None:
    """Run a job whose ranks all kill themselves (``SIGKILL``) at their phase."""
    with pytest.raises(RankError) as failed:
        run_ranks(fn, nodes, *args)
    # Each rank that reported died of the signal (a straggler is killed by run_ranks).
    assert failed.value.failures, failed.value
    for text in failed.value.failures.values():
        assert "process exited with code -9 without reporting" in text, text


def _after_the_kill(kind: str, nodes: int, phase: str, other: str | None) -> tuple[set, set]:
    """Step 5's directories when the job dies: (those committed, some of those with
    files only). The first level's manifest is on rank 0's node only."""
    between = {f"n{n}/{kind}" for n in range(nodes)}
    first = {f"n{n}/l1" for n in range(nodes)}
    if phase == "write":
        return set(), first
    if phase == "commit":
        return {"n0/l1"}, set()
    if phase == "level":
        # What the phase sent: partner copies on every node; parity blocks on nodes 2
        # (group {0, 1}) and 0 (group {2}). A node's own files are linked in later.
        sent = between if kind == "partner" else {"n0/erasure", "n2/erasure"}
        return {"n0/l1"} | ({"remote"} if other == "committed" else set()), sent
    return {"n0/l1"} | (between if other == "committed" else set()), {"remote"}


@pytest.mark.parametrize(("kind", "mode", "phase", "other", "expected", "again"), list(_params()))
def test_a_killed_job_resumes_from_the_newest_restorable_step_and_saves_on(
    tmp_path: Path,
    kind: str,
    mode: str,
    phase: str,
    other: str | None,
    expected: int,
    again: set[str],
) -> None:
    root, nodes = str(tmp_path), KINDS[kind][0]
    if phase == "restore":
        run_ranks(_first_job, nodes, root, kind, mode, None, None)
        shutil.rmtree(tmp_path / "n1")
        _killed(_killed_in_restore, nodes, root, kind)  # once the restore brought files
        # and the replaced node, half restored, is lost again below.
    else:
        stop = kind if phase == "level" else phase
        _killed(_first_job, nodes, root, kind, mode, stop, other)
        committed, unfinished = _step_dirs(tmp_path)
        want_committed, want_unfinished = _after_the_kill(kind, nodes, phase, other)
        assert committed == want_committed, (committed, unfinished)
        assert unfinished >= want_unfinished, (committed, unfinished)
    shutil.rmtree(tmp_path / "n1")  # node 1 is lost (for erasure: any one node)
    out = run_ranks(_resumed_job, nodes, root, kind, mode)

    _, between, remote = _urls(root, kind)
    for rank, got in enumerate(out):
        assert got["resumed"] == expected, (rank, got)
        here = between.replace("{node}", str(rank))
        urls = {"between": here, "remote": remote}
        assert got["again"] == sorted((urls[a], True, None) for a in again), (rank, got["again"])
        # Every step the resumed job saved committed on every level, on every rank.
        assert got["drains"] == {
            step: sorted([(here, True, None), (remote, True, None)])
            for step in range(expected + 1, expected + 4)
        }, (rank, got["drains"])
        # The newest step, and the first saved again (for a resume from step 4, step 5's
        # leftovers of the killed job replaced), load afresh as the resumed job saved them.
        assert got["exact"] == {expected + 1: True, expected + 3: True}, (rank, got["exact"])
