"""What the simulator simulates: a job's levels (:class:`SimLevel`) and the job (:class:`Job`).

Units: seconds and training steps. A job is ``total_steps`` steps of
``step_seconds`` each; its levels are a first level, which blocks training
while it saves, and levels above it, which drain in the background from the
first level's copy (see ``engine.py`` for the rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dcp_multilevel.errors import ConfigError
from dcp_multilevel.levels.config import Level
from dcp_multilevel.schedule.base import LevelState
from dcp_multilevel.schedule.failures import SURVIVORS, FailureModel

from .loss import LossCurve

__all__ = ["Job", "SimLevel"]

#: The configuration a policy sees for a level of each kind when none is given.
_DEFAULT_URLS = {
    "first": "/sim/level{i}",
    "node": "partner:/sim/{{node}}/level{i}",
    "store": "s3://sim/level{i}",
}


@dataclass(frozen=True)
class SimLevel:
    """One level of a simulated job.

    Attributes:
        kind: what it survives, as in ``schedule/failures.py``: ``"first"`` (a
            process crash: the node's own disk), ``"node"`` (a lost node: copies
            on other nodes), ``"store"`` (a job or cluster loss: a store elsewhere).
        cost_seconds: for the first level, the training time one save blocks;
            for a higher level, the seconds its drain runs in the background.
        restore_seconds: time to restore the job from this level's checkpoint.
        level: the configuration policies see in :class:`~dcp_multilevel.schedule.LevelState`
            (default: a :class:`Level` for the kind, ``partner:`` with 2 replicas
            for ``"node"``).
    """

    kind: str
    cost_seconds: float
    restore_seconds: float = 0.0
    level: Level | None = None

    def __post_init__(self) -> None:
        if self.kind not in SURVIVORS:
            raise ConfigError(f"SimLevel.kind must be one of {SURVIVORS}, got {self.kind!r}")
        for name in ("cost_seconds", "restore_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"SimLevel.{name} must be finite and >= 0, got {value!r}")

    def config(self, index: int) -> Level:
        """The :class:`Level` policies see for this level at position ``index``."""
        if self.level is not None:
            return self.level
        url = _DEFAULT_URLS[self.kind].format(i=index)
        return Level(url, replicas=2) if self.kind == "node" else Level(url)

    def survives(self, survived_by: str) -> bool:
        """Whether this level's checkpoints outlive a failure first survived by ``survived_by``."""
        return SURVIVORS.index(self.kind) >= SURVIVORS.index(survived_by)


@dataclass(frozen=True)
class Job:
    """A training run to simulate.

    Attributes:
        total_steps: training steps of the whole run.
        step_seconds: seconds of one training step (constant).
        levels: the levels, first level first (it blocks training while it saves).
        failures: failure rates by class (``FailureModel``, e.g. ``.for_gpus(16384)``).
        weibull_shape: inter-arrival times of each class are Weibull with this
            shape and the class's mean (``None``: exponential; a shape below 1
            clusters failures, as reported for large clusters).
        stop_probability: the chance that the run is stopped early, at a step
            drawn uniformly from ``1..total_steps`` (an exploratory run).
        loss: the loss curve that values progress (``None``: every step is
            worth the same) and that policies see as ``Observation.loss``.
    """

    total_steps: int
    step_seconds: float
    levels: tuple[SimLevel, ...]
    failures: FailureModel
    weibull_shape: float | None = None
    stop_probability: float = 0.0
    loss: LossCurve | None = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ConfigError(f"Job.total_steps must be an integer >= 1, got {self.total_steps!r}")
        if not (math.isfinite(self.step_seconds) and self.step_seconds > 0):
            raise ConfigError(f"Job.step_seconds must be > 0, got {self.step_seconds!r}")
        if not self.levels:
            raise ConfigError("Job.levels: a job needs at least one level")
        if self.weibull_shape is not None and not self.weibull_shape > 0:
            raise ConfigError(f"Job.weibull_shape must be > 0 or None, got {self.weibull_shape!r}")
        if not 0 <= self.stop_probability <= 1:
            raise ConfigError(
                f"Job.stop_probability must be in [0, 1], got {self.stop_probability!r}"
            )

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each level's kind, first level first (what ``YoungDaly`` takes)."""
        return tuple(level.kind for level in self.levels)

    @property
    def failure_free_seconds(self) -> float:
        """The whole run without failures and without saves."""
        return self.total_steps * self.step_seconds

    def level_states(self) -> tuple[LevelState, ...]:
        """The levels as a policy sees them before the first save."""
        return tuple(
            LevelState(
                i,
                lv.config(i),
                cost_seconds=lv.cost_seconds,
                restore_seconds=lv.restore_seconds,
                survives=lv.kind,
            )
            for i, lv in enumerate(self.levels)
        )
