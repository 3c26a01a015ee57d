"""Intervals that minimise COCI's cost: seconds spent saving plus the value of progress lost.

COCI (Li et al., FGCS 2024) counts a save's cost in seconds (resources) and a
failure's cost as the training *progress* it discards, valued by the
convergence curve: early progress is worth more. For a save that costs ``C``
seconds and failures ``M`` seconds apart, a second of training costs
``C / T + w T / 2M`` with interval ``T``, where ``w`` is the current progress
rate: the value a second of training adds now, relative to its mean over the
run. The best interval is then

    T = sqrt(2 C M / w) = young_daly / sqrt(w)

(docs/schedule.md, "Three accountings"). :class:`ProgressValue` divides an
inner policy's intervals (Young/Daly's) by ``sqrt(w)``, with ``w`` estimated
from the losses the trainer reports and nothing else:

    w = (recent rate of loss decrease) * horizon / (loss gained so far)

* **recent rate**: the drop between the mean loss over two windows before the
  step, each ``window`` of the steps observed so far, over their distance.
  Window means make it robust to the step-to-step noise of a real loss.
* **loss gained so far**: the first observed loss less the recent window's mean.
* **horizon**: the run's assumed length in steps. A policy cannot know it,
  so it assumes ``horizon_hours`` of training at the observed step time, or
  twice the steps reached once the run has gone past half of that. A run
  that has lasted ``t`` is as likely to end before ``2 t`` as after, by
  Gott's (Copernican) estimate.

What it assumes, and where it errs:

* The mean progress rate over the run is the loss gained so far over the
  horizon: the gain still to come is left out. That overstates ``w`` a
  little, so intervals come out a little short. The error of ``w`` costs
  little: a factor ``k`` costs ``(sqrt(k) + 1 / sqrt(k)) / 2`` of the best,
  which is 6 % for ``k = 2`` and 25 % for ``k = 4``.
* The run's length is unknown. A horizon too short by ``k`` understates
  ``w`` by about ``k``, and one too long overstates it.
* Exploratory runs that are stopped early are not modelled. With a stop
  step uniform over the run, the best interval at each moment stays
  ``young_daly / sqrt(w)``: stopping changes which moments count, not the
  trade-off at each one. On the benchmark's curve the best possible gain
  is the same with and without early stops (0.671 and 0.673 of
  Young/Daly's cost, to first order).
* It is asked with the step, not the clock. Progress is the step reached,
  and a restart that goes back to an older step is not new progress: steps
  at or below the newest one seen are ignored. A process that restarts
  takes the curve back from the checkpoint it loaded (the manager keeps
  up to :data:`KEPT_POINTS` points of it with every save). Until it has seen
  ``min_steps`` steps, the intervals are the inner policy's.

The policy is pure given the sequence of observations, which is the same
on every rank (``base.py``). It keeps what it has seen: the simulator's
``evaluate`` gives each run a fresh copy.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

from ..errors import ConfigError
from .base import Observation
from .intervals import AdjustedPolicy, Interval, IntervalPolicy, scaled

__all__ = ["KEPT_POINTS", "ProgressValue"]

#: Points of the observed curve kept with a checkpoint (``ProgressValue.own_state``):
#: about 25 KB of JSON in the manifest, enough for window means over the run.
KEPT_POINTS = 1024


class ProgressValue(AdjustedPolicy):
    """Divide ``inner``'s intervals by the square root of the estimated progress rate
    (see the module docstring).

    Args:
        inner: the policy whose intervals are scaled (Young/Daly's).
        horizon_hours: the run's assumed length until it has run half of it.
        window: the share of the observed steps each of the two windows that
            give the recent rate spans (at most 1/2).
        limits: the intervals stay within ``[1/limits, limits]`` times the inner
            ones.
        min_steps: steps to observe before the first estimate.

    Raises:
        ConfigError: a parameter is out of range.
    """

    def __init__(
        self,
        inner: IntervalPolicy,
        *,
        horizon_hours: float = 24.0,
        window: float = 0.125,
        limits: float = 16.0,
        min_steps: int = 16,
    ) -> None:
        if not horizon_hours > 0:
            raise ConfigError(f"horizon_hours must be > 0, got {horizon_hours!r}")
        if not 0 < window <= 0.5:
            raise ConfigError(f"window must be in (0, 0.5], got {window!r}")
        if not limits >= 1:
            raise ConfigError(f"limits must be >= 1, got {limits!r}")
        self.inner = inner
        self.horizon_hours = horizon_hours
        self.window = window
        self.limits = limits
        self.min_steps = max(2, min_steps)
        # The observed curve: steps (increasing), their losses, and the integral of the
        # loss over steps up to each (trapezoids), so that a window's mean is two lookups.
        self._steps: list[int] = []
        self._losses: list[float] = []
        self._integral: list[float] = []

    def own_state(self) -> dict[str, Any] | None:
        """The observed curve (at most :data:`KEPT_POINTS` of it, evenly spread, the
        first and the newest point included)."""
        if not self._steps:
            return None
        n = len(self._steps)
        keep = (
            range(n)
            if n <= KEPT_POINTS
            else sorted({round(i * (n - 1) / (KEPT_POINTS - 1)) for i in range(KEPT_POINTS)})
        )
        return {"steps": [self._steps[i] for i in keep], "losses": [self._losses[i] for i in keep]}

    def load_own_state(self, state: dict[str, Any]) -> None:
        """Take back the curve :meth:`own_state` kept (the losses seen so far are
        replaced: the checkpoint's run is the one that goes on)."""
        steps, losses = state.get("steps"), state.get("losses")
        if (
            not isinstance(steps, list)
            or not isinstance(losses, list)
            or len(steps) != len(losses)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses)
            or any(b <= a for a, b in itertools.pairwise(steps))
        ):
            raise ValueError("not a ProgressValue curve (increasing int steps, finite losses)")
        self._steps, self._losses, self._integral = [], [], []
        for step, loss in zip(steps, losses, strict=True):
            self._add(step, float(loss))

    def _observe(self, observation: Observation) -> None:
        loss = observation.loss
        if loss is None or not math.isfinite(loss):
            return
        step = observation.step
        if self._steps and step <= self._steps[-1]:
            return  # asked again for a step, or back after a restart: not new progress
        self._add(step, loss)

    def _add(self, step: int, loss: float) -> None:
        if self._steps:
            area = 0.5 * (loss + self._losses[-1]) * (step - self._steps[-1])
            self._integral.append(self._integral[-1] + area)
        else:
            self._integral.append(0.0)
        self._steps.append(step)
        self._losses.append(loss)

    def _area(self, at: float) -> float:
        """The integral of the observed loss from the first step to ``at`` (linear in between)."""
        i = bisect.bisect_right(self._steps, at) - 1
        if i >= len(self._steps) - 1:
            return self._integral[-1]
        s0, s1 = self._steps[i], self._steps[i + 1]
        l0, l1 = self._losses[i], self._losses[i + 1]
        u = at - s0
        # The trapezoid from s0 to ``at``, on the line from (s0, l0) to (s1, l1).
        return self._integral[i] + u * (l0 + 0.5 * (l1 - l0) * u / (s1 - s0))

    def _mean(self, start: float, end: float) -> float:
        return (self._area(end) - self._area(start)) / (end - start)

    def weight(self, observation: Observation) -> float | None:
        """The estimated progress rate ``w`` at ``observation`` (None: no trend yet)."""
        if not self._steps:
            return None
        first, last = self._steps[0], self._steps[-1]
        seen = last - first
        if seen < self.min_steps or len(self._steps) < 4:
            return None
        tau = self.window * seen
        recent = self._mean(last - tau, last)
        rate = (self._mean(last - 2 * tau, last - tau) - recent) / tau
        gained = self._losses[0] - recent
        if not gained > 0:
            return None  # no progress so far: nothing to weigh
        step_seconds = observation.step_seconds
        if step_seconds is None or not step_seconds > 0:
            step_seconds = observation.time / max(observation.step, 1)
        if not step_seconds > 0:
            return None
        horizon = max(self.horizon_hours * 3600.0 / step_seconds, 2.0 * last)
        w = max(rate, 0.0) * horizon / gained
        return min(self.limits**2, max(1.0 / self.limits**2, w))

    def intervals(self, observation: Observation) -> tuple[dict[int, Interval], dict[str, Any]]:
        """``inner``'s intervals divided by ``sqrt(w)``."""
        self._observe(observation)
        intervals, inputs = self.inner.intervals(observation)
        w = self.weight(observation)
        if w is None:
            return intervals, {**inputs, "progress_weight": None}
        inputs = {**inputs, "progress_weight": w, "loss": observation.loss}
        return scaled(intervals, 1.0 / math.sqrt(w), "progress"), inputs
