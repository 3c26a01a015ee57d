"""Retention rules: which checkpoints a level may delete (pure: no I/O).

:class:`RetentionRules` composes them for one level: the manager
(``holdings.py``) and ``dcp-multilevel gc`` (``cli/gc.py``) both list a
level, ask the same object, and delete what it returns, newest first (a
delta before its reference) and each manifest first, so a crash in the
middle leaves no half-deleted checkpoint and no delta without its
reference. A rule added here is run by both. The rules:

- keep the newest ``keep`` complete clean checkpoints (``None``: all);
  quarantined ones (``format/health.py``) do not count: they take the places
  ``keep`` leaves free, newest first, and go first when clean ones need them,
  but the newest one stays while no clean step is newer (so it can be
  inspected); poison never pushes a clean step out;
- never delete the newest complete checkpoint, nor a protected one: one
  being drained, or (on the first level) one a higher level is due to hold
  but is not known to hold yet (a remote outage grows the first level
  instead of losing the only copy);
- a step directory without a manifest, older than the newest complete
  checkpoint and not protected, was abandoned by a save or drain that died;
- on a level with deltas, never delete a checkpoint a kept one needs (its
  reference, and that one's: ``keyframes.needed``), so ``keep`` counts
  restorable checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .deltas import needed

__all__ = ["RetentionRules", "abandoned", "deletion_order", "expired", "not_yet_above"]


@dataclass(frozen=True)
class RetentionRules:
    """The retention of one level: keep the newest ``keep`` (None: all), see the module
    docstring for the rest. ``protected`` steps are the caller's to know (drains in
    flight, steps not yet on a higher level); ``refs`` maps each delta checkpoint to
    its reference step."""

    keep: int | None

    def expired(
        self,
        complete: Sequence[int],
        protected: Collection[int] = (),
        refs: Mapping[int, int | None] | None = None,
        quarantined: Collection[int] = (),
    ) -> list[int]:
        """Committed steps past ``keep`` that nothing kept needs."""
        return expired(complete, self.keep, protected, refs, quarantined)

    def abandoned(
        self, uncommitted: Iterable[int], complete: Sequence[int], protected: Collection[int] = ()
    ) -> list[int]:
        """Step directories without a manifest older than the newest committed step."""
        return abandoned(uncommitted, complete, protected)

    def doomed(
        self,
        complete: Sequence[int],
        uncommitted: Iterable[int],
        protected: Collection[int] = (),
        refs: Mapping[int, int | None] | None = None,
        quarantined: Collection[int] = (),
    ) -> list[int]:
        """Everything to delete, in the order to delete it (:func:`deletion_order`)."""
        gone = self.expired(complete, protected, refs, quarantined)
        return deletion_order(gone + self.abandoned(uncommitted, complete, protected))


def expired(
    complete: Sequence[int],
    keep: int | None,
    protected: Collection[int],
    refs: Mapping[int, int | None] | None = None,
    quarantined: Collection[int] = (),
) -> list[int]:
    """The complete steps (ascending in ``complete``) past ``keep`` that may be deleted.

    ``refs``: each delta checkpoint's reference step; what a kept or
    protected checkpoint needs is kept too. ``quarantined``: steps whose checks
    found something, counted after the clean ones (see the module docstring).
    """
    if not complete:
        return []
    poisoned = [s for s in complete if s in quarantined]
    clean = [s for s in complete if s not in quarantined]
    kept = set(clean[-keep:]) if keep else set(clean)
    if clean:
        kept.add(max(clean))
    if poisoned:
        room = max(0, keep - len(kept)) if keep else len(poisoned)
        kept.update(poisoned[-room:] if room else ())
        if not clean or max(poisoned) > max(clean):  # the poison of now: inspectable
            kept.add(max(poisoned))
    kept |= set(protected) & set(complete)
    if refs:
        kept = needed(kept, refs)
    return [s for s in complete if s not in kept]


def abandoned(
    uncommitted: Iterable[int], complete: Sequence[int], protected: Collection[int]
) -> list[int]:
    """The uncommitted steps that are leftovers: older than the newest complete one."""
    if not complete:
        return []
    newest = max(complete)
    return [s for s in uncommitted if s < newest and s not in protected]


def not_yet_above(
    complete: Iterable[int],
    due: Callable[[int], bool],
    known: Collection[int],
    skipped: Collection[int],
) -> set[int]:
    """First-level steps a higher level is due to hold but is not known to hold yet.

    ``due(step)``: the schedule's decision for that level; ``known``: steps
    known to be committed there; ``skipped``: steps deliberately not sent
    there (the skip policy), which need no protection.
    """
    return {s for s in complete if due(s) and s not in known and s not in skipped}


def deletion_order(steps: Iterable[int]) -> list[int]:
    """``steps`` in the order to delete them: newest first, so that a delta goes
    before the checkpoint it is coded against (references are always older)."""
    return sorted(steps, reverse=True)
