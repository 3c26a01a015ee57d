"""Delta chains on a level: the next save's reference, and what retention keeps."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel import Level
from dcp_multilevel.levels.deltas import DeltaHistory, needed, next_reference
from dcp_multilevel.levels.retention import deletion_order, expired


def run(saves: int, every: int, against: str) -> list[tuple[int, int | None]]:
    history: list[tuple[int, int | None]] = []
    for step in range(saves):
        history.append((step, next_reference(history, every, against)))
    return history


def test_keyframe_chains_reference_the_last_keyframe() -> None:
    refs = [r for _, r in run(9, 4, "keyframe")]
    assert refs == [None, 0, 0, 0, None, 4, 4, 4, None]


def test_previous_chains_reference_the_previous_save() -> None:
    refs = [r for _, r in run(9, 4, "previous")]
    assert refs == [None, 0, 1, 2, None, 4, 5, 6, None]


def test_no_deltas_without_keyframe_every_above_one() -> None:
    assert all(r is None for _, r in run(5, None, "keyframe"))
    assert all(r is None for _, r in run(5, 1, "previous"))


def test_a_missing_link_starts_a_new_keyframe() -> None:
    history = [(0, None), (10, 0), (20, 10)]
    assert next_reference(history, 8, "previous", present=[0, 20]) is None
    assert next_reference(history, 8, "previous", present=[0, 10, 20]) == 20
    assert next_reference(history, 8, "keyframe", present=[0, 20]) == 0
    assert next_reference(history, 8, "keyframe", present=[10, 20]) is None


def test_retention_keeps_what_kept_checkpoints_need() -> None:
    refs = dict(run(9, 4, "previous"))
    # keep 2: steps 7 and 8; 8 is a keyframe, 7 needs 6, 5, 4.
    assert expired(list(range(9)), 2, set(), refs) == [0, 1, 2, 3]
    refs = dict(run(9, 4, "keyframe"))
    assert expired(list(range(9)), 2, set(), refs) == [0, 1, 2, 3, 5, 6]
    # a protected step keeps its chain too
    assert 4 not in expired(list(range(9)), 1, {5}, refs)


@settings(max_examples=200, deadline=None)
@given(
    saves=st.integers(1, 40),
    every=st.integers(1, 9),
    against=st.sampled_from(["keyframe", "previous"]),
    keep=st.integers(1, 10),
)
def test_every_kept_checkpoint_stays_restorable(saves, every, against, keep) -> None:
    history = run(saves, every, against)
    refs = dict(history)
    steps = [s for s, _ in history]
    gone = set(expired(steps, keep, set(), refs))
    kept = [s for s in steps if s not in gone]
    assert len(kept) >= min(keep, len(steps))
    assert needed(kept, refs) == set(kept)  # every chain of a kept step is whole
    # chains never hold more than keyframe_every checkpoints
    for s in steps:
        assert len(needed([s], refs)) <= max(every, 1) if against == "previous" else 2


@settings(max_examples=100, deadline=None)
@given(
    saves=st.integers(1, 30),
    every=st.integers(2, 6),
    keep=st.integers(1, 5),
    against=st.sampled_from(["keyframe", "previous"]),
    crash_after=st.integers(0, 30),
)
def test_a_crash_in_the_middle_of_retention_leaves_no_delta_without_its_reference(
    saves, every, keep, against, crash_after
) -> None:
    refs = dict(run(saves, every, against))
    steps = sorted(refs)
    doomed = deletion_order(expired(steps, keep, set(), refs))
    left = set(steps) - set(doomed[:crash_after])  # the process died after that many
    assert needed(left, refs) == left


class _SavedAgainWhileRead:
    """A level's driver whose manifest read of a step races a new save of that step:
    the read returns the old reference while the history records the new one."""

    node_local = False

    def __init__(self) -> None:
        self.history: DeltaHistory | None = None
        self.reads = 0

    def checkpoint(self, step: int) -> SimpleNamespace:
        def manifest() -> SimpleNamespace:
            self.reads += 1
            if self.reads == 1:  # step saved again, now a keyframe, while this read ran
                assert self.history is not None
                self.history.stored(1, step, None)
            return SimpleNamespace(reference_step=2)  # what the old save said

        return SimpleNamespace(manifest=manifest)


def test_a_reference_read_while_the_step_was_saved_again_is_not_kept():
    levels = [Level("/l1"), Level("/l2", codec="bytegroup", keyframe_every=4)]
    driver = _SavedAgainWhileRead()
    history = DeltaHistory(levels, [SimpleNamespace(node_local=False), driver])
    driver.history = history
    assert history.refs(1, [3]) == {3: 2}  # the read that raced the new save
    assert history.refs(1, [3]) == {3: 2}  # read again: the stale answer was not cached
    assert driver.reads == 2
    assert history.refs(1, [3]) == {3: 2} and driver.reads == 2  # now cached
