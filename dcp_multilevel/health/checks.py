"""The checks every save runs, and what each rank reports of them.

A save is *quarantined* when any check finds something (``format/health.py``
records it in the manifest; ``docs/health.md`` says what follows). The checks:

- ``nonfinite``: NaN or infinity in a floating-point tensor, counted by the
  writer where it hashes or codes the bytes it writes (``finite.py``);
- ``replicas``: a replicated tensor whose copies differ across ranks, found by
  :class:`~dcp_multilevel.BalancedSavePlanner` (``verify_replicas``) from the
  digests each rank sends with its plan; with three or more copies the
  majority's bytes are written;
- ``loss``: the training loss given with the save is non-finite or a spike
  (:class:`LossSpike`);
- custom checks: callables given the state as staged.

Call order (the writer, every rank; ``plugin/writer.py``)::

    tally = Tally()                                  write_data
    tally.add(fqn, count)                            per item, any writing thread
    report = checks.report(rank, state, loss, tally) write_data, once the items are written
    ... DCP gathers every rank's report with its write results ...
    Health.merged(...)                               the coordinator, in finish
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..format.health import Finding

__all__ = ["REPORT_FQN", "Check", "Checks", "LossSpike", "RankReport", "Tally"]

#: A custom check: given this rank's state as staged (DCP's flattened names to
#: values), returns None when it is sound, else why not (a short sentence).
Check = Callable[[Mapping[str, Any]], "str | None"]

#: The name under which a rank's :class:`RankReport` travels with its write results
#: (never an item: the coordinator takes it out before the commit).
REPORT_FQN = "\x00dcp_multilevel.health"


@dataclass
class LossSpike:
    """The loss rule: a loss is bad when it is non-finite, or a spike: more than
    ``ratio`` times the median of the last ``window`` finite losses it saw, once it
    saw ``warmup`` of them and that median is positive.

    It remembers every finite loss it is shown (:meth:`observe`), spikes included,
    so that a loss that settles at a new level stops counting as a spike once it
    fills half the window. Keep one per run (the manager does); a restart starts
    with no history, and judges nothing as a spike before ``warmup`` losses.
    """

    ratio: float = 3.0
    window: int = 50
    warmup: int = 10
    _seen: deque[float] = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, (int, float)) and self.ratio > 1):
            raise ConfigError(f"LossSpike(ratio={self.ratio!r}): must be a number > 1")
        for name in ("window", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"LossSpike({name}={v!r}): must be an integer >= 1")
        if self.warmup > self.window:
            raise ConfigError(f"LossSpike(warmup={self.warmup}) exceeds window={self.window}")
        self._seen = deque(maxlen=self.window)

    def judge(self, loss: float) -> str | None:
        """Why ``loss`` is bad, or None; it is then remembered (:meth:`observe`)."""
        why = self.verdict(loss)
        self.observe(loss)
        return why

    def verdict(self, loss: float) -> str | None:
        """Why ``loss`` is bad against the losses seen so far, or None (nothing remembered)."""
        loss = float(loss)
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        seen = list(self._seen)  # (one copy: an async save judges beside the training loop)
        if len(seen) >= self.warmup:
            median = statistics.median(seen)
            if median > 0 and loss > self.ratio * median:
                return (
                    f"the loss {loss:.4g} is over {self.ratio:g}x the median {median:.4g} "
                    f"of the last {len(seen)} losses"
                )
        return None

    def observe(self, loss: float) -> None:
        """Remember ``loss`` (a step's loss, saved or not); non-finite ones are not kept."""
        loss = float(loss)
        if math.isfinite(loss):
            self._seen.append(loss)


@dataclass
class Checks:
    """Which checks a save runs (``docs/health.md``). All on by default.

    Args:
        nonfinite: count NaN and infinity in floating-point tensors as they are written.
        loss: the rule a save's loss is judged by (None: losses are not judged).
        custom: more checks, each a :data:`Check`; one that raises quarantines the
            step too, naming the check and its error.

    The replica check is the planner's: ``BalancedSavePlanner(verify_replicas=...)``.
    """

    nonfinite: bool = True
    loss: LossSpike | None = field(default_factory=LossSpike)
    custom: tuple[Check, ...] = ()

    def __post_init__(self) -> None:
        self.custom = tuple(self.custom)
        for check in self.custom:
            if not callable(check):
                raise ConfigError(f"Checks(custom=...): {check!r} is not callable")
        if self.loss is not None and not isinstance(self.loss, LossSpike):
            raise ConfigError(f"Checks(loss=...) takes a LossSpike or None, got {self.loss!r}")

    @classmethod
    def off(cls) -> Checks:
        """No check at all: every save is clean (the replica check is the planner's)."""
        return cls(nonfinite=False, loss=None)

    def names(self, loss_given: bool) -> list[str]:
        """The names of the checks this rank runs."""
        names = ["nonfinite"] if self.nonfinite else []
        if self.loss is not None and loss_given:
            names.append("loss")
        return names + [check_name(c) for c in self.custom]

    def report(
        self, rank: int, state: Mapping[str, Any], loss: float | None, tally: Tally
    ) -> RankReport:
        """This rank's findings: the tally's non-finite counts, the loss's verdict, the
        custom checks' (given ``state``, the state as written)."""
        findings = list(tally.findings(rank)) if self.nonfinite else []
        if self.loss is not None and loss is not None:
            why = self.loss.judge(loss)
            if why is not None:
                findings.append(Finding("loss", why, (), (rank,)))
        for check in self.custom:
            name = check_name(check)
            try:
                why = check(state)
            except Exception as e:  # noqa: BLE001 - a failing check quarantines, not fails, the save
                why = f"the check raised {type(e).__name__}: {e}"
            if why is not None and not isinstance(why, str):  # fail safe: not a verdict
                why = f"the check returned {why!r}, not None (sound) or a reason"
            if why is not None:
                findings.append(Finding(name, why, (), (rank,)))
        return RankReport(rank, tuple(self.names(loss is not None)), tuple(findings))


def check_name(check: Check) -> str:
    """What a custom check is called in health records: its ``__name__`` (or its type's)."""
    return getattr(check, "__name__", None) or type(check).__name__


@dataclass(frozen=True)
class RankReport:
    """What one rank's checks found in a save (travels with its write results)."""

    rank: int
    checked: tuple[str, ...]
    findings: tuple[Finding, ...]


class Tally:
    """Non-finite values per item, counted by the writing threads (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, fqn: str, count: int) -> None:
        """``count`` more non-finite values in item ``fqn`` (0: nothing to note)."""
        if count:
            with self._lock:
                self._counts[fqn] = self._counts.get(fqn, 0) + int(count)

    def findings(self, rank: int) -> Iterable[Finding]:
        """One finding for this rank's non-finite values, if it has any."""
        with self._lock:
            counts = dict(self._counts)
        if counts:
            total = sum(counts.values())
            values = f"{total} non-finite value" + ("s" if total != 1 else "")
            tensors = f"{len(counts)} tensor" + ("s" if len(counts) > 1 else "")
            yield Finding("nonfinite", f"{values} in {tensors}", tuple(sorted(counts)), (rank,))
