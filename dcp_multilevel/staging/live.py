"""The over-budget handshake: which items a save writes from the live state, and when
they are all written.

An async save over its staging budget leaves some tensors live (not copied):
the writer writes those first, straight from the training state, and
``async_save`` returns once they are all in their data files (see
``stager.py``). The writer asks its :class:`~.stager.BackgroundSave` which of
its plan's items are live, and counts them down as it writes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

__all__ = ["LiveCountdown", "live_items"]


def live_items(
    items: Iterable[WriteItem], planner: SavePlanner, live: frozenset[int]
) -> set[MetadataIndex]:
    """Indexes of the tensor items whose data is still the training state's memory.

    ``live``: storage pointers of the tensors staging left uncopied.
    """
    if not live:
        return set()
    found = set()
    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            if (
                isinstance(data, torch.Tensor)
                and data.numel()
                and data.untyped_storage().data_ptr() in live
            ):
                found.add(item.index)
    return found


class LiveCountdown:
    """Calls ``done`` once every index in ``pending`` was written (thread-safe).

    With nothing pending, ``done`` runs at once.
    """

    def __init__(self, pending: set[MetadataIndex], done: Callable[[], None]) -> None:
        self._pending = set(pending)
        self._done = done
        self._lock = threading.Lock()
        if not self._pending:
            done()

    def written(self, index: MetadataIndex) -> None:
        """The item ``index`` is in its data file (any writing thread)."""
        if not self._pending:
            return
        with self._lock:
            if index not in self._pending:
                return
            self._pending.discard(index)
            last = not self._pending
        if last:
            self._done()
