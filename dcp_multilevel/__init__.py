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
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpMultilevelError,
    DrainError,
)
from .health import Checks
from .ladder import newest_step, wait
from .levels import Level
from .manage.manager import CheckpointManager
from .plugin import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter
from .schedule import Schedule
from .staging import StagingConfig

# The face: what a DCP user writes every day, and the errors they catch. The
# other errors are in dcp_multilevel.errors, the extension bases in
# dcp_multilevel.abc, the rest in the folder that owns it (docs/architecture.md).
__all__ = [
    "BalancedSavePlanner",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "Checks",
    "Compression",
    "ConfigError",
    "CorruptCheckpointError",
    "DcpMultilevelError",
    "DrainError",
    "Level",
    "MultiLevelReader",
    "MultiLevelWriter",
    "Schedule",
    "StagingConfig",
    "__version__",
    "newest_step",
    "wait",
]
