"""Levels as the unit: Level, level kinds from entry points,
save-decision policies, and the pure retention rules."""

from __future__ import annotations

import shutil
import textwrap
import warnings

import pytest
from conftest import install_fake_distribution
from hypothesis import given
from hypothesis import strategies as st
from test_manager import blank, check, memory_url, state

import dcp_multilevel
import dcp_multilevel.errors
from dcp_multilevel import CheckpointManager, ConfigError, Level
from dcp_multilevel.checkpoint import CheckpointRoot
from dcp_multilevel.errors import DrainError, RegistryError
from dcp_multilevel.levels import (
    LEVEL_KINDS,
    DrainJob,
    DrainResult,
    Lanes,
    LevelDriver,
    StoreLevel,
    driver_for,
    level_kind,
    retention,
)
from dcp_multilevel.schedule import FixedInterval, SavePolicy

# --------------------------------------------------------------------------- Level


def test_levels_are_the_only_spelling(tmp_path):
    level = Level(str(tmp_path / "l1"))
    with pytest.raises(TypeError) as info:
        CheckpointManager(tiers=[level])
    assert (
        str(info.value) == "CheckpointManager.__init__() got an unexpected keyword argument 'tiers'"
    )
    for name in ("Tier", "RemoteTierError"):
        assert not hasattr(dcp_multilevel, name)
        assert not hasattr(dcp_multilevel.errors, name)


def test_a_manager_of_levels_warns_nothing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointManager([Level(str(tmp_path / "l1")), Level(memory_url(), every=2)])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("every", 0, "Level('/x').every must be an integer >= 1, got 0"),
        ("every", True, "Level('/x').every must be an integer >= 1, got True"),
        (
            "keep",
            0,
            "Level('/x').keep must be None or an integer >= 1 (the newest complete "
            "checkpoint is never deleted), got 0",
        ),
    ],
)
def test_bad_level_options_are_named(field, value, message):
    with pytest.raises(ConfigError) as info:
        Level("/x", **{field: value})
    assert str(info.value) == message


# --------------------------------------------------------------------------- level kinds


def test_store_urls_are_store_levels_and_kinds_are_looked_up(tmp_path):
    assert level_kind(Level(str(tmp_path))) is None
    assert level_kind(Level("s3://bucket/run")) is None
    assert level_kind(Level("partner:")) == "partner"
    assert isinstance(driver_for(Level(memory_url())), StoreLevel)
    with pytest.raises(RegistryError) as info:
        driver_for(Level("nosuchkind:"))
    assert str(info.value).startswith("unknown level kind 'nosuchkind' (known: ")
    assert str(info.value).endswith(
        "Third-party level kinds register in entry-point group 'dcp_multilevel.levels'."
    )


def test_the_first_level_must_be_a_store(tmp_path):
    with pytest.raises(ConfigError) as info:
        CheckpointManager([Level("partner:"), Level(str(tmp_path))])
    assert str(info.value) == (
        "the first level (partner:) must be a store (a path or URL): save() writes each "
        "checkpoint there, and the other levels start from it"
    )


@pytest.fixture
def mirror_kind(tmp_path, monkeypatch):
    """A third-party level kind, ``mirror:<dir>``, installed as a real distribution."""
    source = textwrap.dedent(
        """
        from dcp_multilevel.checkpoint import CheckpointRoot
        from dcp_multilevel.levels import StoreLevel

        class MirrorLevel(StoreLevel):
            drains = 0

            def __init__(self, level):
                super().__init__(level, CheckpointRoot(level.url.split(":", 1)[1]))

            def drain(self, job, manifest, link):
                type(self).drains += 1
                return super().drain(job, manifest, link)
        """
    )
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    install_fake_distribution(
        pkg,
        monkeypatch,
        "mirror-level-pkg",
        "[dcp_multilevel.levels]\nmirror = mirror_level_mod:MirrorLevel\n",
        {"mirror_level_mod": source},
    )
    LEVEL_KINDS.refresh()
    yield tmp_path
    LEVEL_KINDS.refresh()


def test_a_level_kind_is_a_file_plus_a_registration(mirror_kind):
    """The manager drains to, lists and loads from a kind it has never heard of."""
    l1, mirror = mirror_kind / "l1", mirror_kind / "mirror"
    levels = [Level(str(l1), keep=1), Level(f"mirror:{mirror}", every=2, codec="zstd")]
    mgr = CheckpointManager(levels, drain_policy="wait")
    for s in range(1, 5):
        mgr.save(state(s), step=s)
    mgr.wait()
    driver = mgr.drivers[1]
    assert type(driver).__name__ == "MirrorLevel" and type(driver).drains == 2
    assert mgr.steps(1) == [2, 4]
    assert sorted(p.name for p in mirror.iterdir()) == ["step-2", "step-4"]
    mgr.close()
    shutil.rmtree(l1)  # the node is gone: the mirror serves the load
    fresh = CheckpointManager(levels)
    loaded = blank()
    assert fresh.load_latest(loaded) == 4
    check(loaded, 4)
    assert list(fresh.last_load_sources) == [driver.checkpoint(4).url]


# --------------------------------------------------------------------------- schedule


class OnlyThree(SavePolicy):
    """Sends step 3 (and nothing else) to every level above the first."""

    def due(self, index, level, step):
        return step == 3


def test_the_schedule_decides_which_levels_take_a_save(tmp_path):
    levels = [Level(str(tmp_path / "l1"), keep=1), Level(memory_url())]
    mgr = CheckpointManager(levels, schedule=OnlyThree(), drain_policy="wait")
    drained = []
    for s in range(1, 6):
        drained.append(mgr.save(state(s), step=s).drains_started)
        if s == 3:
            mgr.wait()  # on its level before the next save's retention looks (no race)
    assert drained == [[], [], [levels[1].url], [], []]
    assert mgr.steps(1) == [3]
    assert mgr.steps(0) == [5]  # step 3 is on the level it was due for: retention may drop it
    mgr.close()


def test_fixed_interval_is_each_levels_every():
    policy = FixedInterval()
    level = Level("/x", every=4)
    assert [s for s in range(13) if policy.due(1, level, s)] == [0, 4, 8, 12]


# --------------------------------------------------------------------------- retention


steps_lists = st.lists(st.integers(0, 60), unique=True, max_size=20).map(sorted)


@given(steps_lists, st.one_of(st.none(), st.integers(1, 8)), st.sets(st.integers(0, 60)))
def test_expired_keeps_the_newest_the_protected_and_keep_many(complete, keep, protected):
    doomed = retention.expired(complete, keep, protected)
    assert set(doomed) <= set(complete)
    assert not set(doomed) & protected
    if complete:
        assert max(complete) not in doomed
        survivors = [s for s in complete if s not in doomed]
        assert len(survivors) >= min(len(complete), keep or len(complete))
        newest = complete[-keep:] if keep else complete
        assert set(newest) <= set(survivors)
        # Nothing outside the newest `keep` survives unless it is protected.
        assert {s for s in survivors if s not in newest} <= protected
    else:
        assert doomed == []


@given(steps_lists, steps_lists, st.sets(st.integers(0, 60)))
def test_abandoned_are_the_uncommitted_older_than_the_newest(uncommitted, complete, protected):
    gone = retention.abandoned(uncommitted, complete, protected)
    if not complete:
        assert gone == []
    else:
        expected = [s for s in uncommitted if s < max(complete) and s not in protected]
        assert gone == expected


def test_not_yet_above_protects_due_steps_not_known_nor_skipped():
    due = lambda s: s % 2 == 0  # noqa: E731
    assert retention.not_yet_above([1, 2, 3, 4, 6], due, known={2}, skipped={6}) == {4}


# --------------------------------------------------------------------------- drains first


class Recording(LevelDriver):
    """A level whose drains only record their step, and end as ``outcome`` says."""

    def __init__(self, root, outcome: dict[int, str]) -> None:
        super().__init__(Level(str(root)), CheckpointRoot(str(root)))
        self.ran: list[int] = []
        self.outcome = outcome

    def drain(self, job, manifest, link):
        self.ran.append(job.step)
        what = self.outcome.get(job.step, "commit")
        if what == "fail":
            raise DrainError("the disk is full")
        return DrainResult(job.step, self.url, committed=what == "commit", skipped=what == "skip")


def _jobs(source_root, target, steps: list[int]) -> DrainJob:
    """A drain of ``steps[-1]`` with the others to run first."""
    first = CheckpointRoot(str(source_root))
    *before, step = steps
    firsts = tuple(DrainJob(s, first.checkpoint(s), target, f"test-{s}", 0.0) for s in before)
    return DrainJob(step, first.checkpoint(step), target, f"test-{step}", 0.0, before=firsts)


@pytest.mark.parametrize("outcome", ["commit", "fail", "skip"])
def test_a_drain_runs_the_drains_it_needs_first(tmp_path, outcome):
    # A level between nodes copies a delta after its references; a delta whose
    # reference could not be copied is not copied either, and says why.
    mgr = CheckpointManager([Level(str(tmp_path / "l1"))])
    for s in (1, 2, 3):
        mgr.save(state(s), step=s)
    target = Recording(tmp_path / "target", {1: outcome})
    lanes = Lanes(policy="wait")
    lanes.submit(_jobs(tmp_path / "l1", target, [1, 2, 3]))
    if outcome == "fail":
        with pytest.raises(
            DrainError,
            match=r"step 3 to .*: step 1, which it needs there, "
            r"was not copied first \(DrainError: the disk is full\)",
        ):
            lanes.wait()
    else:
        lanes.wait()
    results = {r.step: r for r in lanes.results}
    assert target.ran == ([1, 2, 3] if outcome == "commit" else [1])
    assert results[3].committed == (outcome == "commit")
    assert results[3].skipped == (outcome == "skip")  # another world size: skipped, no error
    lanes.close()
