"""The load after a loss: agree on a step, bring each node what it lacks, read.

- ``loader.py``: :class:`Loader`, the manager's load path (the newest
  restorable step or a given one; re-plans around damaged sources).

The agreement on what each rank sees (``levels/agreement.py``), the
inventories and the transfers (``levels/restore.py``) and the restore plan
(``levels/restore_plan.py``) move here next (issue 30, item 4).
"""

from .loader import Loader

__all__ = ["Loader"]
