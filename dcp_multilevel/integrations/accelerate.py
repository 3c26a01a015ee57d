"""Hugging Face Accelerate's FSDP checkpoints through dcp_multilevel.

With FSDP and ``SHARDED_STATE_DICT`` (FSDP2 and FSDP1), ``Accelerator.save_state``
and ``load_state`` call ``accelerate.utils.fsdp_utils.save_fsdp_model`` /
``save_fsdp_optimizer`` / ``load_fsdp_model`` / ``load_fsdp_optimizer``, which
build ``torch.distributed.checkpoint.FileSystemWriter(ckpt_dir)`` and
``FileSystemReader(ckpt_dir)`` themselves: Accelerate has no option for
another storage. The one change in a user's code::

    from dcp_multilevel.integrations.accelerate import MultiLevelAccelerator

    accelerator = MultiLevelAccelerator(fsdp_plugin=..., writer_options={"codec": "bytegroup"})
    accelerator.save_state("ckpt/step-100")  # model and optimizer: our writer
    accelerator.load_state("ckpt/step-100")  # our reader

or, keeping the ``Accelerator`` as it is, around each call::

    with multilevel_fsdp_checkpoints(writer_options={"codec": "bytegroup"}):
        accelerator.save_state("ckpt/step-100")

How: for the duration of the call, and for the calling thread only, the names
``FileSystemWriter`` and ``FileSystemReader`` of the
``torch.distributed.checkpoint`` package (what Accelerate looks up at each
save and load) build a :class:`~dcp_multilevel.MultiLevelWriter` /
:class:`~dcp_multilevel.MultiLevelReader` of the same folder. Accelerate's own
code runs unchanged otherwise: which state dicts it takes, the folder names
(``pytorch_model_fsdp_0``, ``optimizer_0``), its planners and barriers. Its other
files (RNG states, schedulers, samplers, scaler, custom objects) stay its own
``torch.save`` / safetensors files beside ours. A folder that holds a stock
DCP checkpoint and not ours (saved by stock Accelerate before the switch) is
read by stock DCP's reader, so existing checkpoints keep loading.

Tested with ``accelerate==1.15.0`` (``tests/test_integration_accelerate.py``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from accelerate import Accelerator

from ..format.stock_hint import STOCK_METADATA_NAME
from ..plugin import MultiLevelReader, MultiLevelWriter

__all__ = ["MultiLevelAccelerator", "multilevel_fsdp_checkpoints"]

# One routing window at a time per process: two threads swapping the same two
# module attributes could each restore the other's replacement on exit. Reentrant:
# a window inside a window (the Accelerator subclass inside the context manager)
# nests, the inner one restoring the outer's routing.
_SWAP_LOCK = threading.RLock()


class _ThreadRouted:
    """Stands in for ``FileSystemWriter`` or ``FileSystemReader`` during a window.

    Called from the thread that opened the window, it builds ours; from any
    other thread it builds the stock class, so a concurrent stock save elsewhere
    in the process is not redirected; and for a folder ``stock_when`` names
    (a stock checkpoint, for the reader). Accelerate passes only the folder.
    """

    def __init__(
        self,
        stock: Any,
        ours: Any,
        options: Mapping[str, Any],
        owner: int,
        stock_when: Callable[[str | os.PathLike[str]], bool] | None = None,
    ) -> None:
        self.stock = stock
        self.ours = ours
        self.options = dict(options)
        self.owner = owner
        self.stock_when = stock_when

    def __call__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self.owner:
            return self.stock(path, *args, **kwargs)
        if self.stock_when is not None and self.stock_when(path):
            return self.stock(path, *args, **kwargs)
        if args or kwargs:
            # Not Accelerate 1.15's call: its options mean nothing to our classes.
            raise TypeError(
                f"{self.stock.__name__}({os.fspath(path)!r}, ...) was called with options "
                f"{args!r} {kwargs!r} inside multilevel_fsdp_checkpoints(), which builds a "
                f"{self.ours.__name__} instead; pass that one's options as "
                "writer_options / reader_options"
            )
        return self.ours(path, **self.options)


@contextmanager
def multilevel_fsdp_checkpoints(
    writer_options: Mapping[str, Any] | None = None,
    reader_options: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Route Accelerate's FSDP checkpoint saves and loads in this block through us.

    Covers everything that builds DCP's ``FileSystemWriter`` / ``FileSystemReader``
    by name on this thread inside the block: ``Accelerator.save_state`` /
    ``load_state`` with FSDP and ``SHARDED_STATE_DICT``, and the four
    ``accelerate.utils`` functions ``save_fsdp_model``, ``load_fsdp_model``,
    ``save_fsdp_optimizer``, ``load_fsdp_optimizer`` called directly. A folder
    holding a stock DCP checkpoint and not ours (saved by stock Accelerate)
    is loaded by stock DCP's reader.

    Args:
        writer_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelWriter`
            (``codec``, ``thread_count``...). ``overwrite`` defaults to True,
            as ``save_state`` into a folder saved before replaces it with stock
            DCP too (ours keeps the old checkpoint loadable until the new commit).
        reader_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelReader`.

    Every rank must enter the block: a save or load is collective.
    """
    writer_options = {"overwrite": True, **(writer_options or {})}
    owner = threading.get_ident()
    with _SWAP_LOCK:
        stock_writer, stock_reader = dcp.FileSystemWriter, dcp.FileSystemReader
        dcp.FileSystemWriter = _ThreadRouted(stock_writer, MultiLevelWriter, writer_options, owner)
        dcp.FileSystemReader = _ThreadRouted(
            stock_reader, MultiLevelReader, reader_options or {}, owner, _stock_checkpoint
        )
        try:
            yield
        finally:
            dcp.FileSystemWriter, dcp.FileSystemReader = stock_writer, stock_reader


def _stock_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a stock DCP checkpoint and not ours: stock's reader loads it.

    A run that switches to this module resumes from the checkpoints stock
    Accelerate saved before. Each rank decides from the folder alone (no
    collective: Accelerate also builds readers on one process, to merge
    weights). A folder with neither manifest goes to ours, whose error says
    what a save that did not finish leaves.
    """
    if MultiLevelReader.validate_checkpoint_id(path):
        return False
    return os.path.isfile(os.path.join(os.fspath(path), STOCK_METADATA_NAME))


class MultiLevelAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state`` / ``load_state`` write and read our format.

    Takes every argument of ``Accelerator`` plus ``writer_options`` and
    ``reader_options`` (see :func:`multilevel_fsdp_checkpoints`). Only the FSDP
    model and optimizer states with ``SHARDED_STATE_DICT`` change format; the
    other ``state_dict_type`` values and non-FSDP runs save as Accelerate does.
    """

    def __init__(
        self,
        *args: Any,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """``Accelerator.save_state`` with FSDP states saved by our writer."""
        with multilevel_fsdp_checkpoints(self.writer_options, self.reader_options):
            return super().save_state(output_dir, safe_serialization, **kwargs)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """``Accelerator.load_state`` with FSDP states loaded by our reader."""
        with multilevel_fsdp_checkpoints(self.writer_options, self.reader_options):
            return super().load_state(input_dir, load_kwargs, **kwargs)
