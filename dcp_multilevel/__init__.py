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
from .levels import Level, newest_step, wait
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

#: Names the root exported in 0.1.0 that now live where they belong: still found
#: here, with a DeprecationWarning naming the new place, until the next major release.
_MOVED = {
    **{
        name: "dcp_multilevel.errors"
        for name in (
            "AsyncSaveError",
            "BrokenChainError",
            "ChecksumMismatchError",
            "ConvertError",
            "ManifestDigestError",
            "ManifestError",
            "NotStockCheckpointError",
            "PlanningError",
            "RegistryError",
            "RemoteStoreError",
            "SaveInFlightError",
            "StagingFenceError",
            "TruncatedDataError",
            "UnsafeObjectError",
            "UnsupportedFormatVersionError",
            "UnsupportedStateError",
        )
    },
    "CostModel": "dcp_multilevel.planning",
    "DrainResult": "dcp_multilevel.levels",
    "FixedInterval": "dcp_multilevel.schedule",
    "SaveMetrics": "dcp_multilevel.manage",
    "SavePolicy": "dcp_multilevel.schedule",
}


def __getattr__(name: str) -> object:
    """A name 0.1.0 exported here: from its new module, with a DeprecationWarning."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'dcp_multilevel' has no attribute {name!r}")
    import importlib  # noqa: PLC0415 - only for a moved name
    import warnings  # noqa: PLC0415

    warnings.warn(
        f"dcp_multilevel.{name} moved to {module}.{name}; import it from there "
        "(the old name goes in the next major release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
