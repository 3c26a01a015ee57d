"""Chunked, multi-threaded coding of one item into frames (``format/frames.py``).

Encoding reads the source memory chunk by chunk (no copy of the tensor) and
keeps at most ``2 * threads`` chunks in flight, yielding framed bytes in order;
decoding reads chunk records through a callback and writes each chunk straight
into its slice of the destination. Memory is bounded by the window, never by
the item's size. zstd and numpy release the GIL, so threads really overlap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future

import xxhash

from ..format import frames
from .base import Codec

__all__ = ["decode_frames", "encode_chunk", "encode_frames"]


def encode_chunk(codec: Codec, chunk: memoryview, width: int, rotate: bool) -> list:
    """One framed chunk: ``[record, payload]`` (payload raw when coding does not pay)."""
    coded = codec.encode(chunk, width, rotate)
    method, payload = (frames.METHOD_RAW, chunk) if coded is None else (frames.METHOD_CODED, coded)
    checksum = xxhash.xxh3_64_intdigest(payload)
    return [frames.pack_chunk(method, len(chunk), len(payload), checksum), payload]


def encode_frames(
    view: memoryview,
    codec: Codec,
    *,
    width: int,
    rotate: bool,
    chunk_size: int,
    pool: Executor | None,
    window: int,
) -> Iterator[bytes | memoryview]:
    """Yield the framed encoding of ``view`` (header, chunks, terminator), in order."""
    chunk_size -= chunk_size % width
    yield frames.pack_header(width, rotate, chunk_size, len(view))
    starts = range(0, len(view), chunk_size)
    if pool is None:
        for start in starts:
            yield from encode_chunk(codec, view[start : start + chunk_size], width, rotate)
    else:
        pending: deque[Future] = deque()
        for start in starts:
            chunk = view[start : start + chunk_size]
            pending.append(pool.submit(encode_chunk, codec, chunk, width, rotate))
            if len(pending) >= window:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    yield frames.pack_chunk(frames.METHOD_RAW, 0, 0, 0)


def _decode_chunk(
    codec: Codec, rec: frames.ChunkRecord, payload: memoryview, out: memoryview, header
) -> None:
    if rec.method == frames.METHOD_RAW:
        out[:] = payload
    else:
        codec.decode(payload, out, header.width, header.rotate)


def decode_frames(
    read: Callable[[int], memoryview],
    out: memoryview,
    codec: Codec,
    *,
    pool: Executor | None,
    window: int,
    on_chunk_error: Callable[[int, str], Exception],
) -> None:
    """Decode framed bytes (pulled with ``read(n)``, exactly n bytes) into ``out``.

    ``len(out)`` is the trusted size (from the manifest): the frames must decode
    to exactly that. ``on_chunk_error(index, why)`` builds the exception to raise
    for a corrupt chunk, so messages can name checkpoint, file and item.
    """
    try:
        header = frames.unpack_header(read(frames.HEADER.size))
    except frames.FrameError as e:
        raise on_chunk_error(-1, str(e)) from None
    if header.raw_total not in (len(out), frames.UNKNOWN_TOTAL):
        raise on_chunk_error(-1, f"frame holds {header.raw_total} bytes, expected {len(out)}")
    pending: deque[Future] = deque()
    pos = 0
    index = 0
    try:
        while True:
            rec = frames.unpack_chunk(read(frames.CHUNK.size))
            if rec.is_terminator:
                break
            try:
                frames.check_chunk(rec, header, len(out) - pos)
            except frames.FrameError as e:
                raise on_chunk_error(index, str(e)) from None
            payload = read(rec.stored_len)
            if xxhash.xxh3_64_intdigest(payload) != rec.checksum:
                raise on_chunk_error(index, "its checksum does not match its bytes")
            target = out[pos : pos + rec.raw_len]
            if pool is None:
                _decode_checked(codec, rec, payload, target, header, index, on_chunk_error)
            else:
                # The payload buffer must outlive the task: read() returns a fresh one.
                pending.append(
                    pool.submit(
                        _decode_checked, codec, rec, payload, target, header, index, on_chunk_error
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


def _decode_checked(codec, rec, payload, target, header, index, on_chunk_error) -> None:
    try:
        _decode_chunk(codec, rec, payload, target, header)
    except ValueError as e:
        raise on_chunk_error(index, str(e)) from None
