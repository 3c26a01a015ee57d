"""``Schedule.auto``: the policies composed as the issue describes, from one or two numbers."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError
from .failures import FailureModel
from .intervals import IntervalPolicy, OverheadBound, TimeBounds
from .progress import ProgressValue
from .young_daly import YoungDaly

__all__ = ["Schedule"]


class Schedule:
    """Factories of save policies (``CheckpointManager(schedule=Schedule.auto(...))``)."""

    @staticmethod
    def auto(
        mtbf_hours: float | None = None,
        *,
        gpus: int | None = None,
        overhead: float = 0.035,
        convergence: bool = False,
        horizon_hours: float = 24.0,
        min_seconds: float | Mapping[int, float] | None = None,
        max_seconds: float | Mapping[int, float] | None = None,
    ) -> IntervalPolicy:
        """Young/Daly per level from measured costs and failure rates, the first
        level kept under ``overhead`` of the training time (CheckFreq), within
        ``min_seconds``/``max_seconds``.

        With ``convergence=True``, the intervals are also divided by the square
        root of the progress rate estimated from the reported losses
        (``ProgressValue``, assuming a run of ``horizon_hours`` until it has run
        half of that). This minimises COCI's cost, which counts seconds spent
        saving plus the *value* of the progress a failure discards. It is off
        by default. Measured in the failure simulator
        (``benchmarks/bench_schedule.py``), it costs less than Young/Daly under that
        accounting but more plain time: more seconds blocked early, more work
        recomputed on the plateau. Plain time is what a job pays in GPU-hours,
        so turn it on only when early progress is worth more to you than the
        same seconds later, as in exploratory runs.

        Give the job's mean time between failures (``mtbf_hours``) or its GPU
        count (``gpus``: the published rates, ``schedule/failures.py``).

        Raises:
            ConfigError: neither or both of ``mtbf_hours`` and ``gpus``.
        """
        if (mtbf_hours is None) == (gpus is None):
            raise ConfigError(
                "Schedule.auto needs the job's failure rate: mtbf_hours=... (measured on your "
                "cluster) or gpus=... (published rates by job size), not both"
            )
        failures = (
            FailureModel(mtbf_hours)
            if mtbf_hours is not None
            else FailureModel.for_gpus(
                gpus  # type: ignore[arg-type]
            )
        )
        policy: IntervalPolicy = YoungDaly(failures)
        if convergence:
            policy = ProgressValue(policy, horizon_hours=horizon_hours)
        policy = OverheadBound(policy, overhead)
        if min_seconds is not None or max_seconds is not None:
            policy = TimeBounds(policy, min_seconds, max_seconds)
        return policy
