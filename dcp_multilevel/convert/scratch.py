"""File-backed tensors: where a conversion puts decoded tensors so memory stays small.

A conversion decodes a checkpoint one item at a time into tensors whose
storage is a shared mapping of a regular file (``torch.from_file(...,
shared=True)``). Their pages are file-backed: the kernel writes them back and
drops them under memory pressure, so the process's *anonymous* memory grows
by at most what one item's decoding needs, whatever the checkpoint's size.

Each tensor has its own file (its own storage), so ``torch.save`` and DCP's
writers store exactly its bytes (a view into a larger storage would make
``torch.save`` write the whole storage and DCP's ``FileSystemWriter`` clone it).
The file is unlinked right after it is mapped: the mapping keeps the data
alive, and nothing is left behind if the process dies.

The scratch directory must be on a disk, not on tmpfs (``/dev/shm``, often
``/tmp`` in containers): tmpfs pages are memory that cannot be dropped.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from types import TracebackType

import torch

__all__ = ["Scratch"]


class Scratch:
    """A private temporary directory for file-backed tensors (a context manager).

    Args:
        parent: the directory to create it in (default: the system's temporary
            directory). Needs free space for every tensor created.
    """

    def __init__(self, parent: str | os.PathLike[str] | None = None) -> None:
        if parent is not None:  # beside a destination that may not exist yet
            os.makedirs(parent, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix=".dcp-ml-convert-", dir=parent)
        self._count = 0

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of ``shape`` and ``dtype`` backed by its own (unlinked) file.

        Its content is zeros until written. Empty tensors need no file.
        """
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        nbytes = numel * dtype.itemsize
        path = os.path.join(self.path, f"{self._count}.bin")
        self._count += 1
        with open(path, "wb") as f:
            f.truncate(nbytes)  # sparse: disk blocks are allocated as pages are written
        try:
            # Mapped as bytes and reinterpreted: from_file's own dtype argument
            # does not cover every dtype a checkpoint may hold (fp8, complex32).
            raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            os.unlink(path)  # the mapping keeps the pages; no file outlives the process
        return raw.view(dtype).view(tuple(shape))

    def close(self) -> None:
        """Remove the (empty) directory; the tensors stay usable until they are freed."""
        os.rmdir(self.path)

    def __enter__(self) -> Scratch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
