"""The checkpoint manager: the step and schedule layer over the plugin.

- ``manager.py``: :class:`~dcp_multilevel.CheckpointManager`: saves and loads
  through ``MultiLevelWriter`` / ``MultiLevelReader`` given its levels (the
  drains, retention and restores are the levels' runtime, ``runtime/``).
- ``saving.py``: each save as a plain ``dcp.save`` / ``dcp.async_save``.
- ``cadence.py``: when :meth:`~dcp_multilevel.CheckpointManager.step` saves.
- ``metrics.py``: save and drain records, and where they go.
"""

from .manager import CheckpointManager, SaveMetrics

__all__ = ["CheckpointManager", "SaveMetrics"]
