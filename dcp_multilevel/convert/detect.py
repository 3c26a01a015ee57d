"""What a conversion source is: our checkpoint, a stock DCP directory or a torch.save file."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import Any

from ..checkpoint import StoredCheckpoint
from ..errors import CheckpointNotFoundError, ConvertError
from ..stores import parse_location

__all__ = ["OURS", "SOURCE_KINDS", "STOCK_DCP", "TORCH_SAVE", "detect_source"]

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
