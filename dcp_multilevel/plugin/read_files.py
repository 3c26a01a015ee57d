"""One data file of a :class:`~dcp_multilevel.MultiLevelReader` load, and the runs it is cut into.

:func:`split_runs` cuts a copy's reads, per file in offset order, into as many
runs as there are threads; :func:`read_file` reads one run from one copy, each
item into its destination (``checkpoint/destinations.py``) and verified before
it is committed. What failed is returned, not raised: the reader reads it from
the next copy.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing

from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..checkpoint import StoredCheckpoint
from ..checkpoint.destinations import Bounce, destination
from ..checkpoint.fallback import Failure
from ..checkpoint.reference import ReferenceFiles
from ..checkpoint.streams import StreamMarks
from ..errors import CorruptCheckpointError, ManifestError
from ..format import ItemLocation

__all__ = ["COPY_ERRORS", "read_file", "split_runs"]

#: Errors that condemn one copy of an item (or of a whole file) but not the
#: load: the item is read from the next copy. Corruption and missing files are
#: OSErrors, and so are I/O failures (EIO, a remote that stays down); a
#: ManifestError here means the copy's item needs a codec that is not installed.
COPY_ERRORS = (OSError, ManifestError)


def read_file(
    copy: StoredCheckpoint,
    file: str,
    reqs: list[tuple[int, ReadItem, ItemLocation]],
    planner: LoadPlanner,
    codec_pool: Callable[[], ThreadPoolExecutor | None],
    window: int,
    marks: StreamMarks | None = None,
) -> tuple[int, list[Failure]]:
    """Read ``reqs`` (sorted by offset) from one data file; (served, failures).

    ``codec_pool`` gives the pool coded items are decoded in (None: inline) when
    the first one comes; ``window``: chunks in flight while decoding. Copies
    into device tensors are queued after ``marks`` (none: after this thread's
    current stream); the caller waits for them (``StreamMarks.finish``).
    """
    served = 0
    failures: list[Failure] = []
    limit = max(loc.offset + loc.length for _, _, loc in reqs)
    with ExitStack() as stack:
        stack.enter_context((marks or StreamMarks()).following())
        try:
            handle = stack.enter_context(copy.open_data(file, reqs[0][1].storage_index.fqn, limit))
        except COPY_ERRORS as e:
            return 0, [Failure(i, req, file, e, whole_file=True) for i, req, _ in reqs]
        references = stack.enter_context(closing(ReferenceFiles()))
        references.plan(copy, [(req.storage_index, loc) for _, req, loc in reqs])
        bounce = Bounce()  # blocks allocated at its first CUDA item
        stack.callback(bounce.drain)  # the load ends once its copies are done
        for n, (i, req, loc) in enumerate(reqs):
            # Outside the try: a destination of the wrong shape is wrong for
            # every copy, and so is an object refused by weights_only loading.
            landing = destination(copy, req, loc, planner, bounce)
            try:
                if landing.out is None:
                    copy.read_stored(
                        handle, req.storage_index.fqn, loc, landing.blocks, landing.on_block
                    )
                else:
                    copy.read_item(
                        handle,
                        req.storage_index,
                        loc,
                        landing.out,
                        pool=codec_pool(),
                        window=window,
                        references=references,
                    )
            except COPY_ERRORS as e:
                if isinstance(e, (CorruptCheckpointError, ManifestError)):
                    failures.append(Failure(i, req, file, e, whole_file=False))
                    continue
                # An I/O error (EIO, a remote that stays down): do not wait out
                # the retries of every further item of this file on this copy.
                failures += [Failure(j, r, file, e, whole_file=True) for j, r, _ in reqs[n:]]
                break
            landing.commit()
            served += 1
    return served, failures


def split_runs(
    jobs: list[tuple[str, list[tuple[int, ReadItem, ItemLocation]]]], threads: int
) -> list[tuple[str, list[tuple[int, ReadItem, ItemLocation]]]]:
    """``jobs`` (per file, items in offset order) cut into more runs of adjacent items
    while there are fewer than ``threads``: the largest run is halved by bytes. A
    checkpoint written as one file per rank is then read by several threads."""
    jobs = list(jobs)
    while len(jobs) < threads:
        splittable = [j for j in range(len(jobs)) if len(jobs[j][1]) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda j: sum(loc.length for _, _, loc in jobs[j][1]))
        file, reqs = jobs.pop(k)
        half, seen, cut = sum(loc.length for _, _, loc in reqs) / 2, 0, 1
        for n, (_, _, loc) in enumerate(reqs[:-1], start=1):
            seen += loc.length
            cut = n
            if seen >= half:
                break
        jobs += [(file, reqs[:cut]), (file, reqs[cut:])]
    return jobs
