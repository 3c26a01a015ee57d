"""Writing a converted state as a DCP checkpoint: stock ``FileSystemWriter`` or ours.

One ``dcp.save`` in this process (``no_dist=True``), so the target holds
whole tensors saved by one rank; any world size can load it (DCP reshards).
Both writers write one item at a time from the tensor's memory (file-backed
here), so anonymous memory stays within about one item (our writer: its
codec window).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..codecs.options import Compression
from ..plugin import MultiLevelWriter
from ._dcp_errors import unwrapped
from .progress import Progress

__all__ = ["write_ours", "write_stock_dcp"]


def write_stock_dcp(state: dict[str, Any], dst: str, progress: Progress) -> None:
    """Save ``state`` with stock DCP's ``FileSystemWriter`` to directory ``dst``."""
    with unwrapped():
        dcp.save(
            state, storage_writer=FileSystemWriter(dst), planner=_Planner(progress), no_dist=True
        )


def write_ours(
    state: dict[str, Any],
    dst: str,
    progress: Progress,
    *,
    codec: Compression | str | None,
    overwrite: bool,
    storage_options: Mapping[str, Any] | None,
) -> None:
    """Save ``state`` as a dcp_multilevel checkpoint at ``dst`` (a path or URL)."""
    writer = MultiLevelWriter(
        dst, codec=codec, overwrite=overwrite, storage_options=dict(storage_options or {})
    )
    with unwrapped():
        dcp.save(state, storage_writer=writer, planner=_Planner(progress), no_dist=True)


class _Planner(DefaultSavePlanner):
    """DCP's default planner, counting each tensor item as the writer takes it."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self._progress = progress

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if write_item.type != WriteItemType.BYTE_IO:
            self._progress.add(data.numel() * data.element_size())
        return data
