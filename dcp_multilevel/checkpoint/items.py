"""Reading stored items back, verified: the one primitive loads and drains share.

Every byte that leaves a stored checkpoint (into a tensor on load, into
another level on a drain) goes through :func:`read_item` or
:func:`read_stored`, which check it against the item's checksum in the
manifest. A caller never sees unverified bytes as good ones: on a mismatch
these raise, and what the caller wrote into its buffers or sink meanwhile
must be thrown away (the reader reads the item again from another copy; a
drain discards the file it was writing, which no manifest names yet).

Errors name the checkpoint, file, item and byte range (an :class:`ItemRef`),
and are the same whichever path reads the item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from ..codecs import Codec, ReferenceSource, codec_from_descriptor, decode_frames, scratch
from ..errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    ManifestError,
    RegistryError,
    TruncatedDataError,
)
from ..format import Hasher, ItemLocation
from ..format.tensor_bytes import pieces
from ..stores import ReadHandle

__all__ = [
    "ItemRef",
    "blocks_of",
    "item_codec",
    "read_item",
    "read_stored",
    "truncated",
    "verify",
]


@dataclass(frozen=True)
class ItemRef:
    """Which stored item is being read: named in every error about it."""

    checkpoint: str  # URL of the stored checkpoint
    fqn: str
    loc: ItemLocation


def read_item(
    handle: ReadHandle,
    ref: ItemRef,
    out: memoryview,
    *,
    pool: Executor | None = None,
    window: int = 1,
    reference: ReferenceSource | None = None,
) -> None:
    """Put the item's decoded bytes (``ref.loc.raw_length`` of them) into ``out``, verified.

    ``handle`` is the open data file ``ref.loc.file``. ``out`` holds verified
    bytes only when this returns; on an error it may hold anything. Coded
    items are streamed frame by frame (memory bounded by ``window`` chunks),
    decoded on ``pool`` when given. A delta item (``ref.loc.reference``)
    needs ``reference``, the stream of the same item in its reference
    checkpoint (``reference.py``); it is finished (checked) here.

    Raises:
        CorruptCheckpointError: the stored bytes do not match the manifest
            (``ChecksumMismatchError``, ``TruncatedDataError``, a corrupt frame).
        ManifestError: the item needs a codec this installation lacks.
        OSError: the storage could not be read.
    """
    loc = ref.loc
    if not loc.transforms:
        read_stored(handle, ref, pieces(out))
        return
    codec = item_codec(ref)
    hasher = Hasher()
    pos = loc.offset
    # Without a pool every chunk is decoded before the next read, so one buffer
    # per thread serves them all: a fresh one per chunk is page-faulted (and a
    # bytearray zero-filled) for every chunk.
    reuse = pool is None

    def read(n: int) -> memoryview:
        nonlocal pos
        buf = memoryview(scratch("item_read", n) if reuse else np.empty(n, np.uint8))
        got = handle.read_into(pos, buf)
        if got != n:
            raise truncated(ref, pos + got)
        hasher.update(buf)
        pos += n
        return buf

    def chunk_error(index: int, why: str) -> CorruptCheckpointError:
        where = "framing" if index < 0 else f"chunk {index}"
        return CorruptCheckpointError(
            f"compressed item {ref.fqn!r} in {loc.file!r} of checkpoint {ref.checkpoint} is "
            f"corrupt: {where}: {why}. Load from another copy.",
            checkpoint=ref.checkpoint,
            file=loc.file,
            fqn=ref.fqn,
        )

    decode_frames(
        read,
        out,
        codec,
        stored_length=loc.length,
        pool=pool,
        window=window,
        on_chunk_error=chunk_error,
        reference=reference,
    )
    verify(hasher, ref)


def read_stored(
    handle: ReadHandle,
    ref: ItemRef,
    blocks: Iterable[memoryview],
    on_block: Callable[[memoryview], None] | None = None,
) -> None:
    """Read the item's stored bytes, as they are, into ``blocks`` one after another.

    ``blocks`` must cover exactly ``ref.loc.length`` bytes: pieces of one
    destination buffer, or one reused buffer again and again
    (:func:`blocks_of`), with ``on_block`` taking each block once it is full
    (a drain streaming the bytes on). The checksum is checked after the last
    block, so ``on_block`` sees the bytes before they are known good.

    Raises:
        TruncatedDataError: the file ends inside the item.
        ChecksumMismatchError: the bytes do not match the manifest's checksum.
        OSError: the storage could not be read.
    """
    loc = ref.loc
    hasher = Hasher()
    pos = loc.offset
    for block in blocks:
        n = handle.read_into(pos, block)
        if n != len(block):
            raise truncated(ref, pos + n)
        hasher.update(block)
        if on_block is not None:
            on_block(block)
        pos += n
    verify(hasher, ref)


def blocks_of(buf: memoryview, length: int) -> Iterator[memoryview]:
    """``buf`` (or its head) again and again, covering ``length`` bytes in all."""
    pos = 0
    while pos < length:
        view = buf[: min(len(buf), length - pos)]
        yield view
        pos += len(view)


def item_codec(ref: ItemRef) -> Codec:
    """The codec that decodes the item (from its manifest descriptor).

    Raises:
        ManifestError: the item is not stored with exactly one codec, or needs
            one this installation lacks (the message says which).
    """
    loc = ref.loc
    if len(loc.transforms) != 1:
        raise ManifestError(
            f"item {ref.fqn!r} in {loc.file!r} of checkpoint {ref.checkpoint} has transforms "
            f"{list(loc.transforms)}; dcp_multilevel applies exactly one codec per item",
            checkpoint=ref.checkpoint,
        )
    try:
        return codec_from_descriptor(loc.transforms[0])
    except RegistryError as e:
        raise ManifestError(
            f"item {ref.fqn!r} in {loc.file!r} of checkpoint {ref.checkpoint} needs codec "
            f"{loc.transforms[0]!r}: {e}",
            checkpoint=ref.checkpoint,
        ) from None


def truncated(ref: ItemRef, at: int) -> TruncatedDataError:
    """The error for the item's file ending at byte ``at``, inside or before the item."""
    loc = ref.loc
    return TruncatedDataError(
        f"data file {loc.file!r} of checkpoint {ref.checkpoint} ended at byte {at} "
        f"inside item {ref.fqn!r} (bytes {loc.offset}..{loc.offset + loc.length})",
        checkpoint=ref.checkpoint,
        file=loc.file,
        fqn=ref.fqn,
    )


def verify(hasher: Hasher, ref: ItemRef) -> None:
    """Raise ChecksumMismatchError unless ``hasher`` (over all the item's stored bytes)
    matches the manifest's checksum."""
    actual = hasher.hexdigest()
    loc = ref.loc
    if actual != loc.checksum:
        raise ChecksumMismatchError(
            f"checksum mismatch for item {ref.fqn!r} in {loc.file!r} of checkpoint "
            f"{ref.checkpoint} (bytes {loc.offset}..{loc.offset + loc.length}): "
            f"stored {loc.checksum}, read {actual}. The data is corrupt; load from "
            "another copy.",
            checkpoint=ref.checkpoint,
            file=loc.file,
            fqn=ref.fqn,
        )
