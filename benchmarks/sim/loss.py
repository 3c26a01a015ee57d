"""Loss curves that value training progress (early steps are worth more).

The value of reaching step ``s`` of a run of ``S`` steps is the loss gained so
far, normalised: ``V(s) = (L(0) - best(s)) / (L(0) - best(S))``, where
``best(s)`` is the lowest loss up to step ``s`` (a noisy recorded curve never
makes progress worth less than nothing). The simulator turns it into seconds:
``S * step_seconds * V(s)`` is the *value time* of step ``s``, and a second of
overhead at step ``s`` weighs as much as the next step's share of it (1 on
average over the run; with a flat curve, every second weighs 1).

Curves:

* :class:`PowerLaw`: ``L(s) = a + b * (s + offset) ** -c``.
  :meth:`PowerLaw.chinchilla` takes the data term of the fit of Hoffmann et
  al., "Training Compute-Optimal Large Language Models" (2022, approach 3):
  ``L(N, D) = 1.69 + 406.4 / N**0.34 + 410.7 / D**0.28`` for ``N`` parameters
  and ``D`` tokens, with ``D = (s + offset) * tokens_per_step``. The fit is
  for whole runs, not for the first steps of one (it would put a large share
  of the loss drop in step 1): ``offset`` (default 200 steps, torchtitan's
  default learning-rate warmup) stands in for the start of training.
  Normalised, its value depends only on ``c``, ``offset`` and ``S``.
* :class:`Recorded`: a measured curve (e.g. the losses ``examples/train_demo.py``
  keeps in its checkpoint), interpolated linearly between the points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp_multilevel.errors import ConfigError

__all__ = ["CHINCHILLA", "LossCurve", "PowerLaw", "Recorded"]

#: Hoffmann et al. 2022, approach 3: L(N, D) = E + A / N**alpha + B / D**beta.
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


class LossCurve:
    """A training loss as a function of the step (a subclass implements :meth:`losses`)."""

    def losses(self, steps: np.ndarray) -> np.ndarray:
        """The loss at each of ``steps`` (an integer array, step 0 = before training)."""
        raise NotImplementedError

    def loss(self, step: int) -> float:
        """The loss at one step."""
        return float(self.losses(np.asarray([step]))[0])

    def value_seconds(self, total_steps: int, step_seconds: float) -> np.ndarray:
        """Value time (seconds) of reaching each step ``0..total_steps`` (see the module
        docstring): non-decreasing, from 0 to ``total_steps * step_seconds``."""
        best = np.minimum.accumulate(self.losses(np.arange(total_steps + 1)))
        gained = best[0] - best
        whole = total_steps * step_seconds
        if not gained[-1] > 0:  # a flat curve: every step is worth the same
            return np.arange(total_steps + 1) * step_seconds
        return gained / gained[-1] * whole

    def progress_rates(self, total_steps: int) -> np.ndarray:
        """``w`` per step ``1..total_steps``: the value a step adds over its mean share
        (mean 1 over the run; docs/schedule.md "Three accountings")."""
        return np.diff(self.value_seconds(total_steps, 1.0))

    def coci_bound(self, total_steps: int) -> float:
        """The least ratio to Young/Daly's fault-tolerance cost that any schedule can reach
        under COCI's accounting on this curve, to first order: ``mean(sqrt(w))``
        (Young/Daly pays ``(1 + w) / 2`` per unit at each step, the best interval
        ``sqrt(w)``; docs/schedule.md "Three accountings"). 1.0 for a flat curve; the
        closer to 0, the more a convergence-aware schedule can gain."""
        return float(np.mean(np.sqrt(self.progress_rates(total_steps))))


@dataclass(frozen=True)
class PowerLaw(LossCurve):
    """``L(s) = a + b * (s + offset) ** -c`` (see the module docstring)."""

    a: float
    b: float
    c: float
    offset: float = 1.0

    def __post_init__(self) -> None:
        if not (self.b > 0 and self.c > 0 and self.offset > 0):
            raise ConfigError(f"PowerLaw needs b, c, offset > 0, got {self!r}")

    @classmethod
    def chinchilla(cls, params: float, tokens_per_step: float, offset: float = 200.0) -> PowerLaw:
        """The Chinchilla fit for a model of ``params`` parameters trained on
        ``tokens_per_step`` tokens per step (module docstring)."""
        f = CHINCHILLA
        return cls(
            a=f["E"] + f["A"] / params ** f["alpha"],
            b=f["B"] / tokens_per_step ** f["beta"],
            c=f["beta"],
            offset=offset,
        )

    def losses(self, steps: np.ndarray) -> np.ndarray:
        """The loss at each of ``steps``."""
        return self.a + self.b * (np.asarray(steps, dtype=np.float64) + self.offset) ** -self.c


@dataclass(frozen=True)
class Recorded(LossCurve):
    """A measured curve: ``losses[i]`` at ``steps[i]`` (increasing), linear in between,
    constant outside."""

    steps: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(float(s) for s in self.steps))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if len(self.steps) != len(self.values) or len(self.steps) < 2:
            raise ConfigError("Recorded needs as many losses as steps, and at least two")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ConfigError("Recorded.steps must increase")

    def losses(self, steps: np.ndarray) -> np.ndarray:
        """The recorded loss at each of ``steps``, interpolated linearly."""
        return np.interp(np.asarray(steps, dtype=np.float64), self.steps, self.values)
