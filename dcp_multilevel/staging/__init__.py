"""Async-save staging for :class:`~dcp_multilevel.MultiLevelWriter`."""

from .config import StagingConfig

__all__ = ["StagingConfig"]
