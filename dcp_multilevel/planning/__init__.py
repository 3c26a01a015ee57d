"""Save planning as pure functions: cost model, partitioning, splitting, grouping,
checking that a tensor's chunks tile it, and a device tensor's fingerprint
(``fingerprint.py``, for replica checks).

Nothing here touches torch.distributed, files or DCP plans; ``planner.py``
translates between DCP and these types.
"""

from .chunks import Chunk, chunk_errors
from .cost import CostModel
from .partition import (
    DEFAULT_MIN_CHUNK_BYTES,
    Item,
    Partition,
    PartitionOptions,
    Piece,
    balance,
    choose_split_dim,
    partition,
    slab_bytes,
)

__all__ = [
    "DEFAULT_MIN_CHUNK_BYTES",
    "Chunk",
    "CostModel",
    "Item",
    "Partition",
    "PartitionOptions",
    "Piece",
    "balance",
    "choose_split_dim",
    "chunk_errors",
    "partition",
    "slab_bytes",
]
