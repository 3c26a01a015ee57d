"""When to save to which level: save-decision policies (pure: no I/O, no torch.distributed).

- ``base.py``: :class:`SavePolicy`, the interface and its contract, and what a
  decision sees (:class:`Observation`) and says (:class:`Decision`).
- ``fixed.py``: :class:`FixedInterval`, each level's ``every`` (the default).
- ``failures.py``: failure classes and rates, from published reports.
- ``intervals.py``: policies that pick an interval per level
  (:class:`IntervalPolicy`), the CheckFreq-style :class:`OverheadBound`, and
  :class:`TimeBounds` (a floor and a ceiling in seconds).
- ``young_daly.py``: the Young/Daly interval per level (:class:`YoungDaly`).
- ``convergence.py``: :class:`ConvergenceAware`, intervals scaled by the loss
  curve's recent over its mean rate (the first try at COCI's idea).
- ``progress.py``: :class:`ProgressValue`, Young/Daly's intervals divided by
  the square root of the progress rate: the minimum of COCI's cost (seconds
  saving plus the value of progress lost).
- ``auto.py``: :meth:`Schedule.auto`, all of them composed.

A new policy is a new file with a :class:`SavePolicy` subclass, passed as
``CheckpointManager(..., schedule=...)``.
"""

from .auto import Schedule
from .base import Decision, LevelState, Observation, SavePolicy
from .convergence import ConvergenceAware
from .failures import FailureClass, FailureModel
from .fixed import FixedInterval
from .intervals import Interval, IntervalPolicy, OverheadBound, TimeBounds
from .progress import ProgressValue
from .young_daly import YoungDaly, daly_interval, young_interval

__all__ = [
    "ConvergenceAware",
    "Decision",
    "FailureClass",
    "FailureModel",
    "FixedInterval",
    "Interval",
    "IntervalPolicy",
    "LevelState",
    "Observation",
    "OverheadBound",
    "ProgressValue",
    "SavePolicy",
    "Schedule",
    "TimeBounds",
    "YoungDaly",
    "daly_interval",
    "young_interval",
]
