"""The DCP storage plugin: what ``dcp.save`` and ``dcp.load`` are handed.

- ``writer.py``: :class:`MultiLevelWriter`, DCP's ``StorageWriter`` (and
  ``AsyncStager``), and how it codes and writes each data file.
- ``reader.py``: :class:`MultiLevelReader`, DCP's ``StorageReader``, falling
  back from copy to copy, and how it reads each data file.
- ``planner.py``: :class:`BalancedSavePlanner`, DCP's ``SavePlanner`` that
  spreads replicated items over the ranks holding them, with its bookkeeping
  of DCP's plan types and the replica check's digests.
- ``arguments.py``: the writer's and reader's argument types, checked.
"""

from .planner import BalancedSavePlanner
from .reader import MultiLevelReader
from .writer import MultiLevelWriter

__all__ = ["BalancedSavePlanner", "MultiLevelReader", "MultiLevelWriter"]
