"""Many runs of a policy: mean overheads with confidence intervals, and the
brute-force best fixed interval per level.

Confidence intervals are normal: ``mean ± 1.96 sd / sqrt(n)`` over ``n``
seeds. A fraction is a ratio of means (total overhead over total failure-free
time of the steps reached, so a run stopped early weighs by its length), its
interval from the same formula applied to each run's linearised share
(``(o_i - R u_i) / mean(u)``, the delta method).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dcp_multilevel.schedule.base import SavePolicy

from .engine import simulate
from .model import Job
from .policies import FixedSeconds
from .results import RunResult

__all__ = ["BruteForce", "Estimate", "Summary", "best_fixed", "evaluate"]

Z95 = 1.96


@dataclass(frozen=True)
class Estimate:
    """A mean and the half-width of its 95 % confidence interval."""

    mean: float
    half_width: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Estimate:
        """The mean of ``samples`` with its 95 % half-width (infinite below two samples)."""
        x = np.asarray(samples, dtype=np.float64)
        if x.size < 2:
            return cls(float(x.mean()) if x.size else math.nan, math.inf)
        return cls(float(x.mean()), Z95 * float(x.std(ddof=1)) / math.sqrt(x.size))

    @classmethod
    def ratio(cls, num: Sequence[float], den: Sequence[float]) -> Estimate:
        """``sum(num) / sum(den)``, with its delta-method interval."""
        o = np.asarray(num, dtype=np.float64)
        u = np.asarray(den, dtype=np.float64)
        r = float(o.sum() / u.sum())
        if o.size < 2:
            return cls(r, math.inf)
        z = (o - r * u) / u.mean()
        return cls(r, Z95 * float(z.std(ddof=1)) / math.sqrt(o.size))

    def __str__(self) -> str:
        return f"{self.mean:.4g} ± {self.half_width:.2g}"


@dataclass(frozen=True)
class Summary:
    """A policy's runs over seeds.

    Attributes:
        runs: the runs, in seed order.
        overhead: seconds per run (blocked + lost + restore).
        blocked, lost, restore: its parts, seconds per run.
        fraction: overhead / failure-free time of the steps reached.
        value_fraction: the same, each second weighted by the value of progress
            (``loss.py``; equal to ``fraction`` without a loss curve).
        progress_fraction: COCI's accounting (:attr:`RunResult.progress_overhead`:
            blocked and restore seconds plus the value of the progress lost) over
            the same failure-free time (equal to ``fraction`` without a loss curve).
    """

    runs: tuple[RunResult, ...]
    overhead: Estimate
    blocked: Estimate
    lost: Estimate
    restore: Estimate
    fraction: Estimate
    value_fraction: Estimate
    progress_fraction: Estimate

    @classmethod
    def of(cls, runs: Sequence[RunResult]) -> Summary:
        """The estimates over ``runs`` (one policy, many seeds)."""
        runs = tuple(runs)
        return cls(
            runs=runs,
            overhead=Estimate.of([r.overhead for r in runs]),
            blocked=Estimate.of([r.blocked for r in runs]),
            lost=Estimate.of([r.lost for r in runs]),
            restore=Estimate.of([r.restore for r in runs]),
            fraction=Estimate.ratio([r.overhead for r in runs], [r.useful for r in runs]),
            value_fraction=Estimate.ratio(
                [r.value_overhead for r in runs], [r.value_useful for r in runs]
            ),
            progress_fraction=Estimate.ratio(
                [r.progress_overhead for r in runs], [r.useful for r in runs]
            ),
        )


def evaluate(job: Job, policy: SavePolicy, seeds: Sequence[int] | int) -> Summary:
    """Run ``job`` under ``policy`` once per seed (``range(seeds)`` for an int).

    Each run gets a fresh copy of ``policy`` as given: a policy that keeps what
    it observed (the loss curve so far) starts every run as a new job would,
    not with the previous run's history.
    """
    seeds = range(seeds) if isinstance(seeds, int) else seeds
    return Summary.of([simulate(job, copy.deepcopy(policy), seed=s) for s in seeds])


@dataclass(frozen=True)
class BruteForce:
    """The best fixed intervals found, and every combination tried.

    Attributes:
        best: the intervals (seconds per level) with the lowest mean of ``metric``.
        summary: their runs.
        tried: every combination tried, with its runs.
        score: every combination's ``metric``.
    """

    best: tuple[float, ...]
    summary: Summary
    tried: dict[tuple[float, ...], Summary]
    score: dict[tuple[float, ...], float]


def best_fixed(
    job: Job,
    grids: Sequence[Sequence[float]],
    seeds: Sequence[int] | int,
    *,
    metric: Callable[[Summary], float] = lambda s: s.fraction.mean,
) -> BruteForce:
    """The best :class:`FixedSeconds` intervals over the product of per-level ``grids``.

    Every combination runs on the same seeds (the same failures). A first-level
    interval at or above another level's never fires on its own (that level's
    saves include the first level), so such combinations are tried once, with
    the first level's interval ``inf``.

    Args:
        job: the job.
        grids: the intervals to try per level (seconds; ``inf``: never).
        seeds: seeds (``range(seeds)`` for an int).
        metric: what to minimise (default: the overhead fraction's mean; pass
            ``lambda s: s.value_fraction.mean`` for the value-weighted one,
            ``lambda s: s.progress_fraction.mean`` for COCI's).
    """
    if len(grids) != len(job.levels):
        raise ValueError(f"one grid per level: {len(job.levels)} levels, {len(grids)} grids")
    seeds = range(seeds) if isinstance(seeds, int) else seeds
    combos: dict[tuple[float, ...], None] = {}
    for point in itertools.product(*grids):
        combo = point
        if combo[0] >= min(combo[1:], default=math.inf):
            combo = (math.inf, *combo[1:])
        if all(math.isinf(x) for x in combo):
            continue  # never saving is not a schedule
        combos[combo] = None
    if not combos:
        raise ValueError("best_fixed: the grids hold no schedule that ever saves")
    tried = {combo: evaluate(job, FixedSeconds(combo), seeds) for combo in combos}
    score = {combo: metric(summary) for combo, summary in tried.items()}
    best = min(score, key=score.__getitem__)
    return BruteForce(best, tried[best], tried, score)
