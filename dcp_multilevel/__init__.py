"""dcp_multilevel: faster, smaller, node-loss-tolerant storage for torch.distributed.checkpoint.

Use with DCP as usual::

    import torch.distributed.checkpoint as dcp
    from dcp_multilevel import MultiLevelReader, MultiLevelWriter

    dcp.save(state_dict, storage_writer=MultiLevelWriter("/ckpt/step-100"))
    dcp.load(state_dict, storage_reader=MultiLevelReader("/ckpt/step-100"))
"""

from ._version import __version__
from .codecs import Compression
from .errors import (
    AsyncSaveError,
    BrokenChainError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    ConvertError,
    CorruptCheckpointError,
    DcpMultilevelError,
    DrainError,
    ManifestDigestError,
    ManifestError,
    NotStockCheckpointError,
    PlanningError,
    RegistryError,
    RemoteStoreError,
    SaveInFlightError,
    StagingFenceError,
    TruncatedDataError,
    UnsafeObjectError,
    UnsupportedFormatVersionError,
    UnsupportedStateError,
)
from .levels import DrainResult, Level
from .manage.manager import CheckpointManager, SaveMetrics
from .planning import CostModel
from .plugin import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter
from .schedule import FixedInterval, SavePolicy, Schedule
from .staging import StagingConfig

__all__ = [
    "AsyncSaveError",
    "BalancedSavePlanner",
    "BrokenChainError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "Compression",
    "ConfigError",
    "ConvertError",
    "CorruptCheckpointError",
    "CostModel",
    "DcpMultilevelError",
    "DrainError",
    "DrainResult",
    "FixedInterval",
    "Level",
    "ManifestDigestError",
    "ManifestError",
    "MultiLevelReader",
    "MultiLevelWriter",
    "NotStockCheckpointError",
    "PlanningError",
    "RegistryError",
    "RemoteStoreError",
    "SaveInFlightError",
    "SaveMetrics",
    "SavePolicy",
    "Schedule",
    "StagingConfig",
    "StagingFenceError",
    "TruncatedDataError",
    "UnsafeObjectError",
    "UnsupportedFormatVersionError",
    "UnsupportedStateError",
    "__version__",
]
