"""One data file of a :class:`~dcp_multilevel.MultiLevelWriter` save: coded and written.

The writer's ``write_data`` cuts its rank's items into buckets, one data file
each; :func:`write_file` writes one of them, coding chunks ahead in the
writer's codec pool while it hashes and writes (``codecs/pipeline.py``), and
storing each chunk as raw, coded, or coded XOR the reference's bytes
(``checkpoint/save_reference.py``). It reads the writer's codec, buffers and
reference as the writer set them up.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, closing
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..checkpoint.sources import object_record, tensor_of
from ..codecs import EncodeJob, encode_items, item_layout
from ..format import Hasher, ItemLocation
from ..format.tensor_bytes import byte_view
from ..staging.live import LiveCountdown

if TYPE_CHECKING:
    from .writer import MultiLevelWriter

__all__ = ["write_file"]

#: Chunks in flight per codec thread: enough to keep every thread busy while
#: the writer thread hashes and writes (a few MiB each; bounds memory).
_WINDOW_PER_THREAD = 3


def write_file(
    writer: MultiLevelWriter,
    path: str,
    items: list[WriteItem],
    planner: SavePlanner,
    lock: threading.Lock,
    countdown: LiveCountdown,
) -> list[WriteResult]:
    """Write ``items`` to one data file, coding ahead in the pool while writing.

    ``encode_items`` keeps a window of chunks from this item and the next
    ones in the codec pool, so coding overlaps the hashing and writing
    done here; memory stays bounded by that window.
    """
    results = []
    c = writer.compression
    pool = writer._pool()
    streams = ExitStack()  # the reference's data files, while their items are coded
    coded = encode_items(
        _jobs(writer, path, items, planner, lock, streams), writer._codec,
        chunk_size=c.chunk_size if c else 0, pool=pool,
        window=_WINDOW_PER_THREAD * c.threads if c and pool else 1,
        buffers=writer._payload_buffers,
    )  # fmt: skip
    with writer.store.open_write(path) as out, streams, closing(coded):
        pad_for = getattr(out, "pad_for", None)  # a direct-I/O file (stores/_direct.py)
        for job, parts in coded:
            if pad_for is not None and job.layout is None:
                pad_for(job.view)  # a big tensor then goes to the disk uncopied
            start = out.tell()
            hasher = Hasher()
            for piece in parts:
                hasher.update(piece)
                out.write(piece)
            length = out.tell() - start
            transforms = () if job.layout is None else (writer._codec.descriptor,)  # type: ignore[union-attr]
            raw = len(job.view)
            src = job.reference
            ref = src.loc.checksum if src is not None and src.used else None  # type: ignore[attr-defined]
            loc = ItemLocation(path, start, length, raw, hasher.hexdigest(), transforms, ref)
            results.append(WriteResult(index=job.key.index, size_in_bytes=length, storage_data=loc))
            countdown.written(job.key.index)
    return results


def _jobs(
    writer: MultiLevelWriter,
    path: str,
    items: list[WriteItem],
    planner: SavePlanner,
    lock: threading.Lock,
    streams: ExitStack,
) -> Iterator[EncodeJob]:
    """Each item's bytes and how to store them, resolved as the coder asks for them.

    A framed item the reference holds alike gets its reference stream
    (opened here, closed by ``streams`` at the latest).
    """
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            record = object_record(planner, item, lock)
            yield EncodeJob(item, record, None, f"item {item.index.fqn!r} of {path}")
        else:
            tensor = tensor_of(item, planner.resolve_data(item))
            view = byte_view(tensor)
            layout = item_layout(view, tensor.dtype, writer._codec, writer.compression)
            source = (
                writer._delta.stream_of(writer.checkpoint, item, streams)
                if layout is not None and writer._delta is not None
                else None
            )
            name = f"item {item.index.fqn!r} of {path}"
            yield EncodeJob(item, view, layout, name, source)
