"""When to save to which level: save-decision policies (pure: no I/O, no torch.distributed).

- ``base.py``: :class:`SavePolicy`, the interface and its contract.
- ``fixed.py``: :class:`FixedInterval`, each level's ``every`` (the default).

A new policy is a new file with a :class:`SavePolicy` subclass, passed as
``CheckpointManager(..., schedule=...)``.
"""

from .base import SavePolicy
from .fixed import FixedInterval

__all__ = ["FixedInterval", "SavePolicy"]
