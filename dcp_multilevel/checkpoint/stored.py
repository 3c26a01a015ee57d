"""One checkpoint in one store: its manifest, its data files, its commit and deletion.

Every part of the package that touches a stored checkpoint goes through a
:class:`StoredCheckpoint`: the writer commits through it, the reader and the
drains read verified items through it, the manager lists and deletes through
it (``root.py``), and so can a command-line tool.

Call order for one checkpoint (``ckpt = StoredCheckpoint.at(url)``)::

    save, every rank      with ckpt.store.open_write(data_file_path(rank, n, token)) as f: ...
    save, coordinator     ckpt.commit(metadata, locations, files, ...)   # manifest last
                          ckpt.sweep(keep=files)        # only after the commit
    load / drain          ckpt.manifest()               # first, in one thread
                          with ckpt.open_data(file, fqn) as handle:    # any threads after
                              ckpt.read_item(handle, index, loc, out)  # verified
    retention             ckpt.delete()                 # manifest first

A delta checkpoint (``reference.py``) names a sibling checkpoint its delta
items are read against: :meth:`StoredCheckpoint.reference` opens it, and
:meth:`StoredCheckpoint.read_item` streams it beside each delta item.

A checkpoint exists iff its manifest does. The same checkpoint may be
stored several times (node-local disk, a bucket), each copy with its own
encoding, file layout and manifest: each copy is its own StoredCheckpoint.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from contextlib import ExitStack, closing, contextmanager
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..errors import CheckpointNotFoundError, DcpMultilevelError, TruncatedDataError
from ..format import (
    DATA_DIR,
    MANIFEST_NAME,
    TMP_MARKER,
    ItemLocation,
    Manifest,
    Reference,
    decode_manifest,
    encode_manifest,
)
from ..format.health import Health
from ..format.stock_hint import STOCK_METADATA_NAME, stock_hint_bytes
from ..stores import ReadHandle, Store, store_for
from ..stores.coalescing import CoalescingReader
from .items import ItemRef, read_item, read_stored
from .reference import ReferenceFiles, open_reference

__all__ = ["StoredCheckpoint", "decoded_manifest", "new_save_id", "sibling_location"]

logger = logging.getLogger(__name__)

#: Decoded manifests by their bytes, newest last. One load decodes the same
#: manifest for every copy it looks at (the agreement, each level of a restore,
#: the reader): with thousands of items a tenth of a second each. Bytes equal to
#: the key decode to an equal manifest, whichever copy they came from.
_DECODED: OrderedDict[bytes, Manifest] = OrderedDict()
_DECODED_MAX = 4
_DECODED_LOCK = threading.Lock()


def decoded_manifest(raw: bytes, checkpoint: str) -> Manifest:
    """``decode_manifest(raw, checkpoint=...)``, once for the same bytes (the last few
    manifests are kept; a failure is not: it raises again, naming ``checkpoint``).

    The result is shared by every caller with the same bytes: do not change it.
    """
    with _DECODED_LOCK:
        found = _DECODED.get(raw)
        if found is not None:
            _DECODED.move_to_end(raw)
            return found
    manifest = decode_manifest(raw, checkpoint=checkpoint)
    with _DECODED_LOCK:
        _DECODED[raw] = manifest
        while len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)
    return manifest


def new_save_id() -> str:
    """A fresh identity for one save (copies of it on other levels keep it)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:12]}"


def sibling_location(location: str, name: str) -> str:
    """The location of directory ``name`` beside the checkpoint at ``location`` (path or URL)."""
    return posixpath.join(posixpath.dirname(location.rstrip("/")), name)


class StoredCheckpoint:
    """The checkpoint whose files are below ``store``'s root.

    Args:
        store: the store rooted at the checkpoint's directory.
        location: how the caller named it (a path or URL; default: the store's URL).
        manifest_bytes: the checkpoint's ``manifest.json`` as another process
            read it (a node-local level whose manifest is on rank 0's node);
            validated like one read from the store, which is then not asked for it.

    Reading the manifest caches it (and a failure to read it): call
    :meth:`manifest` first, in one thread; afterwards the read methods may be
    called from several threads at once.
    """

    def __init__(
        self,
        store: Store,
        *,
        location: str | None = None,
        manifest_bytes: bytes | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.store = store
        self.location = location if location is not None else store.url
        #: What the store was built with: a sibling (the reference) is opened alike.
        self.storage_options = dict(storage_options or {})
        self._manifest_bytes = manifest_bytes
        self._manifest: Manifest | None = None
        self._error: DcpMultilevelError | OSError | None = None
        self._reference: StoredCheckpoint | None = None
        self._reference_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Writers are pickled to DCP's async-save process: no lock travels.
        state = dict(self.__dict__)
        del state["_reference_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reference_lock = threading.Lock()

    @classmethod
    def at(
        cls,
        location: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        sync: bool = True,
        manifest_bytes: bytes | None = None,
    ) -> StoredCheckpoint:
        """The checkpoint at a path or URL (its store chosen by URL scheme).

        ``sync=False`` lets the store skip fsync (scratch data only).
        """
        location = os.fspath(location)
        options = dict(storage_options or {})
        store = store_for(location, sync=sync, **options)
        return cls(store, location=location, manifest_bytes=manifest_bytes, storage_options=options)

    @property
    def url(self) -> str:
        """The checkpoint's location as a URL (how messages and metrics name it)."""
        return self.store.url

    def __repr__(self) -> str:
        return f"StoredCheckpoint({self.url!r})"

    # ------------------------------------------------------------------ manifest

    def is_committed(self) -> bool:
        """True when the manifest exists (asks the store; no cache)."""
        return self.store.exists(MANIFEST_NAME)

    def held_save_id(self) -> str | None:
        """The ``save_id`` of the checkpoint committed here now, or None when none is
        (asks the store; no cache): what a copy onto this place would replace.

        Raises:
            ManifestError: a manifest is there but cannot be read as one (a
                damaged checkpoint is still one: nothing may replace it unasked).
            OSError: the store could not be read.
        """
        try:
            raw = self.store.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            return None
        return decoded_manifest(raw, self.url).save_id

    def manifest_bytes(self) -> bytes:
        """The manifest as stored (not validated).

        Raises:
            CheckpointNotFoundError: there is none (the checkpoint is not committed).
            OSError: the store could not be read.
        """
        if self._manifest_bytes is not None:
            return self._manifest_bytes
        try:
            return self.store.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {self.url}: {MANIFEST_NAME} is missing "
                "(a save that did not finish leaves none). Check the path, or load an "
                "earlier checkpoint.",
                checkpoint=self.url,
            ) from None

    def manifest(self) -> Manifest:
        """The validated manifest, read on first use.

        A failure is remembered too: asking again raises the same error without
        touching the store, until :meth:`forget`.

        Raises:
            CheckpointNotFoundError: there is no manifest (not committed).
            ManifestError: the manifest is invalid.
            OSError: the store could not be read (e.g. ``RemoteStoreError``).
        """
        if self._manifest is None:
            if self._error is not None:
                raise self._error
            try:
                self._manifest = decoded_manifest(self.manifest_bytes(), self.url)
            except (DcpMultilevelError, OSError) as e:
                self._error = e
                raise
        return self._manifest

    def forget(self) -> None:
        """Drop the cached manifest (or error), and the reference: the next use reads again."""
        self._manifest = None
        self._error = None
        self._reference = None

    def reference(self) -> StoredCheckpoint | None:
        """The checkpoint this one's delta items are coded against (None: it has none).

        A sibling of this checkpoint (``manifest().reference.checkpoint``),
        opened with the same storage options, once; thread-safe. Whether it
        is the right save is checked where its items are read
        (``reference.py``).
        """
        link = self.manifest().reference
        if link is None:
            return None
        with self._reference_lock:
            if self._reference is None:
                self._reference = StoredCheckpoint.at(
                    sibling_location(self.location, link.checkpoint), self.storage_options
                )
            return self._reference

    def commit(
        self,
        metadata: Metadata,
        locations: Mapping[MetadataIndex, ItemLocation],
        files: Mapping[str, int],
        *,
        save_id: str,
        world_size: int,
        reference: Reference | None = None,
        extra: Mapping[str, Any] | None = None,
        stock_hint: bool = True,
        health: Health | None = None,
    ) -> None:
        """Write the manifest, atomically and last: from now on the checkpoint exists.

        Every file ``files`` names must be durable in the store already.
        ``reference``: the sibling checkpoint the delta items are coded against.
        ``extra``: kept with the checkpoint (``Manifest.extra``), plain JSON.
        ``stock_hint``: see :meth:`commit_manifest`. ``health``: what the save's
        checks found (``format/health.py``).

        Raises:
            UnsupportedStateError: the metadata cannot be stored (see ``encode_manifest``).
            OSError: the store could not be written (nothing is committed).
        """
        doc = encode_manifest(
            metadata,
            locations,
            files,
            save_id=save_id,
            world_size=world_size,
            created_unix=time.time(),
            reference=reference,
            extra=extra,
            health=health,
        )
        self.commit_manifest(doc, stock_hint=stock_hint)
        logger.info(
            "committed checkpoint %s: %d items, %d bytes in %d files",
            self.url,
            len(locations),
            sum(files.values()),
            len(files),
        )

    def commit_manifest(self, manifest: bytes, *, stock_hint: bool = True) -> None:
        """Write an encoded manifest (a copy's, or :meth:`commit`'s), last.

        ``stock_hint``: then write the ``.metadata`` that stock DCP tools probe
        for (``format/stock_hint.py``): they see a checkpoint, and loading it with
        stock's reader fails naming ours. Never read by us.
        """
        self.store.write_atomic(MANIFEST_NAME, manifest)
        self.forget()
        if stock_hint:
            # After the manifest: a tool that probes for .metadata (torchtitan's step
            # discovery) must never take a save that did not commit for a checkpoint.
            # A crash between the two leaves a committed checkpoint without it.
            self.store.write_atomic(STOCK_METADATA_NAME, stock_hint_bytes(self.url))

    def delete(self) -> None:
        """Remove the checkpoint: the manifest first, so a half-deleted one does not exist."""
        self.store.remove_tree(MANIFEST_NAME)
        self.store.remove_tree("")
        self.forget()

    # ------------------------------------------------------------------ data files

    def data_files(self) -> set[str]:
        """The data files present in this process's view of the store (``data/...``)."""
        return {f"{DATA_DIR}/{name}" for name in self.store.listdir(DATA_DIR)}

    def sweep(self, keep: Iterable[str]) -> None:
        """Delete every data file not in ``keep`` and temporary leftovers; never raises.

        Called by the committer right after :meth:`commit`, with the files the
        new manifest names: what an overwritten save or a crashed writer left.
        """
        keep = set(keep)
        stale = sorted(self.data_files() - keep)
        stale += [name for name in self.store.listdir("") if TMP_MARKER in name]
        for path in stale:
            try:
                self.store.remove_tree(path)
            except OSError as e:
                # The checkpoint is committed; leftover bytes only cost space.
                logger.warning("could not delete stale %s in %s: %s", path, self.url, e)

    @contextmanager
    def open_data(self, file: str, fqn: str, limit: int | None = None) -> Iterator[ReadHandle]:
        """Open data file ``file`` after checking it has the size the manifest records.

        ``fqn`` (an item that needs the file) only names it in the error. On a
        store where every request is a round trip (``prefers_large_reads``),
        reads are served from larger blocks fetched in one request each
        (:class:`~dcp_multilevel.stores.coalescing.CoalescingReader`), never
        past byte ``limit`` (the end of the last item the caller needs; None:
        the whole file).

        Raises:
            TruncatedDataError: the file is missing or has the wrong size.
        """
        expected = self.manifest().files[file]
        with ExitStack() as stack:
            try:
                handle = stack.enter_context(self.store.open_read(file))
            except FileNotFoundError:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.url} is missing "
                    f"(needed for {fqn!r}); the checkpoint is damaged",
                    checkpoint=self.url,
                    file=file,
                    fqn=fqn,
                ) from None
            if self.store.prefers_large_reads:
                handle = CoalescingReader(handle, limit)
                stack.callback(handle.close)  # before the wrapped handle closes
            if handle.size != expected:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.url} is {handle.size} bytes, "
                    f"the manifest says {expected}; the checkpoint is damaged",
                    checkpoint=self.url,
                    file=file,
                )
            yield handle

    def read_item(
        self,
        handle: ReadHandle,
        index: MetadataIndex,
        loc: ItemLocation,
        out: memoryview,
        *,
        pool: Executor | None = None,
        window: int = 1,
        references: ReferenceFiles | None = None,
    ) -> None:
        """Decoded, verified bytes of item ``index`` (stored at ``loc``) into ``out``
        (see :func:`.items.read_item`).

        A delta item (``loc.reference``) is read against the same item of
        :meth:`reference`; ``references`` holds the reference's data files
        open across the items a thread reads (else each item opens its own).

        Raises:
            BrokenChainError: the item is a delta and its reference cannot serve it.
            (and what :func:`.items.read_item` raises)
        """
        ref = ItemRef(self.url, index.fqn, loc)
        if loc.reference is None:
            read_item(handle, ref, out, pool=pool, window=window)
            return
        with closing(open_reference(self, index, loc, files=references)) as reference:
            read_item(handle, ref, out, pool=pool, window=window, reference=reference)

    def read_stored(
        self,
        handle: ReadHandle,
        fqn: str,
        loc: ItemLocation,
        blocks: Iterable[memoryview],
        on_block: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Stored bytes of one item into ``blocks``, verified (see :func:`.items.read_stored`)."""
        read_stored(handle, ItemRef(self.url, fqn, loc), blocks, on_block)
