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
to the levels instead ("Levels" below): each part is step N of a
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

Levels: where each part goes, which step a folder holds.

With FSDP and ``SHARDED_STATE_DICT``, one ``save_state(output_dir)`` makes one DCP
save per model (``<output_dir>/pytorch_model_fsdp_<i>``) and one per optimizer
(``<output_dir>/optimizer_<i>``). With levels, each of these parts is a checkpoint
of its own, on a level list of its own: every level's URL with the part's name
appended (``Level("/nvme/run")`` holds the first model's step N in
``/nvme/run/pytorch_model_fsdp_0/step-<N>/``). A list per part because DCP
commits each save alone and a process keeps one level list per first root:
each part drains, is retained and is restored on its own, all under the same N.

N is ``Accelerator.save_iteration`` when ``save_state`` is called (Accelerate's
count of saves, which also numbers its ``checkpoint_<N>`` folders). What ties
``output_dir`` to N is :class:`StepMarker`, ``dcp_multilevel_levels.json`` in
``output_dir``, written once every part committed on its first level and
Accelerate's own files are written: a folder without it holds no finished save
on levels. ``load_state(input_dir)`` has rank 0 read it and tells every rank
(a node that lost its disk may not see it); a folder without it is loaded as
before levels (our single-level checkpoint, or stock DCP's).

A part of step N may be quarantined (``docs/health.md``: its save's checks found
poisoned state; each part is checked on its own). Then the parts are loaded at
the newest older step no part of which is quarantined, all at the same step
(:func:`_clean_step`), unless the load allows quarantined steps. After a crash,
not every rank may be able to restore a part of step N (lost with a node); then
the parts are loaded at the newest older step every rank can restore in every
part (:func:`_restorable_step`).

Call order, every rank, one :class:`LevelRoutes` per ``save_state`` / ``load_state``::

    LevelRoutes(levels, step, ...)
    save: writer(path)   each DCP save Accelerate makes: our writer of the part
          commit(writes) after save_state: the marker, by the ranks that write
                         Accelerate's shared files
    load: reader(path)   each DCP load: the marker (rank 0 reads, collective), the
                         step to load (rank 0 reads the parts' health, every rank
                         lists the parts' levels; collective), our reader of the
                         part at it; no marker: ``fallback``
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.fsdp import StateDictType

from .. import _dist
from ..errors import CheckpointNotFoundError, ConfigError, DcpMultilevelError, ManifestError
from ..format.stock_hint import STOCK_METADATA_NAME
from ..levels import DrainResult, Topology
from ..levels.config import Level, describe
from ..levels.restore import Views, every_file, gather_views
from ..levels.runtime import Runtime, runtime_for, wait
from ..plugin import MultiLevelReader, MultiLevelWriter

__all__ = ["MultiLevelAccelerator", "multilevel_fsdp_checkpoints"]


#: The file in ``output_dir`` naming the step its parts are on the levels.
MARKER_NAME = "dcp_multilevel_levels.json"
_MARKER_FORMAT = "dcp_multilevel.accelerate.levels/1"

logger = logging.getLogger(__name__)


class Routes(Protocol):
    """What a routing window builds in place of ``FileSystemWriter`` / ``FileSystemReader``.

    Each method gets the folder Accelerate passes and returns a callable that
    builds ours, or None where stock DCP's class is to be built.
    """

    def writer(self, path: str | os.PathLike[str]) -> Callable[[], Any] | None:
        """What builds the writer of ``path`` (None: stock's)."""

    def reader(self, path: str | os.PathLike[str]) -> Callable[[], Any] | None:
        """What builds the reader of ``path`` (None: stock's)."""


@dataclass(frozen=True)
class StepMarker:
    """What ``save_state`` left in its folder: the step its parts are on the levels.

    Attributes:
        step: the step of every part (``step-<N>`` on each part's levels).
        parts: the parts' folder names (``pytorch_model_fsdp_0``, ``optimizer_0``).
        levels: the levels, as written in messages (without their storage options).
    """

    step: int
    parts: tuple[str, ...]
    levels: str

    def write(self, folder: str | os.PathLike[str]) -> None:
        """Write the marker into ``folder``, atomically (a load sees the old one or this)."""
        doc = {
            "format": _MARKER_FORMAT,
            "step": self.step,
            "parts": list(self.parts),
            "levels": self.levels,
        }
        final = os.path.join(os.fspath(folder), MARKER_NAME)
        temporary = f"{final}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())  # the marker commits the save: its data first
        os.replace(temporary, final)

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> StepMarker | None:
        """The marker in ``folder`` (None: there is none).

        Raises:
            ManifestError: the file is there but is no marker of ours.
        """
        path = os.path.join(os.fspath(folder), MARKER_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(text)
            if doc["format"] != _MARKER_FORMAT:
                raise ValueError(f"format {doc['format']!r}")
            marker = cls(int(doc["step"]), tuple(str(p) for p in doc["parts"]), str(doc["levels"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(
                f"{path} is not a dcp_multilevel step marker ({type(e).__name__}: {e}); it names "
                "the step a save_state with levels= wrote. Load the step from the levels "
                f"with dcp.load and MultiLevelReader('step-<N>', levels=...) instead",
                checkpoint=os.fspath(folder),
            ) from None
        return marker


@dataclass(frozen=True)
class PartLevels:
    """An accelerator's levels and topology, and each part's level list.

    Attributes:
        levels: the levels as the user gave them, fastest first.
        topology: which node each rank is on (None: each rank's environment, as
            ``levels/topology.py``'s ``node_from_env`` reads it).
    """

    levels: tuple[Level, ...]
    topology: Topology | None = None

    @classmethod
    def of(cls, levels: Sequence[Level], topology: Topology | None) -> PartLevels:
        """Checked ``levels``.

        Raises:
            ConfigError: not a non-empty list of ``Level``.
        """
        given = tuple(levels) if isinstance(levels, (list, tuple)) else ()
        if not given or not all(isinstance(level, Level) for level in given):
            raise ConfigError(
                "MultiLevelAccelerator(levels=...) needs a non-empty list of "
                f"dcp_multilevel.Level(...) objects, got {levels!r}"
            )
        return cls(given, topology)

    def of_part(self, part: str) -> list[Level]:
        """The level list of ``part``: each level's URL with the part's folder name appended."""
        return [
            dataclasses.replace(level, url=f"{level.url.rstrip('/')}/{part}")
            for level in self.levels
        ]


class LevelRoutes:
    """The writers and readers of one ``save_state`` or ``load_state`` with levels.

    Args:
        levels: the accelerator's levels.
        step: the step a save writes (``save_iteration``).
        writer_options: keyword arguments of every writer (``thread_count``...).
        reader_options: keyword arguments of every reader.
        fallback: the reader of a folder without a marker (saved without levels).
        allow_quarantined: a load reads the step the marker names even when a part
            of it is quarantined (the reader warns).
    """

    def __init__(
        self,
        levels: PartLevels,
        step: int,
        writer_options: Mapping[str, Any],
        reader_options: Mapping[str, Any],
        fallback: Routes,
        allow_quarantined: bool = False,
    ) -> None:
        self.levels = levels
        self.step = step
        self.writer_options = dict(writer_options)
        self.reader_options = dict(reader_options)
        self.fallback = fallback
        self.allow_quarantined = allow_quarantined
        #: The folders this save wrote parts into, each with its parts, in order.
        self.saved: dict[str, list[str]] = {}
        #: The markers read by this load, by folder (rank 0's: the same on every rank).
        self.markers: dict[str, StepMarker | None] = {}
        #: The step each folder's parts are loaded at (its marker's, or older).
        self.steps: dict[str, int] = {}
        #: The step this load read (None: none on levels).
        self.loaded_step: int | None = None
        #: The step the marker of the folder this load read names (None: none).
        self.marked_step: int | None = None

    def writer(self, path: str | os.PathLike[str]) -> Callable[[], Any]:
        """Our writer of the part ``path`` names, at this save's step, on its levels."""
        folder, part = _split(path)
        self.saved.setdefault(folder, []).append(part)
        return functools.partial(
            MultiLevelWriter,
            f"step-{self.step}",
            levels=self.levels.of_part(part),
            topology=self.levels.topology,
            **self.writer_options,
        )

    def reader(self, path: str | os.PathLike[str]) -> Callable[[], Any] | None:
        """Our reader of the part ``path`` names, at the step its folder's marker names
        (or the newest older one no part of which is quarantined); the fallback's where
        there is no marker. Collective."""
        folder, part = _split(path)
        if folder not in self.markers:
            marker = self.markers[folder] = _rank0_marker(folder)
            if marker is not None:
                self.steps[folder] = _step_to_load(
                    marker, self.levels, folder, self.allow_quarantined
                )
        marker = self.markers[folder]
        if marker is None:
            return self.fallback.reader(path)
        self.marked_step = marker.step
        self.loaded_step = self.steps[folder]
        return functools.partial(
            MultiLevelReader,
            f"step-{self.loaded_step}",
            levels=self.levels.of_part(part),
            topology=self.levels.topology,
            **self.reader_options,
        )

    def commit(self, writes: bool) -> None:
        """After ``save_state``: mark each folder it saved parts into with the step (where
        ``writes``: the ranks that write Accelerate's files into a shared folder)."""
        if not writes:
            return
        for folder, parts in self.saved.items():
            StepMarker(self.step, tuple(parts), describe(self.levels.levels)).write(folder)


def _split(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``<output_dir>/<part>`` as (output_dir, part)."""
    folder, part = os.path.split(os.fspath(path).rstrip("/"))
    return folder, part


def _rank0_marker(folder: str) -> StepMarker | None:
    """Rank 0's marker of ``folder``, on every rank (collective): all ranks load the same
    step, and a rank whose node lost its disk (or never saw the folder) learns it too."""
    found: StepMarker | None = None
    error: str | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            found = StepMarker.read(folder)
        except ManifestError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Plain values only: rank 0's failure reaches every rank, none waits for it.
        box = [None if found is None else dataclasses.asdict(found), error]
        dist.broadcast_object_list(box, src=0)
        doc, error = box
        found = None if doc is None else StepMarker(doc["step"], tuple(doc["parts"]), doc["levels"])
    if error is not None:
        raise ManifestError(error, checkpoint=folder)
    return found


def _step_to_load(
    marker: StepMarker, levels: PartLevels, folder: str, allow_quarantined: bool
) -> int:
    """The step to load ``folder``'s parts at (collective): the marker's, or an older one
    where a part of it is quarantined (:func:`_clean_step`, unless ``allow_quarantined``)
    or cannot be restored by every rank (:func:`_restorable_step`); every part from the
    same step."""
    runtimes = {
        part: runtime_for(
            levels.of_part(part), topology=levels.topology, who="MultiLevelAccelerator.load_state"
        )
        for part in marker.parts
    }
    step = marker.step if allow_quarantined else _clean_step(marker, runtimes, folder)
    return _restorable_step(step, marker, runtimes, folder, allow_quarantined)


def _clean_step(marker: StepMarker, runtimes: Mapping[str, Runtime], folder: str) -> int:
    """The step to load ``folder``'s parts at (collective): the marker's, unless a part
    of it is quarantined (``docs/health.md``); then the newest older step no part of
    which is, so that every part comes from the same step. Rank 0 decides from the
    parts' first levels, the only level a quarantined step is on; when it cannot
    list them, the marker's step is loaded (the reader warns if it is quarantined).

    Raises:
        CheckpointNotFoundError: every step up to the marker's is quarantined in some part.
    """

    def decide() -> tuple[int | None, list[tuple[int, str]], str | None]:
        try:
            return (*_newest_clean(marker.step, runtimes), None)
        except (DcpMultilevelError, OSError) as e:
            return marker.step, [], str(e)

    step, passed, error = _dist.rank0_decides(decide)
    if error is not None:
        logger.warning(
            "dcp_multilevel: could not read the health of %s's steps (%s); "
            "loading step %d, the one its marker names",
            folder,
            error,
            marker.step,
        )
    for older, why in passed:
        logger.warning(
            "dcp_multilevel: passing over step %d of %s, quarantined: %s", older, folder, why
        )
    if step is None:
        first = runtimes[marker.parts[0]].given[0].url
        raise CheckpointNotFoundError(
            f"every step of {folder}'s parts up to step {marker.step} is quarantined in some "
            f"part (steps {sorted(s for s, _ in passed)}: their checks found poisoned state, "
            f"see `dcp-multilevel ls {first}`). Load step {marker.step} deliberately with "
            "load_state(..., allow_quarantined=True), or start fresh.",
            checkpoint=folder,
        )
    if step != marker.step:
        logger.warning(
            "dcp_multilevel: loading step %d of the levels, the newest clean one; "
            "Accelerate's own files in %s (RNG states, schedulers, samplers) are "
            "those of step %d's save",
            step,
            folder,
            marker.step,
        )
    return step


def _restorable_step(
    step: int,
    marker: StepMarker,
    runtimes: Mapping[str, Runtime],
    folder: str,
    allow_quarantined: bool,
) -> int:
    """``step``, or where some part of it cannot be restored by every rank, the newest
    older step that can be in every part (and, unless ``allow_quarantined``, is clean
    in every part), so that every part comes from the same step. Collective: every
    rank lists every part's levels, and each part's runtime plans the restore of each
    step tried (the same verdict on every rank).

    After a crash, the marker's step may be lost with a node: its only copy of that
    node's part was on the node, its partner copy or drain not finished. A load of it
    by its number would fail the resume (``docs/levels.md``, "After a crash"). The
    numbering goes on after the marker's step (``save_iteration``), so the resumed
    run does not save the steps passed over again.

    Raises:
        CheckpointNotFoundError: no step up to ``step`` can be restored in every part.
    """
    views: dict[str, Views] = {}
    for part, runtime in runtimes.items():
        runtime.follow_up()  # this process's saves are listed
        views[part] = gather_views(runtime.drivers)
    listed = set.intersection(*(set(v.candidates()) for v in views.values()))
    unrestorable: list[int] = []
    for candidate in sorted({step} | {s for s in listed if s < step}, reverse=True):
        older = candidate != step  # the step itself: _clean_step read its health
        if older and not allow_quarantined and _quarantined_anywhere(candidate, runtimes):
            continue
        # Part by part, stopping at the first that cannot: every rank stops at the same.
        if all(runtimes[p].restorer.plan(candidate, views[p], every_file).ok for p in runtimes):
            if unrestorable:
                logger.warning(
                    "dcp_multilevel: loading step %d of the levels, the newest every "
                    "rank can restore in every part (not steps %s); Accelerate's own "
                    "files in %s (RNG states, schedulers, samplers) are those of "
                    "step %d's save",
                    candidate,
                    unrestorable,
                    folder,
                    marker.step,
                )
            return candidate
        unrestorable.append(candidate)
    raise CheckpointNotFoundError(
        f"no step of {folder}'s parts up to step {step} can be restored by every rank in "
        f"every part (steps {unrestorable}: a node-local level on a lost node, and no higher "
        "level holds the node's files?). Restore the nodes' disks, or start fresh.",
        checkpoint=folder,
    )


def _quarantined_anywhere(step: int, runtimes: Mapping[str, Runtime]) -> bool:
    """Whether a part of ``step`` is quarantined (rank 0 reads; collective). False where
    rank 0 cannot read it: the reader warns when it loads a quarantined step."""

    def read() -> bool:
        try:
            return _quarantined_parts(step, runtimes) is not None
        except (DcpMultilevelError, OSError):
            return False

    return _dist.rank0_decides(read)


def _newest_clean(
    newest: int, runtimes: Mapping[str, Runtime]
) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest step up to ``newest`` that every part's levels list (this rank's view)
    and no part's first level holds quarantined, and each newer step passed over, with
    why (None: there is none)."""
    passed: list[tuple[int, str]] = []
    why = _quarantined_parts(newest, runtimes)
    if why is None:
        return newest, passed
    passed.append((newest, why))
    listed = [
        {s for driver in runtime.drivers for s in driver.steps()} for runtime in runtimes.values()
    ]
    for step in sorted((s for s in set.intersection(*listed) if s < newest), reverse=True):
        why = _quarantined_parts(step, runtimes)
        if why is None:
            return step, passed
        passed.append((step, why))
    return None, passed


def _quarantined_parts(step: int, runtimes: Mapping[str, Runtime]) -> str | None:
    """Why ``step`` is quarantined, part by part (None: in no part)."""
    found = [
        f"{part}: {why}"
        for part, runtime in runtimes.items()
        if (why := runtime.quarantine_of(step)) is not None
    ]
    return "; ".join(found) or None


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
