"""Real manifests of tiny checkpoints, written without saving one (roots of many steps
in tests and benchmarks: ``tests/unit/test_many_files.py``, ``bench_many_files.py``)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format import ItemLocation, encode_manifest

__all__ = ["tiny_manifest"]


def tiny_manifest(files: list[str], *, save_id: str, world_size: int, created_unix: float) -> bytes:
    """A manifest naming ``files``, one 16-byte fp32 tensor (``layer<i>.weight``) in each."""
    state, locations = {}, {}
    for i, name in enumerate(files):
        fqn = f"layer{i}.weight"
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([4]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
        )
        locations[MetadataIndex(fqn, [0])] = ItemLocation(name, 0, 16, 16, f"xxh3_64:{i:016x}")
    return encode_manifest(
        Metadata(state),
        locations,
        dict.fromkeys(files, 16),
        save_id=save_id,
        world_size=world_size,
        created_unix=created_unix,
    )
