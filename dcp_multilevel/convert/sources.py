"""Conversion sources: what a source is, and reading one into file-backed tensors.

A source is our checkpoint, a stock DCP directory or a ``torch.save`` file
(:func:`detect_source`). It is read into a state dict of file-backed tensors:

- our checkpoint or a stock DCP directory: DCP's own load (``_load_state_dict``,
  as ``format_utils.dcp_to_torch_save`` uses it) with a planner that rebuilds
  the nested state from the checkpoint's metadata, as DCP's
  ``_EmptyStateDictLoadPlanner`` does, but into tensors of a :class:`.Scratch`
  instead of ``torch.empty`` ones. DCP's planner assembles every chunk (other
  ranks' shards, split pieces) into the whole tensor; the readers read one
  item at a time, so anonymous memory stays within about one item.
- a ``torch.save`` file: ``torch.load(mmap=True, weights_only=True)``; its
  tensors are views of the file itself, nothing is decoded up front.

Non-tensor values are unpickled with ``weights_only=True`` in every case:
DCP's ``DefaultLoadPlanner.load_bytes`` would use ``weights_only=False``.
A stock DCP directory's ``.metadata`` is still unpickled by
``FileSystemReader.read_metadata`` (plain ``pickle.load``): converting from
stock DCP trusts that file exactly as ``dcp.load`` does.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader

from ..checkpoint import StoredCheckpoint
from ..errors import CheckpointNotFoundError, ConvertError, UnsafeObjectError
from ..plugin import MultiLevelReader
from ..stores import parse_location
from ._dcp_errors import unwrapped
from .progress import Progress
from .scratch import Scratch

__all__ = [
    "OURS",
    "SOURCE_KINDS",
    "STOCK_DCP",
    "TORCH_SAVE",
    "Source",
    "detect_source",
    "open_source",
]


OURS = "ours"
STOCK_DCP = "dcp"
TORCH_SAVE = "torch"
SOURCE_KINDS = (OURS, STOCK_DCP, TORCH_SAVE)

#: The file stock DCP's FileSystemWriter commits last (torch ``filesystem.py``).
DCP_METADATA = ".metadata"


def is_url(where: str) -> bool:
    """True for a remote URL (``s3://...``), False for a path or ``file://`` URL."""
    return parse_location(where).scheme != "file"


def local_path(where: str) -> str:
    """The path of a local location (a path, or a ``file://`` URL)."""
    return parse_location(where).path


def detect_source(src: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The kind of checkpoint at ``src``: ``"ours"``, ``"dcp"`` or ``"torch"``.

    A URL (``s3://...``) can only be one of ours. Our manifest wins over a
    ``.metadata`` in the same directory.

    Raises:
        CheckpointNotFoundError: nothing is at ``src``.
        ConvertError: something is there, but it is none of the three.
    """
    if is_url(src):
        if StoredCheckpoint.at(src, storage_options).is_committed():
            return OURS
        raise CheckpointNotFoundError(
            f"no dcp_multilevel checkpoint at {src}: its manifest.json is missing (a "
            "remote source must be a dcp_multilevel checkpoint; copy a stock DCP "
            "directory or torch.save file to local disk to convert it)",
            checkpoint=src,
        )
    path = local_path(src)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            f"cannot convert {src}: no such file or directory", checkpoint=src
        )
    if os.path.isdir(path):
        if StoredCheckpoint.at(path, storage_options).is_committed():
            return OURS
        if os.path.isfile(os.path.join(path, DCP_METADATA)):
            return STOCK_DCP
        raise ConvertError(
            f"cannot convert {src}: the directory is not a checkpoint (no manifest.json "
            f"of a dcp_multilevel checkpoint, no {DCP_METADATA} of a stock DCP one; an "
            "unfinished save leaves neither)",
            path=src,
        )
    # torch.save has written zip archives since torch 1.6; only those can be
    # memory-mapped (torch.load(mmap=True)), which a bounded-memory conversion needs.
    if zipfile.is_zipfile(path):
        return TORCH_SAVE
    raise ConvertError(
        f"cannot convert {src}: the file is not a torch.save file (not a zip archive; "
        "files in torch's legacy pre-1.6 format are not supported: load and re-save "
        "them with torch.save first)",
        path=src,
    )


@dataclass
class Source:
    """An opened source: its kind and size, known before anything is decoded.

    Attributes:
        kind: ``"ours"``, ``"dcp"`` or ``"torch"``.
        location: as the caller named it.
        tensor_bytes: bytes of all its tensors (whole tensors).
        decode_pass: whether :meth:`load` reads every tensor byte (a pass
            progress counts) or only maps the source (torch.save files).
        entries: every value by flattened key: its dtype, None for a non-tensor.
    """

    kind: str
    location: str
    tensor_bytes: int
    decode_pass: bool
    entries: dict[str, torch.dtype | None]
    _reader: StorageReader | None = None
    _mapped: dict[str, Any] | None = None

    def load(self, scratch: Scratch | None, progress: Progress) -> dict[str, Any]:
        """The nested state dict; tensors are file-backed (scratch or the source file)."""
        if self._mapped is not None:
            return self._mapped
        assert self._reader is not None and scratch is not None
        state: dict[str, Any] = {}
        with unwrapped():
            _load_state_dict(
                state,
                storage_reader=self._reader,
                planner=_ScratchLoadPlanner(scratch, progress, self.location),
                no_dist=True,
            )
        return state


def open_source(kind: str, src: str, storage_options: Mapping[str, Any] | None) -> Source:
    """Open ``src`` (of ``kind``, see :func:`detect_source`) and measure it."""
    if kind == TORCH_SAVE:
        state = _map_torch_save(src)
        flat, _ = flatten_state_dict(state)
        nbytes = sum(v.nbytes for v in flat.values() if isinstance(v, torch.Tensor))
        entries = {k: v.dtype if isinstance(v, torch.Tensor) else None for k, v in flat.items()}
        return Source(kind, src, nbytes, False, entries, _mapped=state)
    if kind == OURS:
        reader: StorageReader = MultiLevelReader(src, storage_options=dict(storage_options or {}))
    elif kind == STOCK_DCP:
        reader = FileSystemReader(local_path(src))
    else:  # unreachable: kinds come from detect_source
        raise ValueError(f"unknown source kind {kind!r}")
    reader.reset(None)
    metadata = reader.read_metadata()
    # DCP's metadata keys are the flattened keys (planner_data maps them back).
    entries = {
        k: md.properties.dtype if isinstance(md, TensorStorageMetadata) else None
        for k, md in metadata.state_dict_metadata.items()
    }
    return Source(kind, src, _tensor_bytes(metadata), True, entries, _reader=reader)


def _tensor_bytes(metadata: Metadata) -> int:
    return sum(
        math.prod(md.size) * md.properties.dtype.itemsize
        for md in metadata.state_dict_metadata.values()
        if isinstance(md, TensorStorageMetadata)
    )


def _map_torch_save(src: str) -> dict[str, Any]:
    """The state in a torch.save file, its tensors mapped from the file, not read."""
    path = local_path(src)
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        # weights_only refused an object (its message names the type and how to allow it).
        raise UnsafeObjectError(
            f"cannot convert {src}: torch.load(weights_only=True) refused it: {e}"
        ) from None
    except RuntimeError as e:
        raise ConvertError(
            f"cannot convert {src}: torch.load could not read it as a torch.save file: {e}",
            path=src,
        ) from None
    if not isinstance(state, dict):
        raise ConvertError(
            f"cannot convert {src}: it holds a {type(state).__name__}, not a state dict "
            "(a dict of tensors and values); save a dict, e.g. torch.save({'model': x}, path)",
            path=src,
        )
    return state


class _ScratchLoadPlanner(DefaultLoadPlanner):
    """Rebuilds the state from the metadata into scratch tensors; reports progress.

    Mirrors torch's ``_EmptyStateDictLoadPlanner.set_up_planner`` (so the nested
    structure is exactly what ``dcp_to_torch_save`` produces), with file-backed
    tensors and ``weights_only`` loading of non-tensor values.
    """

    def __init__(self, scratch: Scratch, progress: Progress, location: str) -> None:
        super().__init__()
        self._scratch = scratch
        self._progress = progress
        self._location = location

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        assert not state_dict and metadata is not None
        for key, md in metadata.state_dict_metadata.items():
            value: Any = md
            if isinstance(md, TensorStorageMetadata):
                value = self._scratch.tensor(tuple(md.size), md.properties.dtype)
            if metadata.planner_data is not None and key in metadata.planner_data:
                set_element(state_dict, metadata.planner_data[key], value)
            else:
                state_dict[key] = value
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            # io.BytesIO: plain bytes (our reader's record of one, or stock's torch.save).
            with torch.serialization.safe_globals([io.BytesIO]):
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeObjectError(
                f"value {fqn!r} of {self._location} is refused by torch.load(weights_only="
                f"True): {e}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self._progress.add(tensor.numel() * tensor.element_size())
