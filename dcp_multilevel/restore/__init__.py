"""The load after a loss: agree on a step, bring each node what it lacks, read.

In the order a load runs them:

- ``agreement.py``: :class:`Views` (what every rank lists on every level) and
  :class:`Restore` (how every rank can load a step), agreed collectively;
- ``inventory.py``: what each rank needs and its node holds, exchanged;
- ``actions.py``: the inventories and a plan's actions, as values
  (:class:`Link`, :class:`Copy`, :class:`Rebuild`, :class:`Ring`);
- ``plan.py``: the pure plan: per missing file, a link, a copy, a rebuild,
  a store level, or the reasons it cannot be restored; files that every
  node of many needs go around a ring instead (``ring.py``: O(files), not
  O(nodes x files));
- ``order.py``: :class:`TransferOrder`, the order that keeps every rank busy;
- ``simulate.py``: a plan's cost on paper (tests, benchmarks, the choice of a ring);
- ``execute.py``: carrying a plan out over the restore's gloo group;
- ``transfers.py``: :class:`Transfers`, a restore carried out in rounds that
  re-plan around damaged sources;
- ``loader.py``: :class:`Loader`, what a reader given levels does (the newest
  restorable step or a given one, then what each rank reads).
"""

from .loader import Loader, Needs

__all__ = ["Loader", "Needs"]
