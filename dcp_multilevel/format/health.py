"""A checkpoint's health record: what the checks on its save found (the manifest's ``health``).

A save whose checks found something (non-finite values, replicas that
disagree, a diverged loss, a custom check's verdict) is *quarantined*: it is
committed on the first level so that it can be inspected, but it is never
drained to another level, retention counts it last, and a load that picks
the newest step passes over it (``docs/health.md``). Its manifest says why::

    "health": {"checked": ["nonfinite", "replicas"],
               "findings": [{"check": "nonfinite",
                             "message": "3 non-finite values in 1 tensor",
                             "items": ["optim.state.w.exp_avg"], "ranks": [1]}]}

A manifest without ``health`` (written before checks existed, or with every
check off) is clean. Pure data: the checks themselves are in ``health/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Health", "health_from_json"]

#: Items and ranks a finding names at most (a corrupted GPU can poison every
#: tensor of a rank; the record stays small and says how many were left out).
MAX_NAMED = 64


@dataclass(frozen=True)
class Finding:
    """What one check found in a save.

    Attributes:
        check: the check's name (``nonfinite``, ``replicas``, ``loss``, or a
            custom check's).
        message: what it found, for people.
        items: the FQNs concerned (may be empty).
        ranks: the ranks that reported it, or whose data differed.
    """

    check: str
    message: str
    items: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The manifest's entry for this finding."""
        return {
            "check": self.check,
            "message": self.message,
            "items": list(self.items[:MAX_NAMED]),
            "ranks": list(self.ranks[:MAX_NAMED]),
        }

    def describe(self) -> str:
        """One line: the check, its message, the ranks and the first items."""
        where = []
        if self.ranks:
            where.append(
                "rank"
                + ("s " if len(self.ranks) > 1 else " ")
                + ", ".join(map(str, self.ranks[:8]))
            )
        if self.items:
            more = f" and {len(self.items) - 3} more" if len(self.items) > 3 else ""
            where.append(", ".join(repr(i) for i in self.items[:3]) + more)
        return f"{self.check}: {self.message}" + (f" ({'; '.join(where)})" if where else "")


@dataclass(frozen=True)
class Health:
    """A save's health record: the checks that ran and what they found.

    Attributes:
        checked: the names of the checks that ran.
        findings: what they found; none: the step is clean.
    """

    checked: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def quarantined(self) -> bool:
        """True when some check found something: the step stays on the first level."""
        return bool(self.findings)

    def reason(self) -> str:
        """Why the step is quarantined, one finding per clause ("" when clean)."""
        return "; ".join(f.describe() for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``health`` value."""
        return {"checked": list(self.checked), "findings": [f.to_json() for f in self.findings]}

    @staticmethod
    def merged(checked: Iterable[str], findings: Iterable[Finding]) -> Health:
        """One record from every rank's findings: one finding per check and message,
        their items and ranks joined (sorted, each once)."""
        joined: dict[tuple[str, str], tuple[set[str], set[int]]] = {}
        for f in findings:
            items, ranks = joined.setdefault((f.check, f.message), (set(), set()))
            items.update(f.items)
            ranks.update(f.ranks)
        return Health(
            tuple(dict.fromkeys(checked)),
            tuple(
                Finding(check, message, tuple(sorted(items)), tuple(sorted(ranks)))
                for (check, message), (items, ranks) in joined.items()
            ),
        )


def health_from_json(raw: Any, fail: Any) -> Health | None:
    """Decode a manifest's ``health`` value (untrusted); ``fail(msg)`` makes the error
    to raise. None when absent (a clean step)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise fail("health must be an object")
    checked = raw.get("checked", [])
    findings = raw.get("findings", [])
    if not isinstance(checked, list) or not all(isinstance(c, str) for c in checked):
        raise fail("health.checked must be a list of strings")
    if not isinstance(findings, list):
        raise fail("health.findings must be a list")
    out = []
    for n, f in enumerate(findings):
        what = f"health.findings[{n}]"
        if not isinstance(f, Mapping):
            raise fail(f"{what} must be an object")
        check, message = f.get("check"), f.get("message")
        items, ranks = f.get("items", []), f.get("ranks", [])
        if not isinstance(check, str) or not isinstance(message, str):
            raise fail(f"{what} needs a string 'check' and 'message'")
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise fail(f"{what}.items must be a list of strings")
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        ):
            raise fail(f"{what}.ranks must be a list of ranks")
        out.append(Finding(check, message, tuple(items), tuple(ranks)))
    return Health(tuple(checked), tuple(out))
