"""How often a training job is interrupted, and by what: failure classes and rates.

Each class of failure is survived by some levels and not others: a process
crash leaves the node's disk (the first level) intact; a lost node takes its
disk, and the partner or erasure levels on the other nodes survive it; a job
or cluster loss (a storage or network outage, a cancelled allocation) leaves
only a store level elsewhere (the remote). A level's checkpoints matter for
the failures it is the lowest level to survive (:meth:`FailureModel.covered_by`).

Published figures (the defaults; pure data, no I/O):

* Meta, "Revisiting Reliability in Large-Scale Machine Learning Research
  Clusters" (2024): mean time to failure of a job falls roughly inversely
  with its size: about 7.9 h at 1,024 GPUs and 1.8 h at 16,384 GPUs.
  :meth:`FailureModel.for_gpus` interpolates between them as a power law,
  ``mtbf = 7.9 h * (gpus / 1024) ** -0.533``.
* Llama 3 (Meta, "The Llama 3 Herd of Models", 2024): 419 unexpected
  interruptions in 54 days of pre-training on 16,384 H100 GPUs (a mean of
  3.1 h between them), about 78 % attributed to confirmed or suspected
  hardware issues (GPUs, HBM, hosts, network): the share of node losses here.
  The rest (software, ...) is taken as process crashes, except a 1 % share
  of job-wide losses, which is an assumption of ours, not a reported figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = [
    "CLASSES",
    "LLAMA3_HARDWARE_SHARE",
    "LLAMA3_MTBF_HOURS",
    "META_MTBF_HOURS",
    "FailureClass",
    "FailureModel",
]

#: Meta 2024: job mean time to failure, hours, by GPU count.
META_MTBF_HOURS = {1024: 7.9, 16384: 1.8}
#: Llama 3: 54 days * 24 h / 419 interruptions on 16,384 GPUs.
LLAMA3_MTBF_HOURS = 54 * 24 / 419
#: Llama 3: share of interruptions attributed to hardware.
LLAMA3_HARDWARE_SHARE = 0.78

#: Which kind of level first survives each class (the order of the levels).
SURVIVORS = ("first", "node", "store")


@dataclass(frozen=True)
class FailureClass:
    """One kind of interruption: its share of all of them, and the lowest kind of
    level that survives it (``"first"``: the node's own disk, ``"node"``: copies
    on other nodes, ``"store"``: a store elsewhere)."""

    name: str
    share: float
    survived_by: str

    def __post_init__(self) -> None:
        if self.survived_by not in SURVIVORS:
            raise ConfigError(
                f"failure class {self.name!r}: survived_by must be one of {SURVIVORS}, got "
                f"{self.survived_by!r}"
            )
        if not 0 <= self.share <= 1:
            raise ConfigError(f"failure class {self.name!r}: share must be in [0, 1]")


#: The default split (see the module docstring for the sources).
CLASSES = (
    FailureClass("process", 1 - LLAMA3_HARDWARE_SHARE - 0.01, "first"),
    FailureClass("node", LLAMA3_HARDWARE_SHARE, "node"),
    FailureClass("job", 0.01, "store"),
)


@dataclass(frozen=True)
class FailureModel:
    """The job's mean time between failures (hours) and how it splits into classes."""

    mtbf_hours: float
    classes: tuple[FailureClass, ...] = CLASSES

    def __post_init__(self) -> None:
        if not self.mtbf_hours > 0:
            raise ConfigError(f"mtbf_hours must be > 0, got {self.mtbf_hours!r}")
        total = sum(c.share for c in self.classes)
        if not math.isclose(total, 1.0, abs_tol=1e-9):
            raise ConfigError(f"failure class shares must add up to 1, got {total}")

    @classmethod
    def for_gpus(cls, gpus: int, classes: tuple[FailureClass, ...] = CLASSES) -> FailureModel:
        """The model for a job on ``gpus`` GPUs, from Meta's 2024 figures (power law)."""
        if gpus < 1:
            raise ConfigError(f"gpus must be >= 1, got {gpus!r}")
        (n0, m0), (n1, m1) = sorted(META_MTBF_HOURS.items())
        exponent = math.log(m1 / m0) / math.log(n1 / n0)
        return cls(m0 * (gpus / n0) ** exponent, classes)

    def rate(self, name: str) -> float:
        """Failures of class ``name`` per second."""
        for c in self.classes:
            if c.name == name:
                return c.share / (self.mtbf_hours * 3600.0)
        raise ConfigError(f"no failure class {name!r} (have {[c.name for c in self.classes]})")

    def covered_by(self, kinds: tuple[str, ...]) -> dict[int, float]:
        """Failures per second that each level is the lowest to survive.

        ``kinds`` gives each level's kind of survival, first level first
        (``"first"``, ``"node"``, ``"store"``). A class no level survives is
        left out (those failures lose the run).
        """
        out = {i: 0.0 for i in range(len(kinds))}
        for c in self.classes:
            order = SURVIVORS.index(c.survived_by)
            for i, kind in enumerate(kinds):
                if SURVIVORS.index(kind) >= order:
                    out[i] += c.share / (self.mtbf_hours * 3600.0)
                    break
        return out
