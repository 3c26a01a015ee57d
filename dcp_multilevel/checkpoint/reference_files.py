"""The open files of the references a load or a drain reads: one handle per file,
shared by every delta item that reads it (``reference.py`` streams from them)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import DcpMultilevelError
from ..format import ItemLocation
from ..stores import ReadHandle

if TYPE_CHECKING:
    from .stored import StoredCheckpoint

__all__ = ["ReferenceFiles"]


class ReferenceFiles:
    """The references' data files, held open across the items that one thread reads.

    On an object store every open handle fetches its own blocks: a handle per
    item cost a request per item and fetched nothing ahead. One thread reading
    a delta's file keeps one of these: :meth:`plan` says which items it will
    read (each reference file is then fetched in large blocks up to the end of
    the last item read from it), :meth:`open` is called by each item's stream
    (``ItemStream``), :meth:`close` at the end. Not thread-safe.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._open: dict[tuple[str, str], ReadHandle] = {}
        self._ends: dict[tuple[str, str], int] = {}

    def plan(
        self, delta: StoredCheckpoint, items: list[tuple[MetadataIndex, ItemLocation]]
    ) -> None:
        """Note where the references of ``delta``'s ``items`` end in their files (down
        the chain). A reference that cannot be read is skipped here: reading the item
        raises the chain's error."""
        items = [(i, loc) for i, loc in items if loc.reference is not None]
        while items:
            try:
                ref = delta.reference()
                locations = ref.manifest().locations if ref is not None else {}
            except (DcpMultilevelError, OSError):
                return
            inner = []
            for index, _ in items:
                ref_loc = locations.get(index)
                if ref_loc is None:
                    continue
                key = (ref.url, ref_loc.file)  # type: ignore[union-attr]
                self._ends[key] = max(self._ends.get(key, 0), ref_loc.offset + ref_loc.length)
                if ref_loc.reference is not None:
                    inner.append((index, ref_loc))
            delta, items = ref, inner  # type: ignore[assignment]

    def open(self, ckpt: StoredCheckpoint, file: str, fqn: str, end: int) -> ReadHandle:
        """``ckpt``'s data file ``file``, opened once (``fqn`` names the item in errors;
        ``end``: where the item ends, how far an unplanned file is fetched at once)."""
        key = (ckpt.url, file)
        handle = self._open.get(key)
        if handle is None:
            handle = self._stack.enter_context(ckpt.open_data(file, fqn, self._ends.get(key, end)))
            self._open[key] = handle
        return handle

    def close(self) -> None:
        """Close every file opened."""
        self._open.clear()
        self._stack.close()
