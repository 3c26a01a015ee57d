"""Decoding framed items (``format/frames.py``), chunk by chunk, on a thread pool.

:func:`decode_frames` reads chunk records through a callback, checks each
chunk's checksum and bounds against the trusted sizes from the manifest, and
writes each chunk straight into its slice of the destination. zstd and numpy
release the GIL, so threads really overlap. The encoder is ``pipeline.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from typing import TYPE_CHECKING

from ..format import frames
from .base import Codec

if TYPE_CHECKING:
    from .pipeline import ReferenceSource

__all__ = ["decode_frames"]


def _decode_chunk(
    codec: Codec,
    rec: frames.ChunkRecord,
    payload: memoryview,
    out: memoryview,
    header,
    ref: Callable[[memoryview], None] | None,
    pool: Executor | None = None,
) -> None:
    if rec.method == frames.METHOD_RAW:
        out[:] = payload
    elif ref is None:
        codec.decode(payload, out, header.width, header.rotate)
    elif pool is None:  # a delta chunk: the reference's bytes, then the XOR undone onto them
        ref(out)
        codec.decode_xor(payload, out, header.width, header.rotate)
    else:  # the same, the reference decoding on the pool while this thread decodes the delta
        writing = pool.submit(ref, out)
        try:
            codec.decode_xor(payload, out, header.width, header.rotate, ready=writing.result)
        finally:
            wait([writing])  # never leave a task writing into out


def decode_frames(
    read: Callable[[int], memoryview],
    out: memoryview,
    codec: Codec,
    *,
    stored_length: int,
    pool: Executor | None,
    window: int,
    on_chunk_error: Callable[[int, str], Exception],
    reference: ReferenceSource | None = None,
) -> None:
    """Decode one item's frames, ``stored_length`` bytes pulled with ``read(n)``, into ``out``.

    ``read(n)`` returns the next ``n`` stored bytes (exactly ``n``; it is never
    asked for bytes past ``stored_length``), in a buffer that stays valid
    while decoding runs. ``len(out)`` and ``stored_length`` are the trusted
    sizes (from the manifest): the frames must decode to exactly ``len(out)``
    bytes and end exactly at ``stored_length``. ``on_chunk_error(index, why)``
    builds the exception to raise for a corrupt chunk (index -1: the header,
    -2: the framing as a whole), so messages can name checkpoint, file and item.
    ``reference``: the item's bytes in the checkpoint its delta chunks were
    coded against (None: a delta chunk is corrupt framing); it is read or
    skipped chunk by chunk on this thread (decoded by the thread that decodes
    the chunk) and finished (checked) last.
    """
    consumed = 0
    pull = read

    def read(n: int) -> memoryview:
        nonlocal consumed
        if consumed + n > stored_length:
            raise on_chunk_error(-2, f"frames run past the item's {stored_length} stored bytes")
        consumed += n
        return pull(n)

    try:
        header = frames.read_header(read, len(out))
    except frames.FrameError as e:
        raise on_chunk_error(-1, str(e)) from None
    pending: deque[Future] = deque()
    pos = 0
    index = 0
    try:
        while True:
            try:
                rec, payload = frames.read_chunk(read, header, len(out) - pos)
            except frames.FrameError as e:
                raise on_chunk_error(index, str(e)) from None
            if payload is None:
                break
            target = out[pos : pos + rec.raw_len]
            ref = None
            if rec.method == frames.METHOD_DELTA:
                if reference is None:
                    raise on_chunk_error(index, "a delta chunk in an item stored without one")
                ref = reference.take_into(rec.raw_len)  # decoded where the chunk is
            elif reference is not None:
                reference.skip(rec.raw_len)
            # The last chunk (the only one, for most tensors) is decoded here:
            # this thread would only wait for it, and a hand-off adds a wake-up.
            # A delta's reference then decodes on the pool meanwhile.
            if pool is None or pos + rec.raw_len == len(out):
                _decode_checked(
                    codec, rec, payload, target, header, ref, index, on_chunk_error, pool
                )
            else:
                # The payload buffer must outlive the task: read() returns a fresh one.
                pending.append(
                    pool.submit(
                        _decode_checked,
                        *(codec, rec, payload, target, header, ref, index, on_chunk_error),
                    )
                )
                if len(pending) >= window:
                    pending.popleft().result()
            pos += rec.raw_len
            index += 1
        while pending:
            pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
    if pos != len(out):
        raise on_chunk_error(index, f"frames end after {pos} of {len(out)} bytes")
    if consumed != stored_length:
        raise on_chunk_error(-2, f"{stored_length - consumed} stored bytes follow the last frame")
    if reference is not None:
        reference.finish()


def _decode_checked(
    codec, rec, payload, target, header, ref, index, on_chunk_error, pool=None
) -> None:
    try:
        _decode_chunk(codec, rec, payload, target, header, ref, pool)
    except ValueError as e:
        raise on_chunk_error(index, str(e)) from None
