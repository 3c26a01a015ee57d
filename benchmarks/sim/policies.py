"""The policies the simulator compares, and how a policy lets a run skip steps.

* :class:`FixedSeconds`: each level once a fixed number of seconds has
  passed since its last save (the brute-force search varies these).
* :class:`EverySteps`: each level every ``n``-th step, the first level
  included: what torchtitan (``checkpoint.interval``, in steps) and Orbax
  (``save_interval_steps``) do.
* :class:`YoungDalyAhead`: :class:`~dcp_multilevel.schedule.YoungDaly`,
  unchanged, plus :class:`Lookahead`.

:class:`Lookahead` is an optional ability: a policy that implements it says,
after a decision with no level, the earliest clock time at which it could
choose one if nothing is saved in between; the simulator skips the steps
before that (one step short, so rounding never skips a due save). Every
policy here implements it; a policy that does not is asked at every step.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from dcp_multilevel.errors import ConfigError
from dcp_multilevel.schedule.base import Decision, Observation, SavePolicy
from dcp_multilevel.schedule.young_daly import YoungDaly

__all__ = ["EverySteps", "FixedSeconds", "Lookahead", "YoungDalyAhead"]


@runtime_checkable
class Lookahead(Protocol):
    """A policy that can say when it will next save (see the module docstring)."""

    def quiet_until(self, observation: Observation) -> float:
        """The earliest clock time at which :meth:`SavePolicy.decide` may choose a
        level, for observations after ``observation`` with the same level states
        (no save in between). ``inf``: never."""
        ...


class FixedSeconds(SavePolicy):
    """Level ``i`` saves once ``intervals[i]`` seconds have passed since its last save
    (at once if it has none; never if its interval is ``inf``).

    The interval runs from one save's decision to the next, so it includes the
    first level's blocked time. A save to a higher level is also a save to the
    first level (``Decision`` adds it).
    """

    def __init__(self, intervals: tuple[float, ...] | list[float]) -> None:
        self.intervals = tuple(float(x) for x in intervals)
        if not self.intervals or any(not x > 0 for x in self.intervals):
            raise ConfigError(f"FixedSeconds intervals must be > 0, got {self.intervals!r}")

    def decide(self, observation: Observation) -> Decision:
        """Each level whose interval passed since its last save (at once: never saved)."""
        chosen = frozenset(
            s.index
            for s in observation.levels
            if math.isfinite(self.intervals[s.index])
            and (s.last_time is None or observation.time - s.last_time >= self.intervals[s.index])
        )
        return Decision(chosen, "fixed-seconds", intervals=dict(enumerate(self.intervals)))

    def quiet_until(self, observation: Observation) -> float:
        """The earliest time a level's interval runs out (see :class:`Lookahead`)."""
        due = math.inf
        for s in observation.levels:
            interval = self.intervals[s.index]
            if math.isfinite(interval):
                due = min(due, -math.inf if s.last_time is None else s.last_time + interval)
        return due

    def __repr__(self) -> str:
        return f"FixedSeconds({', '.join(f'{x:g}' for x in self.intervals)})"


class EverySteps(SavePolicy):
    """Level ``i`` saves every ``every[i]``-th step (``step % every[i] == 0``).

    ``EverySteps((500, 500, 500))`` is torchtitan's default cadence
    (``checkpoint.interval = 500`` steps) with every save on every level.
    """

    def __init__(self, every: tuple[int, ...] | list[int]) -> None:
        self.every = tuple(every)
        if not self.every or any(not isinstance(n, int) or n < 1 for n in self.every):
            raise ConfigError(f"EverySteps needs integers >= 1, got {self.every!r}")

    def decide(self, observation: Observation) -> Decision:
        """Each level whose step count divides the step."""
        step = observation.step
        chosen = frozenset(s.index for s in observation.levels if step % self.every[s.index] == 0)
        return Decision(chosen, "every-steps", {"every": list(self.every)})

    def quiet_until(self, observation: Observation) -> float:
        """The time of the next step some level's count divides (see :class:`Lookahead`)."""
        if observation.step_seconds is None:
            return -math.inf  # cannot tell the time of a later step: ask every step
        step = observation.step
        ahead = min(n - step % n for n in self.every)  # steps to the next multiple
        return observation.time + ahead * observation.step_seconds

    def __repr__(self) -> str:
        return f"EverySteps({self.every!r})"


class YoungDalyAhead(YoungDaly):
    """:class:`~dcp_multilevel.schedule.YoungDaly` (same arguments, same decisions)
    with :class:`Lookahead`, from its own :meth:`YoungDaly.intervals`."""

    def quiet_until(self, observation: Observation) -> float:
        """The earliest time a level's Young/Daly interval runs out (see :class:`Lookahead`)."""
        intervals, _ = self.intervals(observation)
        return min(
            (
                (s.last_time or 0.0) + intervals[s.index].seconds
                for s in observation.levels
                if s.index in intervals
            ),
            default=math.inf,
        )
