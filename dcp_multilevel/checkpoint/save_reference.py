"""The committed sibling a delta save codes against, as the writer uses it.

A writer with a ``reference`` (``docs/delta.md``) asks, in this order:

1. :meth:`SaveReference.name_for` at construction and in each save's global
   plan: the reference's directory name, checked to be a sibling of the
   checkpoint being written (a delta names its reference by that name);
2. :meth:`SaveReference.stream_of` per tensor item while writing: the
   reference's stream of the same chunk, or None (the item is stored whole);
3. :meth:`SaveReference.checked` at the commit: the manifest's ``reference``,
   once every delta item was coded against bytes the reference still records.
"""

from __future__ import annotations

import logging
import posixpath
from contextlib import ExitStack
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from ..errors import BrokenChainError, ConfigError, CorruptCheckpointError, DcpMultilevelError
from ..format import ItemLocation, Reference
from .reference import ItemStream, delta_base
from .stored import StoredCheckpoint, sibling_location

__all__ = ["SaveReference"]

logger = logging.getLogger(__name__)


class SaveReference:
    """The reference checkpoint of a delta save (see module docs for call order)."""

    def __init__(self, reference: StoredCheckpoint, storage_options: dict[str, Any]) -> None:
        self.checkpoint = reference
        self._storage_options = storage_options
        self._warned = False  # the reference could not be read (said once)

    def name_for(self, target: StoredCheckpoint) -> str:
        """The reference's directory name, checked to be a sibling of ``target``'s.

        Raises:
            ConfigError: it is not (or it is ``target`` itself).
        """
        ref = self.checkpoint
        name = posixpath.basename(ref.location.rstrip("/"))
        sibling = StoredCheckpoint.at(
            sibling_location(target.location, name), self._storage_options
        )
        if not name or sibling.url != ref.url or ref.url == target.url:
            raise ConfigError(
                f"reference {ref.url} is not a sibling directory of {target.url}; a delta "
                "checkpoint names its reference by directory name, so both must share one "
                "parent (run/step-8 for run/step-9)"
            )
        return name

    def stream_of(
        self, target: StoredCheckpoint, item: WriteItem, streams: ExitStack
    ) -> ItemStream | None:
        """The reference's stream of ``item``, when it stores the same chunk alike
        and this process can read it; else None (the item is stored whole). The
        stream is closed by ``streams`` at the latest."""
        index, td = item.index, item.tensor_data
        try:
            ref = self.checkpoint.manifest()
        except (DcpMultilevelError, OSError) as e:
            if not self._warned:
                logger.warning("not coding deltas against %s: %s", self.checkpoint.url, e)
                self._warned = True
            return None
        loc = delta_base(ref, index, td.properties.dtype, tuple(td.chunk.sizes))
        if loc is None:
            return None
        chain = (target.url, self.checkpoint.url)
        try:
            stream = ItemStream.opened(self.checkpoint, index, loc, chain)
        except BrokenChainError as e:  # e.g. its file is on another node
            logger.debug("item %r stored whole: %s", index.fqn, e)
            return None
        streams.callback(stream.close)
        return stream

    def checked(
        self, target: StoredCheckpoint, locations: dict[MetadataIndex, ItemLocation]
    ) -> Reference | None:
        """The manifest's ``reference`` (None: no item is a delta), once every delta
        item's reference checksum is what the reference records (every rank read
        the same save).

        Raises:
            CorruptCheckpointError: the reference changed during the save.
        """
        deltas = {i: loc.reference for i, loc in locations.items() if loc.reference is not None}
        if not deltas:
            return None
        self.checkpoint.forget()  # read it again: it must still be the save that was read
        ref = self.checkpoint.manifest()
        for index, checksum in deltas.items():
            found = ref.locations.get(index)
            if found is None or found.checksum != checksum:
                raise CorruptCheckpointError(
                    f"item {index.fqn!r} of {target.url} was coded against bytes that the "
                    f"reference {self.checkpoint.url} (save {ref.save_id}) does not record: "
                    "the reference changed during the save; not committed. Save again.",
                    checkpoint=target.url,
                    fqn=index.fqn,
                )
        return Reference(ref.save_id, self.name_for(target))
