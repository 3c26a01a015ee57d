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

With ``MultiLevelAccelerator(levels=[...])`` the model and optimizer states go
to the levels instead (``_accelerate_levels.py``): each part is step N of a
level list of its own (each level's URL with the part's folder name appended),
N being ``save_iteration``, and ``output_dir`` keeps Accelerate's own files and a
marker naming N. Choices, and why:

- ``output_dir`` must be a folder every rank reads (shared storage), as stock
  Accelerate already needs: only the main process writes the scheduler,
  sampler and scaler files that every rank loads. The levels carry only
  what DCP saves (almost all the bytes); a node that lost its disk gets its
  model and optimizer shards back from the levels, its RNG states from the
  shared folder. Carrying Accelerate's files too would make the levels hold
  pickles Accelerate alone can read, for a case (no shared folder) that
  stock Accelerate does not support either.
- ``save_state`` returns once every part committed on the first level; the
  other levels receive it in the background. :meth:`MultiLevelAccelerator.wait_for_checkpoints`
  waits for them (``dcp_multilevel.wait()``), and ``end_training`` does before it
  ends the process group the drains need.
- ``load_state`` loads the step the folder's marker names or, where a part of
  it is quarantined (``docs/health.md``), the newest older step no part of
  which is (every part from the same step; ``allow_quarantined=True``: the
  marker's); where not every rank can restore a part of it (lost with a node),
  the newest older step every rank can restore in every part. It sets
  ``save_iteration`` to the marker's step + 1, so that the next ``save_state``
  goes on numbering steps (a step already on the levels would be refused, and
  retention follows step order).
- A folder without the marker (a single-level checkpoint of ours, a stock
  one) loads as without levels.

Tested with ``accelerate==1.15.0`` (``tests/stacks/test_integration_accelerate.py``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.fsdp import StateDictType

from ..errors import ConfigError
from ..format.stock_hint import STOCK_METADATA_NAME
from ..levels import DrainResult, Topology
from ..levels.config import Level
from ..levels.runtime import wait
from ..plugin import MultiLevelReader, MultiLevelWriter
from ._accelerate_levels import MARKER_NAME, LevelRoutes, PartLevels, Routes, StepMarker

__all__ = ["MultiLevelAccelerator", "multilevel_fsdp_checkpoints"]

#: What builds ours (None: the stock class), given the folder Accelerate passes.
_Choice = Callable[[str | os.PathLike[str]], Callable[[], Any] | None]

#: Writer options a level list sets itself (on its first level).
_LEVELS_OWN = ("codec", "storage_options", "reference")

# One routing window at a time per process: two threads swapping the same two
# module attributes could each restore the other's replacement on exit. Reentrant:
# a window inside a window (the Accelerator subclass inside the context manager)
# nests, the inner one restoring the outer's routing.
_SWAP_LOCK = threading.RLock()


class _ThreadRouted:
    """Stands in for ``FileSystemWriter`` or ``FileSystemReader`` during a window.

    Called from the thread that opened the window, it builds what ``choose``
    returns for the folder (ours), or the stock class where that is None (a
    stock checkpoint, for the reader); from any other thread it builds the
    stock class, so a concurrent stock save elsewhere in the process is not
    redirected. Accelerate passes only the folder.
    """

    def __init__(self, stock: Any, ours: str, choose: _Choice, owner: int) -> None:
        self.stock = stock
        self.ours = ours
        self.choose = choose
        self.owner = owner

    def __call__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self.owner:
            return self.stock(path, *args, **kwargs)
        build = self.choose(path)
        if build is None:
            return self.stock(path, *args, **kwargs)
        if args or kwargs:
            # Not Accelerate 1.15's call: its options mean nothing to our classes.
            raise TypeError(
                f"{self.stock.__name__}({os.fspath(path)!r}, ...) was called with options "
                f"{args!r} {kwargs!r} inside multilevel_fsdp_checkpoints(), which builds a "
                f"{self.ours} instead; pass that one's options as "
                "writer_options / reader_options"
            )
        return build()


class _FolderRoutes:
    """Without levels: our writer and reader of the folder Accelerate names; stock DCP's
    reader for a stock checkpoint."""

    def __init__(
        self, writer_options: Mapping[str, Any], reader_options: Mapping[str, Any]
    ) -> None:
        self.writer_options = {"overwrite": True, **writer_options}
        self.reader_options = dict(reader_options)

    def writer(self, path: str | os.PathLike[str]) -> Callable[[], Any]:
        """What builds our writer of ``path``."""
        return functools.partial(MultiLevelWriter, path, **self.writer_options)

    def reader(self, path: str | os.PathLike[str]) -> Callable[[], Any] | None:
        """What builds our reader of ``path``; None where stock's reads it."""
        if _stock_checkpoint(path):
            return None
        _refuse_levels_folder(path)
        return functools.partial(MultiLevelReader, path, **self.reader_options)


@contextmanager
def _routed(routes: Routes) -> Iterator[None]:
    """Swap DCP's two names for ``routes``' choices on this thread, for the block."""
    owner = threading.get_ident()
    with _SWAP_LOCK:
        stock_writer, stock_reader = dcp.FileSystemWriter, dcp.FileSystemReader
        dcp.FileSystemWriter = _ThreadRouted(stock_writer, "MultiLevelWriter", routes.writer, owner)
        dcp.FileSystemReader = _ThreadRouted(stock_reader, "MultiLevelReader", routes.reader, owner)
        try:
            yield
        finally:
            dcp.FileSystemWriter, dcp.FileSystemReader = stock_writer, stock_reader


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
    is loaded by stock DCP's reader. One checkpoint per folder, no levels:
    those take :class:`MultiLevelAccelerator` (it numbers the steps).

    Args:
        writer_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelWriter`
            (``codec``, ``thread_count``...). ``overwrite`` defaults to True,
            as ``save_state`` into a folder saved before replaces it with stock
            DCP too (ours keeps the old checkpoint loadable until the new commit).
        reader_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelReader`.

    Every rank must enter the block: a save or load is collective.
    """
    with _routed(_FolderRoutes(writer_options or {}, reader_options or {})):
        yield


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


def _refuse_levels_folder(path: str | os.PathLike[str]) -> None:
    """A part saved on levels, asked for without them: say so, rather than our reader's
    error about a folder without a manifest (Accelerate leaves the part's folder empty)."""
    folder = os.path.dirname(os.fspath(path).rstrip("/"))
    if not os.path.isfile(os.path.join(folder, MARKER_NAME)):
        return
    marker = StepMarker.read(folder)
    assert marker is not None  # the file is there: read() raised or returned it
    raise ConfigError(
        f"{os.fspath(path)!r} was saved on levels (step {marker.step} of {marker.levels}, "
        f"named by {os.path.join(folder, MARKER_NAME)}): load it with "
        "MultiLevelAccelerator(levels=...) and the same levels"
    )


class MultiLevelAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state`` / ``load_state`` write and read our format.

    Takes every argument of ``Accelerator`` plus:

    Args:
        writer_options: keyword arguments of every :class:`~dcp_multilevel.MultiLevelWriter`
            (see :func:`multilevel_fsdp_checkpoints`; with ``levels``, the codec
            and storage options are the levels' own, and ``overwrite`` their
            first one's).
        reader_options: keyword arguments of every :class:`~dcp_multilevel.MultiLevelReader`.
        levels: save the model and optimizer states on these levels
            (:class:`~dcp_multilevel.Level`, fastest first: partner copies,
            parity, remote stores; ``docs/levels.md``), each part on the levels'
            URLs with its folder name appended, at step ``save_iteration``
            (see the module docstring). Needs FSDP with ``SHARDED_STATE_DICT``,
            and an ``output_dir`` every rank reads. Construction binds nothing;
            each ``save_state`` / ``load_state`` is collective, as without levels.
        topology: with ``levels``: which node each rank is on (default: each
            rank's environment, ``DCP_ML_NODE``, else ``GROUP_RANK``, else
            ``NODE_RANK``, else ``RANK // LOCAL_WORLD_SIZE``, else node 0:
            ``docs/levels.md``, "Nodes").

    Without ``levels``, only the FSDP model and optimizer states with
    ``SHARDED_STATE_DICT`` change format; the other ``state_dict_type`` values
    and non-FSDP runs save as Accelerate does.

    Raises:
        ConfigError: ``levels`` is not a non-empty list of ``Level``; ``topology``
            without ``levels``; ``writer_options`` the levels set themselves.
    """

    def __init__(
        self,
        *args: Any,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        levels: Sequence[Level] | None = None,
        topology: Topology | None = None,
        **kwargs: Any,
    ) -> None:
        if levels is None and topology is not None:
            raise ConfigError("MultiLevelAccelerator: topology goes with levels=[...]")
        # Checked before Accelerate sets up its state: a wrong option fails fast, not at
        # the first save_state.
        self.levels = None if levels is None else PartLevels.of(levels, topology)
        own = [name for name in _LEVELS_OWN if name in (writer_options or {})]
        if self.levels is not None and own:
            raise ConfigError(
                f"MultiLevelAccelerator(levels=...): writer_options sets {', '.join(own)}, which "
                "the levels set themselves: set them on each Level (Level(..., codec=..., "
                "storage_options=...); deltas: keyframe_every)"
            )
        super().__init__(*args, **kwargs)
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """``Accelerator.save_state`` with FSDP states saved by our writer.

        With ``levels``: the states are step ``save_iteration`` on the levels;
        returns once the first level committed every part (the others follow in
        the background: :meth:`wait_for_checkpoints`), ``output_dir`` then holds
        Accelerate's own files and the marker naming the step.
        """
        if self.levels is None:
            with multilevel_fsdp_checkpoints(self.writer_options, self.reader_options):
                return super().save_state(output_dir, safe_serialization, **kwargs)
        routes = self._level_routes("save_state")
        with _routed(routes):
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        # The ranks that write Accelerate's files into the folder write the marker too.
        on_each_node = self.project_configuration.save_on_each_node
        routes.commit(self.is_local_main_process if on_each_node else self.is_main_process)
        return location

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        *,
        allow_quarantined: bool = False,
        **kwargs: Any,
    ) -> None:
        """``Accelerator.load_state`` with FSDP states loaded by our reader.

        With ``levels``, a folder ``save_state`` saved on levels is loaded from
        them: each node gets back what it lost from the other levels (partner
        copies, parity, remote), then every item is read from the fastest level
        holding it; ``save_iteration`` becomes the folder's step + 1. A folder
        whose step is quarantined in some part (``docs/health.md``) loads the
        newest older step clean in every part, unless ``allow_quarantined``
        (then the folder's step, with a warning); one that not every rank can
        restore in some part (lost with a node) loads the newest older step
        every rank can restore in every part. A folder without the marker
        loads as without levels.
        """
        if self.levels is None:
            with multilevel_fsdp_checkpoints(self.writer_options, self.reader_options):
                return super().load_state(input_dir, load_kwargs, **kwargs)
        routes = self._level_routes("load_state", allow_quarantined)
        with _routed(routes):
            super().load_state(input_dir, load_kwargs, **kwargs)
        if routes.marked_step is not None:
            self.project_configuration.iteration = routes.marked_step + 1
        return None

    def wait_for_checkpoints(self) -> list[DrainResult]:
        """Wait until every save of this process reached every level it is due on
        (``dcp_multilevel.wait()``); the newest drain outcomes. Every rank calls it.

        Raises:
            DrainError: drains that failed, naming each step and level (the first
                level still holds their steps).
        """
        return wait()

    def end_training(self) -> None:
        """``Accelerator.end_training``, after the drains of this process's saves landed
        (they need the process group it ends); a failed drain is raised after it."""
        if self.levels is None:
            return super().end_training()
        try:
            self.wait_for_checkpoints()
        finally:
            super().end_training()
        return None

    def _level_routes(self, call: str, allow_quarantined: bool = False) -> LevelRoutes:
        """The routes of one ``save_state`` / ``load_state`` on the levels.

        Raises:
            ConfigError: this accelerator saves no DCP checkpoint (not FSDP, or FSDP
                with another ``state_dict_type``): the levels would hold nothing.
        """
        assert self.levels is not None
        plugin = self.state.fsdp_plugin if self.distributed_type == DistributedType.FSDP else None
        if plugin is None or plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
            how = (
                f"{DistributedType(self.distributed_type).value}, not FSDP"
                if plugin is None
                else f"FSDP with {StateDictType(plugin.state_dict_type).name}"
            )
            raise ConfigError(
                f"MultiLevelAccelerator(levels=...).{call}: the levels hold FSDP's "
                f"SHARDED_STATE_DICT model and optimizer states, and this accelerator runs {how}; "
                "use FSDP with FullyShardedDataParallelPlugin(state_dict_type="
                "'SHARDED_STATE_DICT'), or pass no levels"
            )
        return LevelRoutes(
            self.levels,
            self.save_iteration,
            self.writer_options,
            self.reader_options,
            _FolderRoutes(self.writer_options, self.reader_options),
            allow_quarantined,
        )
