"""Reading one checkpoint from a chain of copies: what failed where, what to say.

The reader (``reader.py``) tries the copies of a checkpoint in order; this
module keeps its :class:`Trail` (which copy failed for which item, and why),
logs the warnings when it moves on to the next copy, and builds the error
raised when no copy can serve an item, naming every copy tried. It also
decides whether two copies hold the same checkpoint (:func:`metadata_difference`)
and whether a fallback copy may serve a load (:func:`unusable_copy`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpMultilevelError,
    ManifestError,
    RemoteStoreError,
)
from ..format.dtypes import dtype_name
from .stored import StoredCheckpoint

__all__ = ["Failure", "Trail", "item_name", "metadata_difference", "restate", "unusable_copy"]

# The reader's logger: users configure one name for everything about loading.
logger = logging.getLogger("dcp_multilevel.reader")


@dataclass(frozen=True)
class Failure:
    """One item that one copy could not serve."""

    index: int  # position in the load plan
    req: ReadItem
    file: str
    error: Exception
    whole_file: bool  # the data file failed (missing, wrong size, I/O), not just this item


@dataclass
class Trail:
    """What went wrong on which copy during one load (one rank).

    ``skipped``: copies whose manifest could not be used, before the copy
    that read_metadata chose; ``items``: per plan position, every copy tried
    for that item after it, with the error and whether the copy got as far
    as reading the item's bytes (False: the whole copy was unusable).
    """

    primary: str  # URL of the first copy, to name the checkpoint
    skipped: list[tuple[str, Exception]] = field(default_factory=list)
    items: dict[int, list[tuple[str, Exception, bool]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    # ------------------------------------------------------------ read_metadata

    def skip(self, url: str, error: Exception, after: str | None) -> None:
        """Copy ``url`` has no usable manifest; ``after`` is tried next (None: none left)."""
        self.skipped.append((url, error))
        if after is not None:
            logger.warning(
                "dcp_multilevel: cannot use the copy at %s (%s); reading the checkpoint from %s",
                url,
                error,
                after,
            )

    def no_usable_copy(self) -> Exception:
        """The error when no copy has a usable manifest.

        With one copy, its own error. Otherwise the first copy's error, unless
        it is "missing" and another copy exists but is damaged: then the first
        damage (a caller must not take a damaged checkpoint for an absent one).
        """
        if len(self.skipped) == 1:
            return self.skipped[0][1]
        errors = [e for _, e in self.skipped]
        chosen = next((e for e in errors if not isinstance(e, CheckpointNotFoundError)), errors[0])
        what = "exists" if isinstance(chosen, CheckpointNotFoundError) else "can be used"
        return _summary(
            chosen,
            f"no copy of checkpoint {self.primary} {what}; check the locations, or load an "
            "earlier checkpoint",
            [(url, e) for url, e in self.skipped],
        )

    # ------------------------------------------------------------ read_data

    def unusable(self, url: str, error: Exception, pending: list[int], after: str | None) -> None:
        """Fallback copy ``url`` cannot serve any of the ``pending`` items."""
        for i in pending:
            self.items[i].append((url, error, False))
        if after is not None:
            logger.warning(
                "dcp_multilevel: cannot use the copy at %s for %d item(s) (%s); reading them "
                "from %s",
                url,
                len(pending),
                error,
                after,
            )

    def failed(self, url: str, failures: list[Failure], after: str | None) -> None:
        """Copy ``url`` could not serve ``failures``; ``after`` is tried next."""
        whole_files: dict[str, list[Failure]] = defaultdict(list)
        for f in failures:
            self.items[f.index].append((url, f.error, True))
            if after is None:
                continue
            if f.whole_file:
                whole_files[f.file].append(f)
                continue
            what = "is corrupt" if isinstance(f.error, CorruptCheckpointError) else "cannot be read"
            logger.warning(
                "dcp_multilevel: item %s in %s of %s %s (%s); reading it from %s",
                item_name(f.req),
                f.file,
                url,
                what,
                f.error,
                after,
            )
        for file, fs in whole_files.items():
            logger.warning(
                "dcp_multilevel: data file %s of %s cannot be read (%s); reading its %d "
                "item(s) from %s",
                file,
                url,
                fs[0].error,
                len(fs),
                after,
            )

    def unreadable(self, pending: list[tuple[int, ReadItem]]) -> Exception:
        """The error when no copy could serve the ``pending`` items (named: the first).

        With one copy in all, its own error, unchanged. Otherwise the error of
        the last copy that got as far as reading the item (e.g. a checksum
        mismatch rather than "this copy has no manifest"), its message listing
        every copy tried, including those skipped by read_metadata.
        """
        index, req = pending[0]
        tried = [(url, e, False) for url, e in self.skipped] + self.items[index]
        if len(tried) == 1:
            return tried[0][1]
        last = next((e for _, e, reached in reversed(tried) if reached), tried[-1][1])
        more = f" ({len(pending) - 1} more item(s) failed on every copy too)" if pending[1:] else ""
        return _summary(
            last,
            f"item {item_name(req)} cannot be read from any copy of checkpoint {self.primary}; "
            "load an earlier checkpoint",
            [(url, e) for url, e, _ in tried],
            more,
        )


def _summary(
    err: Exception, headline: str, tried: list[tuple[str, Exception]], tail: str = ""
) -> Exception:
    where = "; ".join(f"({n}) {url}: {e}" for n, (url, e) in enumerate(tried, 1))
    out = restate(err, f"{headline}. Tried {len(tried)} locations, in order: {where}{tail}")
    out.__cause__ = err
    return out


def item_name(req: ReadItem) -> str:
    """``'fqn'``, with the chunk's offsets when it is not the first chunk."""
    index = req.storage_index
    if index.offset is None or not any(index.offset):
        return repr(index.fqn)
    return f"{index.fqn!r} (chunk at offsets {list(index.offset)})"


def unusable_copy(copy: StoredCheckpoint, in_use: StoredCheckpoint) -> Exception | None:
    """Why fallback ``copy`` cannot serve items of a load from ``in_use``, or None if it can.

    ``in_use`` is the copy whose manifest steers the load (already read). A
    copy stands in only for the same save: its manifest must be readable, its
    DCP metadata equal (:func:`metadata_difference`) and its ``save_id`` the
    same. The reason is returned, not raised: the reader records it and moves
    on to the next copy.
    """
    try:
        manifest = copy.manifest()
    except (DcpMultilevelError, OSError) as e:
        return e
    diff = metadata_difference(in_use.manifest().metadata, manifest.metadata)
    if diff is None:
        if manifest.save_id == in_use.manifest().save_id:
            return None
        # Same shapes, another save (e.g. the step saved again by another
        # run): mixing its items with the copy in use would load a state
        # that never existed.
        return ManifestError(
            f"the copy at {copy.url} holds another save than the copy in use "
            f"({in_use.url}) and is not used: its save_id is {manifest.save_id!r}, the "
            f"copy in use has {in_use.manifest().save_id!r}. Only copies drained from "
            "the same save can stand in for each other.",
            checkpoint=copy.url,
        )
    return ManifestError(
        f"the copy at {copy.url} holds another checkpoint than the copy in use "
        f"({in_use.url}) and is not used: their DCP metadata differ ({diff}). Check "
        "that the fallbacks name copies of the same checkpoint (same step).",
        checkpoint=copy.url,
    )


def metadata_difference(in_use: Metadata, candidate: Metadata) -> str | None:
    """How ``candidate``'s DCP metadata differs from ``in_use``'s, or None if it does not.

    Two copies of one checkpoint describe the same state (tensors, dtypes,
    chunks, non-tensor items, the planner's flatten mapping); only their
    storage (files, offsets, encodings) may differ. The text calls the copy
    of ``candidate`` "it" and the other "the copy in use".
    """
    a, b = in_use.state_dict_metadata, candidate.state_dict_metadata
    if a.keys() != b.keys():
        parts = []
        if missing := sorted(a.keys() - b.keys()):
            parts.append(f"it lacks {_few(missing)}")
        if extra := sorted(b.keys() - a.keys()):
            parts.append(f"it has {_few(extra)}, which the copy in use lacks")
        return " and ".join(parts)
    for fqn, md in a.items():
        if md != b[fqn]:
            return f"it stores {fqn!r} as {_describe(b[fqn])}, the copy in use as {_describe(md)}"
    if in_use.planner_data != candidate.planner_data:
        return "its planner_data (how the state_dict nests) differs from the copy in use"
    return None


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = len(names) - limit
    return f"{shown} and {more} more" if more > 0 else shown


def _describe(md: Any) -> str:
    if isinstance(md, BytesStorageMetadata):
        return "a non-tensor object"
    dtype = dtype_name(md.properties.dtype)
    if len(md.chunks) == 1:
        chunks = str([list(md.chunks[0].sizes)])
    else:
        chunks = ", ".join(f"{list(c.sizes)} at {list(c.offsets)}" for c in md.chunks)
        chunks = f"[{chunks}]"
    grad = ", requires_grad" if md.properties.requires_grad else ""
    return f"a {dtype} tensor of size {list(md.size)} (chunks {chunks}{grad})"


def restate(err: Exception, message: str) -> Exception:
    """An error of ``err``'s type and fields with a new ``message``.

    Used to raise "every copy failed" as the error a caller already handles
    (``ChecksumMismatchError``, ``CheckpointNotFoundError``, ...) while the
    message names every copy tried. Chain the original with ``from err``.
    """
    if isinstance(err, CorruptCheckpointError):
        return type(err)(message, checkpoint=err.checkpoint, file=err.file, fqn=err.fqn)
    if isinstance(err, (CheckpointNotFoundError, ManifestError)):
        return type(err)(message, checkpoint=err.checkpoint)
    if isinstance(err, RemoteStoreError):
        return RemoteStoreError(
            message, url=err.url, operation=err.operation, attempts=err.attempts
        )
    if isinstance(err, OSError) and type(err).__module__ == "builtins":
        return type(err)(message)  # FileNotFoundError, PermissionError, ...
    return OSError(message)
