"""Health checks on every save: poisoned state is quarantined, never promoted.

- ``checks.py``: :class:`Checks` (which checks run), :class:`LossSpike` (the loss
  rule), what each rank reports (:class:`RankReport`, :class:`Tally`);
- ``finite.py``: counting NaN and infinity where the writer hashes or codes the
  bytes (``_finite.c``, its native kernel).

The record a save keeps is ``format/health.py``'s; what a quarantined step is
spared and denied is the levels' (``levels/dispatch.py``, ``levels/books.py``)
and the restore's (``levels/restore.py``).
See ``docs/health.md``.
"""

from ..format.health import Finding, Health
from .checks import REPORT_FQN, Check, Checks, LossSpike, RankReport, Tally
from .finite import NATIVE, count, count_on_device, rule_for

__all__ = [
    "NATIVE",
    "REPORT_FQN",
    "Check",
    "Checks",
    "Finding",
    "Health",
    "LossSpike",
    "RankReport",
    "Tally",
    "count",
    "count_on_device",
    "rule_for",
]
