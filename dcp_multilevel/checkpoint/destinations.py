"""Where a loaded item's bytes land, and how verified bytes are handed to DCP.

The reader reads each item of a load plan into the memory :func:`destination`
returns, and calls the returned ``commit`` only once the item's bytes have
matched their checksum (fail closed: unverified bytes never reach the
``LoadPlanner``).

- Tensors land straight in the destination tensor when it is a whole,
  contiguous CPU chunk of the stored dtype (no copy).
- A whole, contiguous CUDA chunk of the stored dtype, stored as it is (no
  codec, no delta), is streamed: its bytes pass through two page-locked
  blocks of :data:`BOUNCE_BYTES` per reading thread (:class:`Bounce`), each
  hashed while in cache and copied to the device without waiting while the
  other is read. No host copy of the item, pinned memory bounded by the
  threads, the bus busy while the file is read.
- Otherwise the bytes land in a scratch buffer that ``commit`` narrows to the
  requested region and copies (for a CUDA destination: pinned, copied
  without waiting).
- Copies into CUDA tensors are queued on the reading thread's current stream,
  which the reader orders after the work the caller queued before the load
  (``streams.StreamMarks``), and are done when the load returns.
- Pinned blocks come from torch's caching host allocator, reused item after
  item, and are handed back to the driver once a load is done
  (:func:`.pinned.release_pinned`).
- Non-tensor objects are loaded with ``torch.load(weights_only=True)`` and
  re-serialized before DCP's planner sees them (:func:`vetted_bytes`),
  because ``DefaultLoadPlanner.load_bytes`` itself unpickles with
  ``weights_only=False``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import ManifestError, UnsafeObjectError
from ..format import ItemLocation
from ..format.objects import bytesio_for_planner, bytesio_payload, load_object
from ..format.tensor_bytes import byte_view
from .pinned import host_scratch
from .stored import StoredCheckpoint

__all__ = ["BOUNCE_BYTES", "Bounce", "Landing", "destination", "vetted_bytes"]

#: Bytes of each of a reading thread's two page-locked blocks (:class:`Bounce`).
BOUNCE_BYTES = 4 << 20


@dataclass(frozen=True)
class Landing:
    """Where one item's bytes go: into ``out`` (``read_item``), or, when ``out`` is
    None, read into ``blocks`` one after another with ``on_block`` taking each
    full one (``read_stored``; an item streamed into a CUDA tensor). ``commit``
    hands the item to DCP once its bytes were verified."""

    commit: Callable[[], None]
    out: memoryview | None = None
    blocks: Iterator[memoryview] | None = None
    on_block: Callable[[memoryview], None] | None = None


class Bounce:
    """Two page-locked blocks one reading thread streams items through into device
    tensors: a block is read (and hashed) while the other is copied.

    Call order, on one thread: :meth:`landing` per item, whose blocks are read
    and handed to its ``on_block`` one by one (``items.read_stored``), then
    :meth:`drain` once, after the last item. The blocks are allocated at the
    first item (pinned for a CUDA tensor) and dropped with the object.
    """

    def __init__(self, block_bytes: int = BOUNCE_BYTES) -> None:
        self.block_bytes = block_bytes
        self._blocks: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._copied: list[Any] = [None, None]  # CUDA event of each block's last copy

    def landing(self, target: torch.Tensor, nbytes: int, commit: Callable[[], None]) -> Landing:
        """The landing of ``nbytes`` stored bytes that are exactly ``target``'s
        (contiguous, of the stored dtype), copied into it block by block."""
        on_cuda = target.device.type == "cuda"
        if not self._blocks:
            self._blocks = [
                host_scratch((self.block_bytes,), torch.uint8, pinned=on_cuda) for _ in range(2)
            ]
            self._views = [byte_view(b) for b in self._blocks]
        dst = target.reshape(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(target.device) if on_cuda else None
        turn = [0, 0]  # which block is being filled; where its bytes go in dst

        def blocks() -> Iterator[memoryview]:
            for start in range(0, nbytes, self.block_bytes):
                k = turn[0] = 1 - turn[0]
                if self._copied[k] is not None:
                    self._copied[k].synchronize()  # its last copy read it: refill
                turn[1] = start
                yield self._views[k][: min(self.block_bytes, nbytes - start)]

        def on_block(view: memoryview) -> None:
            k, start = turn
            dst[start : start + len(view)].copy_(self._blocks[k][: len(view)], non_blocking=True)
            if stream is not None:  # a fresh event: the tensors may be on several devices
                self._copied[k] = torch.cuda.Event()
                self._copied[k].record(stream)

        return Landing(commit, blocks=blocks(), on_block=on_block)

    def drain(self) -> None:
        """Return once every copy made from the blocks is done (they may be dropped)."""
        for event in self._copied:
            if event is not None:
                event.synchronize()


def destination(
    copy: StoredCheckpoint,
    req: ReadItem,
    loc: ItemLocation,
    planner: LoadPlanner,
    bounce: Bounce | None = None,
) -> Landing:
    """Where to read ``req``'s bytes, and how to hand them to DCP once verified.

    Args:
        copy: the copy the item is read from (its manifest is already loaded).
        req: the load plan's item.
        loc: where ``copy`` stores the item (``loc.raw_length`` bytes once decoded).
        planner: DCP's load planner, which resolves and receives the item.
        bounce: the reading thread's blocks for streaming into a CUDA tensor
            (None: every item lands in memory).

    Returns:
        The item's :class:`Landing`: ``out`` takes exactly ``loc.raw_length``
        bytes, or its blocks take ``loc.length`` stored bytes (a raw item);
        ``commit()`` hands them to ``planner``, to be called only after they
        were verified.

    Raises:
        ManifestError: the destination tensor's shape differs from the
            requested region (wrong for every copy).
        UnsafeObjectError: from ``commit``: a non-tensor object is refused by
            ``weights_only`` loading.
    """
    fqn = req.storage_index.fqn
    if req.type == LoadItemType.BYTE_IO:
        buf = bytearray(loc.raw_length)

        def commit_bytes() -> None:
            payload = bytesio_payload(buf)  # an io.BytesIO value: handed back, not unpickled
            value = bytesio_for_planner(payload) if payload is not None else None
            planner.load_bytes(req, value or vetted_bytes(bytes(buf), fqn, copy.url))

        return Landing(commit_bytes, out=memoryview(buf))
    md = copy.manifest().metadata.state_dict_metadata[fqn]
    assert not isinstance(md, BytesStorageMetadata)  # the manifest decoder checked
    dtype = md.properties.dtype
    chunk_sizes = _chunk_sizes(md, req.storage_index)
    target = planner.resolve_tensor(req).detach()
    whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == chunk_sizes
    exact = (
        whole
        and target.dtype == dtype
        and target.is_contiguous()
        and tuple(target.shape) == chunk_sizes
    )
    # Fast paths: the destination's memory is the read buffer (no copy), or takes
    # the bytes block by block. It holds unverified bytes until the read returns;
    # a failed item is read again (from another copy) or the load fails, so none
    # is committed.
    if exact and target.device.type == "cpu":
        return Landing(lambda: planner.commit_tensor(req, target), out=byte_view(target))
    raw = not loc.transforms and loc.reference is None
    if exact and raw and bounce is not None and target.device.type == "cuda":
        return bounce.landing(target, loc.length, lambda: planner.commit_tensor(req, target))
    if tuple(target.shape) != tuple(req.lengths):
        raise ManifestError(
            f"item {fqn!r}: destination has shape {tuple(target.shape)} but the "
            f"checkpoint region has {tuple(req.lengths)}",
            checkpoint=copy.url,
        )
    # A CUDA destination: read into page-locked memory and copy without waiting.
    # The caching host allocator keeps each block until its copy has run (it
    # records an event on the stream), then reuses it for a later item: no fresh
    # pages to fault in per item, and the copy overlaps the next item's read.
    # The reader waits for the stream before the load returns.
    on_cuda = target.device.type == "cuda"
    scratch = host_scratch((loc.raw_length,), torch.uint8, pinned=on_cuda)

    def commit_tensor() -> None:
        src = scratch.view(dtype).reshape(chunk_sizes)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            src = src.narrow(dim, start, length)
        if dtype == torch.bool and target.dtype == torch.bool:
            # As bytes: a bool copy kernel rewrites bytes other than 0 and 1.
            target.view(torch.uint8).copy_(src.view(torch.uint8), non_blocking=on_cuda)
        else:
            target.copy_(src, non_blocking=on_cuda)
        planner.commit_tensor(req, target)

    return Landing(commit_tensor, out=byte_view(scratch))


def _chunk_sizes(md: Any, index: MetadataIndex) -> tuple[int, ...]:
    for chunk in md.chunks:
        if chunk.offsets == index.offset:
            return tuple(chunk.sizes)
    raise KeyError(index)  # unreachable: the manifest decoder matched every item


def vetted_bytes(raw: bytes, fqn: str, checkpoint: str) -> io.BytesIO:
    """Re-serialize a stored object after loading it with ``weights_only=True``.

    The planner then unpickles only what we produced from an allowed object,
    never the checkpoint's own bytes.

    Raises:
        UnsafeObjectError: ``weights_only`` loading refuses the object (names
            ``fqn``, ``checkpoint`` and how to allow the type).
    """
    obj, refused = load_object(raw)
    if refused is not None:
        raise UnsafeObjectError(
            f"object {fqn!r} in checkpoint {checkpoint} cannot be loaded with "
            f"weights_only=True: {refused}. If you trust this checkpoint and the type is "
            "yours, allow it with torch.serialization.add_safe_globals([...])."
        )
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out
