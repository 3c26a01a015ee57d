"""The costs the scenarios use, each from a measurement of this project (or marked),
and the scenarios of the scheduling benchmark.

Costs (seconds per rank; ``benchmarks/bench_manager.py --remotes throttled
--codec none --root /dev/shm/<dir>``: one process, a BERT-large shaped fp32
state of 0.41 GB, the first level on tmpfs, the remote a directory behind a
200 MB/s link; the median of three quiet runs' medians, git 58f89bf):

* first level: the save call blocks :data:`FIRST_BLOCKED_S`; a restarted
  process on the same node loads the newest checkpoint from it in
  :data:`FIRST_RESTORE_S` (``load_latest`` with the first level intact).
* remote (store level): a drain from the first level takes
  :data:`STORE_DRAIN_S`; losing the first level, ``load_latest`` restores
  from the remote in :data:`STORE_RESTORE_S`. Saving straight to the remote
  (one level, no first level) blocks :data:`DIRECT_SAVE_S`.
* partner level (``node``): :data:`NODE_DRAIN_S` and :data:`NODE_RESTORE_S`
  scale the remote's figures above by what ``benchmarks/bench_nodeloss.py``
  measured for a partner level (replicas=2) against the remote alone, in the
  same run (git c85797d, 4 ranks on 2 simulated nodes, 1.24 GB state): its
  drain took 0.83x the remote's (2.68 s vs 3.22 s) and a restore after
  losing a node 0.253x a restore from the remote (3.68 s vs 14.53 s).

How the 0.41 GB state relates to a job: it is about one GPU's share of a
Llama-3-405B-sized training state on 16,384 GPUs (405e9 parameters x 14
bytes: bf16 weights, fp32 master weights and two fp32 Adam moments, / 16,384
= 0.35 GB). The scenarios keep that per-GPU state and step time at 1,024
GPUs too (weak scaling: only the failure rate changes with the job's size).

Assumptions (not measurements): a training step of :data:`STEP_SECONDS`
(Llama 3 405B on 16,384 H100s: 6 * N * D FLOPs for a 16M-token batch at the
paper's 400 TFLOPs per GPU gives about 6 s); torchtitan's default cadence of
:data:`TORCHTITAN_INTERVAL_STEPS` steps (``Checkpoint.interval`` in
``torchtitan/config/job_config.py``); an exploratory run stopped early with
probability :data:`EXPLORATORY_STOP_PROBABILITY`.
"""

from __future__ import annotations

from dcp_multilevel.schedule.failures import FailureModel

from .loss import PowerLaw
from .model import Job, SimLevel

__all__ = [
    "DIRECT_SAVE_S",
    "EXPLORATORY_STOP_PROBABILITY",
    "FIRST_BLOCKED_S",
    "FIRST_RESTORE_S",
    "NODE_DRAIN_S",
    "NODE_RESTORE_S",
    "STEP_SECONDS",
    "STORE_DRAIN_S",
    "STORE_RESTORE_S",
    "TORCHTITAN_INTERVAL_STEPS",
    "one_level",
    "scenario",
    "three_levels",
]

#: Measured (bench_manager.py, see the module docstring).
FIRST_BLOCKED_S = 0.239
FIRST_RESTORE_S = 0.108
STORE_DRAIN_S = 2.07
STORE_RESTORE_S = 3.05
DIRECT_SAVE_S = 2.30

#: A partner level's drain (copies of each rank's files to another node) and
#: its restore after a lost node: the remote's, scaled by bench_nodeloss's
#: ratios (see the module docstring).
NODE_DRAIN_S = round(STORE_DRAIN_S * 2.68 / 3.22, 3)
NODE_RESTORE_S = round(STORE_RESTORE_S * 3.68 / 14.53, 3)

#: Assumptions (see the module docstring).
STEP_SECONDS = 6.0
TORCHTITAN_INTERVAL_STEPS = 500
EXPLORATORY_STOP_PROBABILITY = 0.5
#: Llama-3-405B-like: the Chinchilla curve's parameters and tokens per step.
LOSS = PowerLaw.chinchilla(params=405e9, tokens_per_step=16 * 2**20, offset=200.0)


def one_level() -> tuple[SimLevel, ...]:
    """Every save straight to the remote (blocking), as a job without a first level does."""
    return (SimLevel("store", DIRECT_SAVE_S, STORE_RESTORE_S),)


def three_levels() -> tuple[SimLevel, ...]:
    """First level (node-local), partner copies on other nodes, remote."""
    return (
        SimLevel("first", FIRST_BLOCKED_S, FIRST_RESTORE_S),
        SimLevel("node", NODE_DRAIN_S, NODE_RESTORE_S),
        SimLevel("store", STORE_DRAIN_S, STORE_RESTORE_S),
    )


def scenario(
    gpus: int,
    levels: tuple[SimLevel, ...],
    *,
    early_stop: bool = False,
    hours: float = 72.0,
    weibull_shape: float | None = None,
    step_seconds: float = STEP_SECONDS,
) -> Job:
    """A job of ``hours`` failure-free hours on ``gpus`` GPUs (``FailureModel.for_gpus``),
    valued by the Chinchilla-shaped loss curve; stopped early with probability
    :data:`EXPLORATORY_STOP_PROBABILITY` if ``early_stop``."""
    return Job(
        total_steps=round(hours * 3600 / step_seconds),
        step_seconds=step_seconds,
        levels=levels,
        failures=FailureModel.for_gpus(gpus),
        weibull_shape=weibull_shape,
        stop_probability=EXPLORATORY_STOP_PROBABILITY if early_stop else 0.0,
        loss=LOSS,
    )
