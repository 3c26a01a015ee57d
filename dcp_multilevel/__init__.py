"""dcp_multilevel: faster, smaller, node-loss-tolerant storage for torch.distributed.checkpoint.

Use with DCP as usual::

    import torch.distributed.checkpoint as dcp
    import dcp_multilevel
    from dcp_multilevel import Level, MultiLevelReader, MultiLevelWriter

    levels = [Level("/nvme/run1"), Level("s3://bucket/run1", every=4, codec="bytegroup")]
    if dcp_multilevel.newest_step(levels) is not None:  # None on a fresh start
        dcp.load(state_dict, storage_reader=MultiLevelReader("latest", levels=levels))
    dcp.save(state_dict, storage_writer=MultiLevelWriter("step-100", levels=levels))
    dcp_multilevel.wait()  # every due drain has landed
"""

from ._version import __version__
from .codecs import Compression
from .errors import (
    AsyncSaveError,
    BrokenChainError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
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
from .health import Checks, LossSpike
from .ladder import newest_step, wait
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
    "CheckpointWriteError",
    "Checks",
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
    "LossSpike",
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
    "newest_step",
    "wait",
]
