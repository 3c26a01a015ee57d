"""What one background step of a save sees of its staging: :class:`BackgroundSave`."""

from __future__ import annotations

from collections.abc import Iterable

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from ._tickets import Ticket
from .live import LiveCountdown, live_items

__all__ = ["BackgroundSave"]


class BackgroundSave:
    """What one background step (``write_data``, ``finish``) sees of its save's staging.

    Handed out by :meth:`Stager.background`. For a synchronous save, or a
    save in DCP's daemon process, there are no live tensors.
    """

    def __init__(self, ticket: Ticket | None) -> None:
        self._ticket = ticket

    @property
    def live_storages(self) -> frozenset[int]:
        """Storage pointers of the live tensors this save writes through (over budget)."""
        return self._ticket.live if self._ticket is not None else frozenset()

    def live_written(self) -> None:
        """Every live tensor is in its data file: ``async_save`` may return (any thread).

        Raises:
            StagingFenceError: with the fence check, a live tensor changed
                before it was written (the save then fails).
        """
        if self._ticket is not None:
            if self._ticket.check_live is not None:
                self._ticket.check_live()
            self._ticket.released.set()

    def live_items(self, items: Iterable[WriteItem], planner: SavePlanner) -> set[MetadataIndex]:
        """The indexes of ``items`` this save writes from the live state (write them first)."""
        return live_items(items, planner, self.live_storages)

    def countdown(self, live: set[MetadataIndex]) -> LiveCountdown:
        """Counts the ``live`` items down as they are written; calls :meth:`live_written`."""
        return LiveCountdown(live, self.live_written)
