"""Policies that choose an interval per level, and the bounds put on them.

An :class:`IntervalPolicy` says, for each level, how many seconds should pass
between two of its saves and which rule chose that (:meth:`~IntervalPolicy.intervals`,
an :class:`Interval` per level); a level is due
once that much time passed since its last save (a level never saved to
counts from the start of the job, time 0). Wrappers change the intervals of
another policy:

* :class:`OverheadBound` (CheckFreq, FAST '21): at least ``cost / target``
  between two saves of any level (each is a first-level save), and no save
  that would take the run's blocked time over ``target`` of its time, so
  saving blocks at most ``target`` of the training time (3.5 % in CheckFreq's
  runs);
* :class:`TimeBounds`: at least ``min_seconds`` and at most ``max_seconds``
  between two saves of a level, whatever the policy inside says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .base import Decision, Observation, SavePolicy

__all__ = [
    "AdjustedPolicy",
    "Interval",
    "IntervalPolicy",
    "OverheadBound",
    "TimeBounds",
    "scaled",
]


@dataclass(frozen=True)
class Interval:
    """Seconds between two saves of a level, and the rule that chose them."""

    seconds: float
    rule: str


Intervals = dict[int, Interval]


def scaled(intervals: Intervals, factor: float, tag: str) -> Intervals:
    """``intervals`` times ``factor``, each rule marked ``+tag`` (infinite ones kept:
    a level that never saves stays so)."""
    return {
        i: Interval(v.seconds * factor, f"{v.rule}+{tag}") if math.isfinite(v.seconds) else v
        for i, v in intervals.items()
    }


class IntervalPolicy(SavePolicy):
    """A policy that picks an interval in seconds per level (see the module docstring)."""

    def intervals(self, observation: Observation) -> tuple[Intervals, dict[str, Any]]:
        """An :class:`Interval` per level index, and the inputs that chose them."""
        raise NotImplementedError

    def decide(self, observation: Observation) -> Decision:
        """The levels whose interval passed since their last save (the start for none),
        but not a busy one (its previous copy still running).

        The decision names the rules that set the chosen levels' intervals
        (all levels' when none is chosen); ``inputs["rules"]`` has each level's.
        """
        intervals, inputs = self.intervals(observation)
        chosen = frozenset(
            s.index
            for s in observation.levels
            if s.index in intervals
            and not s.busy
            and observation.time - (s.last_time or 0.0) >= intervals[s.index].seconds
        )
        named = chosen or frozenset(intervals)
        rules = sorted({intervals[i].rule for i in named if i in intervals})
        inputs = {**inputs, "rules": {str(i): v.rule for i, v in sorted(intervals.items())}}
        seconds = {i: v.seconds for i, v in intervals.items()}
        return Decision(chosen, "+".join(rules) or "none", inputs, seconds)


class AdjustedPolicy(IntervalPolicy):
    """An interval policy that adjusts the intervals of ``inner``: its state holds its
    own (:meth:`own_state`) and the inner policy's."""

    inner: IntervalPolicy

    def state(self) -> dict[str, Any] | None:
        """``{"policy", "own", "inner"}`` (None when neither has any)."""
        own, inner = self.own_state(), self.inner.state()
        if own is None and inner is None:
            return None
        return {"policy": type(self).__name__, "own": own, "inner": inner}

    def load_state(self, state: dict[str, Any]) -> None:
        """As :meth:`SavePolicy.load_state`, for this policy and the inner one."""
        if not isinstance(state, dict) or state.get("policy") != type(self).__name__:
            raise ValueError(f"not the state of a {type(self).__name__}")
        if state.get("own") is not None:
            self.load_own_state(state["own"])
        if state.get("inner") is not None:
            self.inner.load_state(state["inner"])

    def own_state(self) -> dict[str, Any] | None:
        """This policy's own part of :meth:`state` (default: none)."""
        return None

    def load_own_state(self, state: dict[str, Any]) -> None:
        """Take back :meth:`own_state` (ValueError when it is not one)."""
        raise ValueError(f"a {type(self).__name__} keeps no state")


class OverheadBound(AdjustedPolicy):
    """Keep the time blocked saving under ``target`` of the training time.

    Every interval becomes at least ``cost / target`` (the first level's
    measured blocked seconds per save), and no save comes sooner than that
    after the previous one, whatever level it is for.
    """

    def __init__(self, inner: IntervalPolicy, target: float = 0.035) -> None:
        if not 0 < target < 1:
            raise ConfigError(f"overhead target must be in (0, 1), got {target!r}")
        self.inner = inner
        self.target = target

    def intervals(self, observation: Observation) -> tuple[Intervals, dict[str, Any]]:
        """``inner``'s intervals, each raised to the bound: a save to any level is a
        first-level save too (higher levels are drained from it)."""
        intervals, inputs = self.inner.intervals(observation)
        cost = observation.levels[0].cost_seconds
        if cost is not None:
            bound = cost / self.target
            intervals = {
                i: v if v.seconds >= bound else Interval(bound, "overhead-bound")
                for i, v in intervals.items()
            }
        inputs = {**inputs, "overhead_target": self.target}
        if observation.blocked_seconds is not None:
            inputs["run_blocked_seconds"] = observation.blocked_seconds
        return intervals, inputs

    def decide(self, observation: Observation) -> Decision:
        """As :class:`IntervalPolicy`, and nothing until ``cost / target`` passed since the
        last save of any level (the first level's: every save goes there), nor while
        one more save would take the job's blocked time so far over ``target``.

        The second rule is the bound over the whole run: the spacing alone
        trusts ``cost``, which is a median of past saves; a save that took longer
        (the first one, measured by nobody before it) is paid back by waiting.
        """
        decision = super().decide(observation)
        first = observation.levels[0]
        cost = first.cost_seconds
        if decision.levels and cost is not None:
            since = observation.time - (first.last_time or 0.0)
            blocked = observation.blocked_seconds
            over = blocked is not None and blocked + cost > self.target * (observation.time + cost)
            if since < cost / self.target or over:
                return Decision(frozenset(), "overhead-bound", decision.inputs, decision.intervals)
        return decision


class TimeBounds(AdjustedPolicy):
    """At least ``min_seconds`` and at most ``max_seconds`` between a level's saves.

    Each bound is one number for every level or a mapping from level index
    to seconds (levels not named are not bounded).

    Raises:
        ConfigError: a bound is negative, or a level's floor is above its ceiling.
    """

    def __init__(
        self,
        inner: IntervalPolicy,
        min_seconds: float | Mapping[int, float] | None = None,
        max_seconds: float | Mapping[int, float] | None = None,
    ) -> None:
        for name, bound in (("min_seconds", min_seconds), ("max_seconds", max_seconds)):
            values = bound.values() if isinstance(bound, Mapping) else [bound]
            if any(v is not None and not v >= 0 for v in values):
                raise ConfigError(f"{name} must be >= 0, got {bound!r}")
        self.inner = inner
        self.min_seconds = min_seconds
        self.max_seconds = max_seconds

    @staticmethod
    def _bound(bound: float | Mapping[int, float] | None, index: int) -> float | None:
        if bound is None or isinstance(bound, (int, float)):
            return bound
        return bound.get(index)

    def intervals(self, observation: Observation) -> tuple[Intervals, dict[str, Any]]:
        """``inner``'s intervals, clamped into each level's bounds."""
        intervals, inputs = self.inner.intervals(observation)
        out = dict(intervals)
        for state in observation.levels:
            low = self._bound(self.min_seconds, state.index)
            high = self._bound(self.max_seconds, state.index)
            if low is not None and high is not None and low > high:
                raise ConfigError(
                    f"level {state.index}: min_seconds {low} is more than max_seconds {high}"
                )
            chosen = intervals.get(state.index, Interval(math.inf, "none"))
            if low is not None and chosen.seconds < low:
                chosen = Interval(low, "time-floor")
            if high is not None and chosen.seconds > high:
                chosen = Interval(high, "time-ceiling")
            out[state.index] = chosen
        return out, inputs
