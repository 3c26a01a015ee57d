"""MultiLevelReader: DCP's StorageReader for dcp_multilevel checkpoints.

Load path::

    all ranks     reset(checkpoint_id) -> read_metadata (manifest.json, validated)
                  -> set_up_storage_reader -> prepare_local_plan
    coordinator   prepare_global_plan (unchanged: DCP's planner reshards)
    all ranks     read_data: per file, items sorted by offset; bytes land straight
                  in the destination tensor when it is a whole, contiguous CPU
                  chunk of the stored dtype, otherwise in a scratch buffer that
                  is narrowed and copied. Every item is verified against its
                  checksum before the load counts as done (fail closed).

Non-tensor objects are checked with ``torch.load(weights_only=True)`` before
DCP's planner sees them, because ``DefaultLoadPlanner.load_bytes`` itself
unpickles with ``weights_only=False``.
"""

from __future__ import annotations

import io
import logging
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .codecs import codec_from_descriptor, decode_frames
from .errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
    RegistryError,
    TruncatedDataError,
    UnsafeObjectError,
)
from .format import MANIFEST_NAME, Hasher, ItemLocation, Manifest, decode_manifest
from .format.objects import load_object
from .format.tensor_bytes import byte_view, pieces
from .tiers import ReadHandle, TierBackend, tier_for

__all__ = ["MultiLevelReader"]

logger = logging.getLogger(__name__)


class MultiLevelReader(StorageReader):
    """Read a dcp_multilevel checkpoint from ``path``.

    Args:
        path: checkpoint location (directory path or ``file://`` URL). May be
            replaced per load by ``dcp.load(..., checkpoint_id=...)``.
        thread_count: data files read in parallel per rank.
        storage_options: options for a remote location's tier and fsspec backend.

    Loading needs no other option: the manifest says what is where.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int = 1,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError(f"thread_count must be an integer >= 1, got {thread_count!r}")
        self.thread_count = thread_count
        self.storage_options = dict(storage_options or {})
        self._decode_pool: ThreadPoolExecutor | None = None
        self._set_path(path)

    def _set_path(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.tier: TierBackend = tier_for(self.path, **self.storage_options)
        self._manifest: Manifest | None = None

    @property
    def checkpoint_id(self) -> str:
        """The location this reader loads from."""
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._set_path(checkpoint_id)
        else:
            self._manifest = None

    # Deliberately no **kwargs: DCP then does not retry with rank-local metadata
    # files, which dcp_multilevel never writes.
    def read_metadata(self) -> Metadata:
        """Read and validate the manifest; CheckpointNotFoundError if there is none."""
        try:
            raw = self.tier.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {self.tier.url}: {MANIFEST_NAME} is missing "
                "(a save that did not finish leaves none). Check the path, or load an "
                "earlier checkpoint.",
                checkpoint=self.tier.url,
            ) from None
        self._manifest = decode_manifest(raw, checkpoint=self.tier.url)
        md = self._manifest.metadata
        md.storage_meta = StorageMeta(
            checkpoint_id=self.path, save_id=self._manifest.save_id, load_id=os.urandom(8).hex()
        )
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None or metadata.storage_data is not self._manifest.locations:
            # DCP hands back what read_metadata returned; anything else was not
            # validated by us and must not steer reads.
            raise ConfigError(
                "MultiLevelReader.set_up_storage_reader got metadata that its own "
                "read_metadata() did not return; call read_metadata() first"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        manifest = self._manifest
        if manifest is None:
            raise ConfigError("MultiLevelReader.read_data called before read_metadata")
        per_file: dict[str, list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
        for req in plan.items:
            loc = manifest.locations[req.storage_index]
            per_file[loc.file].append((req, loc))
        jobs = [(f, sorted(reqs, key=lambda r: r[1].offset)) for f, reqs in per_file.items()]
        if self.thread_count == 1 or len(jobs) <= 1:
            for job in jobs:
                self._read_file(*job, planner)
        else:
            workers = min(self.thread_count, len(jobs))
            with ThreadPoolExecutor(workers, thread_name_prefix="dcp-ml-read") as pool:
                for f in [pool.submit(self._read_file, *job, planner) for job in jobs]:
                    f.result()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            tier = tier_for(checkpoint_id)
        except (ValueError, LookupError):
            return False
        return tier.exists(MANIFEST_NAME)

    # ------------------------------------------------------------------ internals

    def _read_file(
        self, file: str, reqs: list[tuple[ReadItem, ItemLocation]], planner: LoadPlanner
    ) -> None:
        assert self._manifest is not None
        expected = self._manifest.files[file]
        with ExitStack() as stack:
            try:
                handle = stack.enter_context(self.tier.open_read(file))
            except FileNotFoundError:
                fqn = reqs[0][0].storage_index.fqn
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.tier.url} is missing "
                    f"(needed for {fqn!r}); the checkpoint is damaged",
                    checkpoint=self.tier.url,
                    file=file,
                    fqn=fqn,
                ) from None
            if handle.size != expected:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.tier.url} is {handle.size} bytes, "
                    f"the manifest says {expected}; the checkpoint is damaged",
                    checkpoint=self.tier.url,
                    file=file,
                )
            for req, loc in reqs:
                if req.type == LoadItemType.BYTE_IO:
                    self._read_bytes_item(handle, file, req, loc, planner)
                else:
                    self._read_tensor_item(handle, file, req, loc, planner)

    def _fill(
        self, handle: ReadHandle, file: str, fqn: str, loc: ItemLocation, out: memoryview
    ) -> None:
        """Put the decoded bytes of ``loc`` (``loc.raw_length`` of them) into ``out``."""
        if loc.transforms:
            self._fill_coded(handle, file, fqn, loc, out)
        else:
            self._fill_raw(handle, file, fqn, loc, out)

    def _fill_raw(
        self, handle: ReadHandle, file: str, fqn: str, loc: ItemLocation, out: memoryview
    ) -> None:
        """Read ``loc`` into ``out`` piece by piece, verifying the checksum."""
        hasher = Hasher()
        pos = loc.offset
        for piece in pieces(out):
            n = handle.read_into(pos, piece)
            if n != len(piece):
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.tier.url} ended at byte {pos + n} "
                    f"inside item {fqn!r} (bytes {loc.offset}..{loc.offset + loc.length})",
                    checkpoint=self.tier.url,
                    file=file,
                    fqn=fqn,
                )
            hasher.update(piece)
            pos += n
        self._verify(hasher, file, fqn, loc)

    def _fill_coded(
        self, handle: ReadHandle, file: str, fqn: str, loc: ItemLocation, out: memoryview
    ) -> None:
        """Stream the framed item through its codec into ``out`` (bounded memory)."""
        if len(loc.transforms) != 1:
            raise ManifestError(
                f"item {fqn!r} in {file!r} of checkpoint {self.tier.url} has transforms "
                f"{list(loc.transforms)}; dcp_multilevel applies exactly one codec per item",
                checkpoint=self.tier.url,
            )
        try:
            codec = codec_from_descriptor(loc.transforms[0])
        except RegistryError as e:
            raise ManifestError(
                f"item {fqn!r} in {file!r} of checkpoint {self.tier.url} needs codec "
                f"{loc.transforms[0]!r}: {e}",
                checkpoint=self.tier.url,
            ) from None
        hasher = Hasher()
        pos, end = loc.offset, loc.offset + loc.length

        def read(n: int) -> memoryview:
            nonlocal pos
            if pos + n > end:
                raise chunk_error(-2, f"frames run past the item's {loc.length} stored bytes")
            buf = memoryview(bytearray(n))
            if handle.read_into(pos, buf) != n:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.tier.url} ended inside item {fqn!r}",
                    checkpoint=self.tier.url,
                    file=file,
                    fqn=fqn,
                )
            hasher.update(buf)
            pos += n
            return buf

        def chunk_error(index: int, why: str) -> CorruptCheckpointError:
            where = "framing" if index < 0 else f"chunk {index}"
            return CorruptCheckpointError(
                f"compressed item {fqn!r} in {file!r} of checkpoint {self.tier.url} is "
                f"corrupt: {where}: {why}. Load from another copy.",
                checkpoint=self.tier.url,
                file=file,
                fqn=fqn,
            )

        decode_frames(
            read, out, codec, pool=self._codec_pool(), window=2 * self.thread_count,
            on_chunk_error=chunk_error,
        )  # fmt: skip
        if pos != end:
            raise chunk_error(-2, f"{end - pos} stored bytes follow the last frame")
        self._verify(hasher, file, fqn, loc)

    def _codec_pool(self) -> ThreadPoolExecutor | None:
        if self.thread_count == 1:
            return None
        if self._decode_pool is None:
            self._decode_pool = ThreadPoolExecutor(
                self.thread_count, thread_name_prefix="dcp-ml-decode"
            )
        return self._decode_pool

    def _verify(self, hasher: Hasher, file: str, fqn: str, loc: ItemLocation) -> None:
        actual = hasher.hexdigest()
        if actual != loc.checksum:
            raise ChecksumMismatchError(
                f"checksum mismatch for item {fqn!r} in {file!r} of checkpoint "
                f"{self.tier.url} (bytes {loc.offset}..{loc.offset + loc.length}): "
                f"stored {loc.checksum}, read {actual}. The data is corrupt; load from "
                "another copy.",
                checkpoint=self.tier.url,
                file=file,
                fqn=fqn,
            )

    def _read_bytes_item(
        self,
        handle: ReadHandle,
        file: str,
        req: ReadItem,
        loc: ItemLocation,
        planner: LoadPlanner,
    ) -> None:
        fqn = req.storage_index.fqn
        buf = bytearray(loc.length)
        self._fill(handle, file, fqn, loc, memoryview(buf))
        planner.load_bytes(req, _vetted_bytes(bytes(buf), fqn, self.tier.url))

    def _read_tensor_item(
        self,
        handle: ReadHandle,
        file: str,
        req: ReadItem,
        loc: ItemLocation,
        planner: LoadPlanner,
    ) -> None:
        assert self._manifest is not None
        fqn = req.storage_index.fqn
        md = self._manifest.metadata.state_dict_metadata[fqn]
        assert not isinstance(md, BytesStorageMetadata)  # the manifest decoder checked
        dtype = md.properties.dtype
        chunk_sizes = _chunk_sizes(md, req.storage_index)
        target = planner.resolve_tensor(req).detach()
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == chunk_sizes
        if (
            whole
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
            and tuple(target.shape) == chunk_sizes
        ):
            # Fast path: the destination's memory is the read buffer (no copy).
            self._fill(handle, file, fqn, loc, byte_view(target))
        else:
            scratch = torch.empty(loc.raw_length, dtype=torch.uint8)
            self._fill(handle, file, fqn, loc, byte_view(scratch))
            src = scratch.view(dtype).reshape(chunk_sizes)
            for dim, (start, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                src = src.narrow(dim, start, length)
            if tuple(target.shape) != tuple(src.shape):
                raise ManifestError(
                    f"item {fqn!r}: destination has shape {tuple(target.shape)} but the "
                    f"checkpoint region has {tuple(src.shape)}",
                    checkpoint=self.tier.url,
                )
            target.copy_(src)
        planner.commit_tensor(req, target)


def _chunk_sizes(md: Any, index: MetadataIndex) -> tuple[int, ...]:
    for chunk in md.chunks:
        if chunk.offsets == index.offset:
            return tuple(chunk.sizes)
    raise KeyError(index)  # unreachable: the manifest decoder matched every item


def _vetted_bytes(raw: bytes, fqn: str, checkpoint: str) -> io.BytesIO:
    """Re-serialize a stored object after loading it with ``weights_only=True``.

    The planner then unpickles only what we produced from an allowed object,
    never the checkpoint's own bytes.
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
