"""The DCP storage plugin: what ``dcp.save`` and ``dcp.load`` are handed.

- ``writer.py``: :class:`MultiLevelWriter`, DCP's ``StorageWriter`` (and
  ``AsyncStager``); ``data_files.py``: how it codes and writes one data file.
- ``reader.py``: :class:`MultiLevelReader`, DCP's ``StorageReader``, falling
  back from copy to copy; ``read_files.py``: how it reads one data file.
- ``planner.py``: :class:`BalancedSavePlanner`, DCP's ``SavePlanner`` that
  spreads replicated items over the ranks holding them; ``plans.py``: its
  bookkeeping with DCP's plan types.
"""

from .planner import BalancedSavePlanner
from .reader import MultiLevelReader
from .writer import MultiLevelWriter

__all__ = ["BalancedSavePlanner", "MultiLevelReader", "MultiLevelWriter"]
