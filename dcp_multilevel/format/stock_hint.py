"""The ``.metadata`` that tells stock DCP tools what they opened (``docs/interop.md``).

Stock DCP picks its reader from the path alone and unpickles
``<checkpoint>/.metadata`` (torch 2.13: ``_storage_setup`` tries
``FileSystemReader`` then ``FsspecReader``, with no registry to join;
``format_utils.dcp_to_torch_save`` builds a ``FileSystemReader`` itself). On
one of our checkpoints that file is missing, and the error says only that.
With ``MultiLevelWriter(..., stock_hint=True)`` (the default) the commit
also writes :func:`stock_hint_bytes` there: a pickle whose loading calls
:func:`refuse`, which raises
:class:`~dcp_multilevel.errors.NotStockCheckpointError` naming the reader to
pass and the ``convert`` command. Stock DCP wraps it (for example
``CheckpointException`` > ``AssertionError: metadata is None; global
metadata read failed: <our message>``).

Why ``stock_hint=False`` exists: the file is a pickle that calls a function
when loaded, the pattern pickle scanners flag; where this package is not
installed, loading it fails with ``No module named 'dcp_multilevel'``
instead. Our readers never read it (nothing of ours unpickles anything but
non-tensor values, vetted), so it costs nothing to a reader of ours. Keep
:func:`refuse` where it is: written files name it by its module path.
"""

from __future__ import annotations

import pickle
from typing import NoReturn

from ..errors import NotStockCheckpointError

__all__ = ["STOCK_METADATA_NAME", "refuse", "stock_hint_bytes"]

#: The file stock DCP's ``FileSystemReader`` reads first.
STOCK_METADATA_NAME = ".metadata"


def refuse(message: str) -> NoReturn:
    """Raise the hint (what unpickling the file calls)."""
    raise NotStockCheckpointError(message)


class _Hint:
    """Pickles as a call of :func:`refuse` with the message."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple:
        return refuse, (self.message,)


def stock_hint_bytes(location: str) -> bytes:
    """The ``.metadata`` for the checkpoint at ``location`` (pickle protocol 2)."""
    message = (
        f"{location} is a dcp_multilevel checkpoint, not a stock DCP one (its manifest is "
        "manifest.json): load it with dcp.load(state, storage_reader="
        "dcp_multilevel.MultiLevelReader(path)), or convert it for stock tools with "
        "`dcp-multilevel convert PATH OUT --to dcp` (or --to torch / safetensors)"
    )
    return pickle.dumps(_Hint(message), protocol=2)
