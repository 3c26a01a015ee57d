"""The failure simulator: save policies on simulated training runs.

Pure (no I/O, no torch.distributed; numpy): a discrete-event simulation of a
training job with levels of measured costs, failures by class (exponential or
Weibull arrivals), exploratory runs stopped early, and progress valued by a
loss curve; it drives a :class:`~dcp_multilevel.schedule.SavePolicy` through
``decide(Observation)`` as the manager does, and measures its
fault-tolerance overhead (blocked + lost + restore).

- ``model.py``: the job and its levels (:class:`Job`, :class:`SimLevel`).
- ``arrivals.py``: failure arrivals, drawn per class or placed by hand.
- ``loss.py``: loss curves and the value of progress.
- ``engine.py``: one run (:func:`simulate`); ``results.py``: what it gives
  (:class:`RunResult`, a :class:`FailureRecord` per failure).
- ``policies.py``: fixed intervals in seconds or steps, Young/Daly with
  look-ahead, and the :class:`Lookahead` ability that lets a run skip steps.
- ``evaluate.py``: many seeds with confidence intervals (:func:`evaluate`),
  the brute-force best fixed intervals (:func:`best_fixed`).
- ``measured.py``: the measured costs and the benchmark's scenarios.

See docs/schedule.md.
"""

from .arrivals import Failure
from .engine import simulate
from .evaluate import BruteForce, Estimate, Summary, best_fixed, evaluate
from .loss import LossCurve, PowerLaw, Recorded
from .model import Job, SimLevel
from .policies import EverySteps, FixedSeconds, Lookahead, YoungDalyAhead
from .results import FailureRecord, RunResult

__all__ = [
    "BruteForce",
    "Estimate",
    "EverySteps",
    "Failure",
    "FailureRecord",
    "FixedSeconds",
    "Job",
    "Lookahead",
    "LossCurve",
    "PowerLaw",
    "Recorded",
    "RunResult",
    "SimLevel",
    "Summary",
    "YoungDalyAhead",
    "best_fixed",
    "evaluate",
    "simulate",
]
