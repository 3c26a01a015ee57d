"""Save planning as pure functions: cost model, partitioning, splitting, grouping.

Nothing here touches torch.distributed, files or DCP plans; ``planner.py``
translates between DCP and these types.
"""

from .balance import balance
from .cost import CostModel
from .items import Item, Piece
from .partition import Partition, PartitionOptions, partition
from .split import choose_split_dim, slab_bytes

__all__ = [
    "CostModel",
    "Item",
    "Partition",
    "PartitionOptions",
    "Piece",
    "balance",
    "choose_split_dim",
    "partition",
    "slab_bytes",
]
