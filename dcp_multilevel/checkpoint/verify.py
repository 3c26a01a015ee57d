"""Checking a whole stored checkpoint: every item read back, verified and decoded.

A load stops at the first bad item (and falls back to another copy); a check
of a copy wants the opposite: keep going and name every bad item. Each item
goes through the same verified read loads and drains use (``items.py``), so
what this calls bad is exactly what a load would refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import CorruptCheckpointError, ManifestError
from ..format import ItemLocation
from ..stores import ReadHandle
from .items import blocks_of
from .stored import StoredCheckpoint

__all__ = ["ItemProblem", "VerifyResult", "verify_checkpoint", "verify_file"]

#: Reused read buffer for uncoded items: memory stays bounded however large an item is.
_BLOCK = 16 << 20


@dataclass(frozen=True)
class ItemProblem:
    """One stored item that does not check out.

    ``start``/``end`` are the item's byte range in ``file`` (``end`` exclusive);
    ``error`` is the name of the error class, ``message`` its text.
    """

    fqn: str
    offsets: tuple[int, ...] | None
    file: str
    start: int
    end: int
    error: str
    message: str


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify_checkpoint` found: item counts, bytes read, every problem."""

    items: int
    stored_bytes: int
    problems: tuple[ItemProblem, ...]

    @property
    def ok(self) -> bool:
        """True when every item checked out."""
        return not self.problems


def verify_checkpoint(
    ckpt: StoredCheckpoint, *, on_bytes: Callable[[int], None] | None = None
) -> VerifyResult:
    """Read every item of the committed checkpoint ``ckpt``, verifying each checksum
    and decoding each compressed item; report every item that fails, not just the first.

    ``on_bytes(n)`` is called as stored bytes are checked (progress). Items
    are read file by file, in file order.

    Raises:
        CheckpointNotFoundError: ``ckpt`` is not committed.
        ManifestError: its manifest is invalid.
        OSError: the store could not be read (not a damaged item: a missing or
            wrongly sized data file, or bad bytes, are problems in the result).
    """
    manifest = ckpt.manifest()
    problems: list[ItemProblem] = []
    for file in sorted(manifest.files):
        problems += verify_file(ckpt, file, on_bytes=on_bytes)
    stored = sum(loc.length for loc in manifest.locations.values())
    return VerifyResult(len(manifest.locations), stored, tuple(problems))


def verify_file(
    ckpt: StoredCheckpoint, file: str, *, on_bytes: Callable[[int], None] | None = None
) -> list[ItemProblem]:
    """Check every item of one data file of ``ckpt`` (as :func:`verify_checkpoint` does).

    A copy being resumed checks the files already at its target this way,
    with the source's manifest (``StoredCheckpoint(store, manifest_bytes=...)``).
    A missing or wrongly sized file makes every one of its items a problem.
    """
    manifest = ckpt.manifest()
    items = sorted(
        ((index, loc) for index, loc in manifest.locations.items() if loc.file == file),
        key=lambda e: e[1].offset,
    )
    problems: list[ItemProblem] = []
    if not items:
        return problems
    try:
        with ckpt.open_data(file, items[0][0].fqn) as handle:
            for index, loc in items:
                try:
                    _check_item(ckpt, handle, index, loc)
                except (CorruptCheckpointError, ManifestError) as e:
                    problems.append(_problem(index, loc, e))
                if on_bytes is not None:
                    on_bytes(loc.length)
    except CorruptCheckpointError as e:
        # Raised when opening (an item's own error is caught above): the file is
        # missing or has the wrong size, so none of its items can be trusted.
        # The error names the item it was opened for (the file's first): each of the
        # others is named in its own problem.
        first = getattr(e, "fqn", None)
        problems = [
            _problem(index, loc, e, _naming(str(e), first, index.fqn)) for index, loc in items
        ]
        if on_bytes is not None:
            on_bytes(sum(loc.length for _, loc in items))
    return problems


def _check_item(
    ckpt: StoredCheckpoint, handle: ReadHandle, index: MetadataIndex, loc: ItemLocation
) -> None:
    if loc.transforms:
        # Decoding needs the item's whole raw buffer (chunks decode into their slice);
        # a delta item is decoded against its reference, which is checked too.
        out = memoryview(bytearray(loc.raw_length))
        ckpt.read_item(handle, index, loc, out)
    else:
        buf = memoryview(bytearray(max(1, min(_BLOCK, loc.length))))
        ckpt.read_stored(handle, index.fqn, loc, blocks_of(buf, loc.length))


def _problem(
    index: MetadataIndex, loc: ItemLocation, e: Exception, message: str | None = None
) -> ItemProblem:
    offsets = None if index.offset is None else tuple(index.offset)
    return ItemProblem(
        index.fqn,
        offsets,
        loc.file,
        loc.offset,
        loc.offset + loc.length,
        type(e).__name__,
        str(e) if message is None else message,
    )


def _naming(message: str, first: str | None, fqn: str) -> str:
    """``message``, written for item ``first``, about item ``fqn`` instead."""
    if first is None or first == fqn:
        return message
    return message.replace(f"(needed for {first!r})", f"(needed for {fqn!r})")
