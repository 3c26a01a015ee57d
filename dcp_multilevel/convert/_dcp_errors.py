"""Our errors out of DCP's wrapper, so ``convert`` raises what its docstring says."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import DcpMultilevelError

__all__ = ["unwrapped"]


@contextmanager
def unwrapped() -> Iterator[None]:
    """Re-raise the first of our errors a ``dcp.save``/``dcp.load`` wrapped.

    DCP wraps every failure of a planner, reader or writer in a
    ``CheckpointException`` (rank -> (error, traceback)); in the single process
    of a conversion the error inside is the one to show (a checksum mismatch, a
    value refused by ``weights_only``). Anything else stays wrapped.
    """
    try:
        yield
    except CheckpointException as e:
        for failure in e.failures.values():
            err = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(err, DcpMultilevelError):
                raise err from e
        raise
