"""What one simulated run gives: :class:`RunResult`, with a :class:`FailureRecord`
per failure (see ``engine.py`` for how they are counted)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FailureRecord", "RunResult"]


@dataclass(frozen=True)
class FailureRecord:
    """One failure and what it cost.

    Attributes:
        time: when it struck (the job's clock).
        name: its class.
        step: progress when it struck (the newest step completed).
        checkpoints: each level's newest complete checkpoint then, ``(step, time)``
            (``time``: the clock of the step it holds), or None.
        survivors: the levels whose checkpoints outlived it.
        level: the level the run restarted from (None: from step 0).
        restored_step: the step it restarted from.
        lost_seconds: progress lost (recomputed later), the step under way included.
        restore_seconds: time spent restoring after it (less when another failure
            interrupted the restore).
    """

    time: float
    name: str
    step: int
    checkpoints: tuple[tuple[int, float] | None, ...]
    survivors: tuple[int, ...]
    level: int | None
    restored_step: int
    lost_seconds: float
    restore_seconds: float = 0.0


@dataclass(frozen=True)
class RunResult:
    """One simulated run (seconds unless named otherwise).

    ``useful`` is the failure-free time of the steps reached; ``value_*`` the
    same quantities weighted by the value of progress (``loss.py``; see
    :attr:`value_overhead` and :attr:`progress_overhead` for the two ways
    they are added up);
    ``saves`` counts per level the first level's completed saves and each
    higher level's started drains, ``skipped`` the drains skipped because the
    level's previous one still ran. ``gave_up``: the run met ``max_failures``
    failures before its end (failures faster than it progresses) and stopped
    there.
    """

    steps: int
    stopped_early: bool
    gave_up: bool
    wall: float
    useful: float
    blocked: float
    lost: float
    restore: float
    value_useful: float
    value_blocked: float
    value_lost: float
    value_restore: float
    saves: tuple[int, ...]
    skipped: tuple[int, ...]
    failures: tuple[FailureRecord, ...]

    @property
    def overhead(self) -> float:
        """Fault-tolerance overhead: blocked + lost + restore (seconds)."""
        return self.blocked + self.lost + self.restore

    @property
    def value_overhead(self) -> float:
        """The overhead weighted by the value of the progress it delays or discards."""
        return self.value_blocked + self.value_lost + self.value_restore

    @property
    def progress_overhead(self) -> float:
        """COCI's accounting ("progress at risk"): the seconds blocked saving and
        restoring, as seconds, plus the *value* of the progress failures discarded
        (value-seconds, ``value_lost``).

        Saving and restoring cost resources, whatever the run's progress; a
        failure costs the progress it throws away, which is worth more early in
        training. Unlike :attr:`value_overhead`, where a second blocked and a
        second lost at the same progress weigh the same (so Young/Daly stays
        optimal), this one rewards saving more often while progress is fast
        (docs/schedule.md, "Three accountings").
        """
        return self.blocked + self.restore + self.value_lost
