"""PyTorch Lightning strategies whose sharded checkpoints are dcp_multilevel checkpoints.

Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) and
``FSDPStrategy`` (FSDP1) save a sharded checkpoint with a plain
``dcp.save(state, checkpoint_id=path)`` (``_distributed_checkpoint_save``,
not through ``CheckpointIO``) plus a ``meta.pt`` that rank 0 writes with
``torch.save`` (loops, callbacks, hyper-parameters: everything but weights and
optimizer states). They load it back when the folder holds ``meta.pt``. The two
subclasses here change only where the sharded bytes go::

    strategy = MultiLevelModelParallelStrategy(writer_options={"codec": "bytegroup"})
    trainer = L.Trainer(strategy=strategy, ...)
    trainer.fit(model, ckpt_path="ckpt/last.ckpt")  # resumes from ours

``save_checkpoint`` writes the weights and optimizer states with
:class:`~dcp_multilevel.MultiLevelWriter` (then ``meta.pt``, as Lightning
does), and ``load_checkpoint`` reads a folder that holds our manifest with
:class:`~dcp_multilevel.MultiLevelReader`. Anything else (a single-file
checkpoint, a stock DCP folder from before the switch) goes to Lightning's
own code, so existing checkpoints keep loading.

With ``levels=[Level(...), ...]`` a checkpoint is a level step instead
(``docs/levels.md``): partner copies on other nodes, parity, remote stores
(``s3://`` included, which Lightning's own ``pathlib.Path`` handling of the
checkpoint path cannot carry)::

    levels = [Level("/nvme/run"), Level("partner:/nvme/partner"),
              Level("s3://bucket/run", every=4, keep=3)]
    strategy = MultiLevelModelParallelStrategy(levels=levels, ...)
    trainer.fit(model, ckpt_path="ckpt/last.ckpt")  # also "latest" or "step-<N>"

- ``save_checkpoint`` saves the weights, the optimizer states and Lightning's
  ``meta.pt`` content (as its ``torch.save`` bytes, one ``io.BytesIO`` value
  that our reader hands back unpickled) as step ``step-<global step>`` with
  ``MultiLevelWriter(levels=...)`` and ``dcp.save``: a lost node takes
  nothing of the checkpoint with it. At Lightning's path rank 0 writes only a
  marker folder naming the step (the step marker, below), so Lightning's
  callbacks (top-k, ``last.ckpt``, ``remove_checkpoint``) handle markers,
  and the levels' ``keep`` decides what is retained.
- Lightning saves one global step twice (a top-k checkpoint, then
  ``last.ckpt``): the step is saved once, the second save writes its marker
  only, so ``last.ckpt`` holds the first save's ``meta.pt`` content (the
  callbacks' state as of that save). A full save after a weights-only one of
  the same step is refused: it would lose the optimizer states.
- ``load_checkpoint`` finds the step from the marker (the first rank, in rank
  order, that can read it: a node that lost its disk cannot), ``"latest"`` or
  ``"step-<N>"``; the reader agrees on it across ranks and brings back a lost
  node's files from the other levels first. ``"latest"`` passes over quarantined
  steps (``docs/health.md``), and so does a marker naming one (``last.ckpt``
  after a divergence): it resumes from the newest clean step. A marker naming
  the newest step on the levels (``last.ckpt``) is loaded as ``"latest"``:
  after a crash that lost that step with a node, the resume goes to the newest
  step every rank can restore, and the resumed run's saves replace the lost
  one (``docs/levels.md``, "After a crash"). ``"step-<N>"``
  loads a quarantined step with a warning, as does a marker with
  ``reader_options={"allow_quarantined": True}``. A path that holds a checkpoint of
  another kind loads as without levels. (Lightning's ``ckpt_path="last"``
  looks for ``last.ckpt`` on each rank's own disk: pass the path, or "latest".)
- ``teardown`` waits for the drains (``dcp_multilevel.wait()``; a failed one
  is a :class:`~dcp_multilevel.DrainError`), unless the run failed: then the
  exit hook finishes and logs them.

Lightning has no asynchronous save for sharded checkpoints; neither have these.

The step marker: what the strategies given ``levels`` keep where Lightning asks.

With levels, a Lightning checkpoint is a level step (``step-<N>``, N the
trainer's global step) holding the weights, the optimizer states and, as one
``io.BytesIO`` value, Lightning's ``meta.pt`` content: all of it survives
wherever the levels keep the step. At Lightning's own checkpoint path
(``ckpt/last.ckpt``) rank 0 writes only a folder with :data:`MARKER_FILE`,
naming the step::

    ckpt/last.ckpt/dcp_multilevel_step.json   {"format": "dcp_multilevel.lightning-step",
                                               "version": 1, "step": 6}

A load names its step by such a marker, by ``"latest"`` (the newest clean step
every rank can load) or by ``"step-<N>"`` (:func:`level_target`, collective). A
marker naming the newest step the levels hold (``last.ckpt``) resumes from
``"latest"`` (:func:`latest_if_newest`): after a crash that lost that step with
a node, the newest step every rank can restore. A marker naming an older step
that is quarantined (``docs/health.md``: its save's checks found poisoned
state) resumes from ``"latest"`` too (:func:`past_quarantine`).

Tested with ``lightning==2.6.6`` (``tests/stacks/test_integration_lightning.py``).
Besides its public classes this module uses two Lightning internals, pinned
by that version: ``lightning.fabric.utilities.load._METADATA_FILENAME``
(``"meta.pt"``) and, for FSDP1,
``lightning.fabric.strategies.fsdp._get_sharded_state_dict_context``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .. import _dist
from ..errors import CheckpointNotFoundError, ConfigError, ManifestError
from ..format import parse_step_dir
from ..levels import Topology
from ..levels.config import LATEST, Level
from ..levels.runtime import newest_step, runtime_for, wait
from ..plugin import MultiLevelReader, MultiLevelWriter

__all__ = ["MultiLevelFSDPStrategy", "MultiLevelModelParallelStrategy", "MultiLevelStorage"]


#: The file in a marker folder that names the step.
MARKER_FILE = "dcp_multilevel_step.json"
#: The state-dict key of Lightning's ``meta.pt`` content in a level step.
META_KEY = "lightning_meta"
_FORMAT = "dcp_multilevel.lightning-step"
_VERSION = 1

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LevelStep:
    """A level step to load or save: ``"step-<N>"``, ``"latest"``, or ``step-<N>``
    below the first level's root (what :class:`~dcp_multilevel.MultiLevelReader`
    takes as its path with levels)."""

    location: str
    #: Named by a marker at a Lightning checkpoint path (not by the caller).
    marked: bool = field(default=False, compare=False)
    #: ``"latest"`` only: the step a load of it read (the rest of the checkpoint is
    #: read as ``"latest"`` too, and must be that step).
    read: int | None = field(default=None, compare=False)

    @property
    def step(self) -> int | None:
        """The step the location names, or the one a load of ``"latest"`` read (None:
        ``"latest"``, not chosen yet)."""
        named = parse_step_dir(self.location.rstrip("/").rsplit("/", 1)[-1])
        return named if named is not None else self.read

    @classmethod
    def of(cls, step: int, *, marked: bool = False) -> LevelStep:
        """The step ``step`` by name, the same below every level's root."""
        return cls(f"step-{step}", marked)


@dataclass(frozen=True)
class HeldStep:
    """The step this process last saved to the levels, or loaded from them.

    Attributes:
        step: the global step.
        full: it holds optimizer states (False: a weights-only save).
    """

    step: int
    full: bool


def pack_meta(checkpoint: dict[str, Any]) -> io.BytesIO:
    """Lightning's ``meta.pt`` content as ``torch.save`` bytes: stored as they are,
    handed back as bytes, never unpickled by our reader."""
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    return buf


def unpack_meta(value: io.BytesIO, weights_only: bool | None) -> dict[str, Any]:
    """:func:`pack_meta`'s value back, loaded as Lightning loads ``meta.pt``."""
    return torch.load(io.BytesIO(value.getvalue()), weights_only=weights_only)


def write_marker(path: Path, step: int) -> None:
    """Make ``path`` a marker folder naming ``step`` (rank 0 only).

    A single file or a link (``save_last="link"``: writing through it would change
    the checkpoint it points to), or a sharded checkpoint (one with ``meta.pt``) at
    ``path`` gives way, as Lightning's own save replaces one kind by the other. The
    marker file is written under a temporary name, then renamed: a reader sees
    the old marker or the new one, never half of one.
    """
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif (path / _METADATA_FILENAME).is_file():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    doc = {"format": _FORMAT, "version": _VERSION, "step": step}
    tmp = path / f".{MARKER_FILE}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, path / MARKER_FILE)


def read_marker(path: Path) -> int | None:
    """The step the marker folder ``path`` names; None when ``path`` holds no marker.

    Raises:
        ManifestError: the marker file is there but is not one of ours.
    """
    try:
        text = (path / MARKER_FILE).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        doc = json.loads(text)
        ok = doc.get("format") == _FORMAT and isinstance(doc.get("step"), int)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise ManifestError(
            f"{path / MARKER_FILE} is not a dcp_multilevel Lightning step marker "
            f'(expected {{"format": "{_FORMAT}", "step": <int>}}): restore it, or pass '
            "ckpt_path='step-<N>' or 'latest' to load from the levels",
            checkpoint=str(path),
        )
    if doc.get("version", _VERSION) != _VERSION:
        raise ManifestError(
            f"{path / MARKER_FILE} has version {doc['version']!r}; this dcp_multilevel reads "
            f"version {_VERSION}: upgrade dcp_multilevel",
            checkpoint=str(path),
        )
    return int(doc["step"])


def level_target(path: str | os.PathLike[str]) -> LevelStep | None:
    """The level step a Lightning checkpoint path names (collective), or None when it
    names none (a checkpoint folder or file of another kind, or nothing).

    Every rank reads the marker at its own ``path``: a node that lost its disk (or
    never had the path) reads none, and the first rank in rank order that read one
    names the step for all. Without a marker, rank 0's path decides: ``"latest"``,
    or a last part ``step-<N>`` that holds no Lightning checkpoint (no ``meta.pt``).

    Raises:
        ManifestError: on every rank, when a rank found a marker that is not ours.
    """
    text = os.fspath(path)
    here = Path(text)
    name = text.rstrip("/").rsplit("/", 1)[-1]
    named = text == LATEST or (
        parse_step_dir(name) is not None
        and not here.is_file()
        and not (here / _METADATA_FILENAME).is_file()
    )
    try:
        found: int | str | None = read_marker(here)
    except ManifestError as e:  # raised on every rank below: none is left in a collective
        found = str(e)
    everyone = _dist.all_gather_object((found, text if named else None))
    for rank, (seen, _) in enumerate(everyone):
        if isinstance(seen, str):
            raise ManifestError(f"rank {rank}: {seen}", checkpoint=text)
        if seen is not None:
            return LevelStep.of(seen, marked=True)
    first = everyone[0][1]  # rank 0's, as Lightning's own load takes rank 0's path
    return None if first is None else LevelStep(first)


def latest_if_newest(
    target: LevelStep, levels: Sequence[Level], topology: Topology | None = None
) -> LevelStep:
    """``"latest"`` where a marker names the newest step some rank lists on some level
    (or a newer one, which no level holds any more); else ``target``. Collective.

    A marker is written after every save, so ``last.ckpt`` names the newest step.
    After a crash, not every rank may be able to restore it: its only copy of a
    lost node's part was on that node (its partner copy or drain had not
    finished). Loaded by its number it would fail; ``"latest"`` loads the newest
    step every rank can restore, passing over that one (and a quarantined one),
    and the resumed run's saves of the steps it passed over then replace them
    (``docs/levels.md``, "After a crash"): a load of the older step by its number
    would have them refused. Where the marker's step can be restored (and is
    clean), ``"latest"`` loads that very step.
    """
    step = target.step
    if not target.marked or step is None:
        return target
    newest = newest_step(levels, topology=topology)
    if newest is None or step < newest:  # none held (the load says so), or an older step
        return target
    return LevelStep(LATEST)


def past_quarantine(
    target: LevelStep, levels: Sequence[Level], topology: Topology | None = None
) -> LevelStep:
    """``target``, or ``"latest"`` (the newest clean step every rank can load) where a
    marker names a step that is quarantined (``docs/health.md``). Collective.

    A marker is written after every save, so ``last.ckpt`` names the newest step,
    poisoned or not; a step named by the caller (``"step-<N>"``) is loaded as asked
    (the reader warns when it is quarantined). Rank 0 reads the step's manifest on
    the first level, the only level a quarantined step is on.
    """
    step = target.step
    if not target.marked or step is None:
        return target
    runtime = runtime_for(levels, topology=topology, who="MultiLevelStorage")
    why = _dist.rank0_decides(lambda: runtime.quarantine_of(step))
    if why is None:
        return target
    logger.warning(
        "dcp_multilevel: the checkpoint marker names step %d, which is QUARANTINED "
        "(%s): resuming from the newest clean step",
        step,
        why,
    )
    return LevelStep(LATEST)


class MultiLevelStorage:
    """Where a strategy's sharded checkpoints go: our writer, reader and planner.

    Args:
        writer_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelWriter`
            for every save (``codec``, ``thread_count``, ``storage_options``...).
            ``overwrite`` defaults to True here without levels: Lightning saves over
            a path it saved before (``last.ckpt``), as stock DCP does; the old
            checkpoint stays loadable until the new manifest commits. With levels,
            the first level sets ``codec``, ``storage_options`` and ``overwrite``.
        reader_options: keyword arguments of :class:`~dcp_multilevel.MultiLevelReader`
            for every load (``fallbacks``, ``thread_count``...; with levels, not
            ``fallbacks``: the levels name the copies; ``allow_quarantined``: a
            resume loads the newest step, or the marker's, even when quarantined).
        planner: the ``SavePlanner`` of every save (e.g.
            :class:`~dcp_multilevel.BalancedSavePlanner`); one instance is reused
            across saves, so its plan cache works. ``None``: DCP's default.
        levels: save each checkpoint as a level step on these levels
            (:class:`~dcp_multilevel.Level`, fastest first); None: one checkpoint
            folder where Lightning asks.
    """

    def __init__(
        self,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        planner: SavePlanner | None = None,
        levels: Sequence[Level] | None = None,
    ) -> None:
        self.levels = None if levels is None else list(levels)
        # With levels a step saved before is never saved over (the second save of a
        # global step writes its marker only); the first level's overwrite stands.
        default = {} if self.levels is not None else {"overwrite": True}
        self.writer_options = {**default, **(writer_options or {})}
        self.reader_options = dict(reader_options or {})
        self.planner = planner

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds a committed dcp_multilevel checkpoint folder."""
        return MultiLevelReader.validate_checkpoint_id(path)

    def save(self, state: dict[str, Any], where: Path | LevelStep) -> None:
        """``dcp.save`` of ``state`` through our writer (every rank): to the folder
        ``where``, or as the level step ``where``."""
        if isinstance(where, LevelStep):
            writer = MultiLevelWriter(where.location, levels=self._levels(), **self.writer_options)
        else:
            writer = MultiLevelWriter(where, **self.writer_options)
        dcp.save(state, storage_writer=writer, planner=self.planner)

    def load(self, state: dict[str, Any], where: Path | LevelStep) -> Path | LevelStep:
        """``dcp.load`` into ``state`` (in place) through our reader; where the rest of
        the same checkpoint is (:meth:`rest_of`)."""
        reader = self.reader(where)
        dcp.load(state, storage_reader=reader)
        return self.rest_of(where, reader)

    def rest_of(self, where: Path | LevelStep, reader: MultiLevelReader) -> Path | LevelStep:
        """Where the rest of the checkpoint ``reader`` loaded from ``where`` is: the
        level step it read; after a load of ``"latest"``, ``"latest"`` again, with
        the step it read.

        Raises:
            CheckpointNotFoundError: a load of ``"latest"`` read another step than the
                load of ``"latest"`` before it, for the same checkpoint.
        """
        if reader.loads is None or reader.loads.restore is None:
            return where
        step = reader.loads.restore.step
        if not isinstance(where, LevelStep) or where.location != LATEST:
            return LevelStep.of(step)
        if where.read is not None and where.read != step:
            raise CheckpointNotFoundError(
                f'the resume loaded the weights from step {where.read} ("latest") and then '
                f'read step {step} as "latest" for the optimizer states: the levels changed '
                f"during the load. Resume from ckpt_path='step-{where.read}'",
                checkpoint=reader.loads.location,
            )
        # "latest" again, not step-<N>: the runtime takes its last load as the one the run
        # resumed with, and a load of the same step by its number forgets the newer steps
        # the "latest" one passed over (lost with a node, quarantined): the resumed run's
        # saves of them would be refused (docs/levels.md, "After a crash").
        return LevelStep(LATEST, read=step)

    def resume_target(self, target: LevelStep) -> LevelStep:
        """The level step a load of ``target`` reads: a marker naming the newest step
        on the levels resumes from ``"latest"`` (the newest step every rank can
        restore: after a crash that lost the marker's step with a node, an older
        one), and so does one naming a quarantined step, unless the reader
        options say ``allow_quarantined``. Collective."""
        levels, topology = self._levels(), self.reader_options.get("topology")
        # Not by its number: a lost step would fail the resume, and the resumed run's
        # save of it would be refused (docs/levels.md, "After a crash").
        target = latest_if_newest(target, levels, topology)
        if self.reader_options.get("allow_quarantined"):
            return target
        return past_quarantine(target, levels, topology)

    def reader(self, where: Path | LevelStep) -> MultiLevelReader:
        """A reader of the folder or level step ``where`` with this storage's options
        (collective for a level step)."""
        if isinstance(where, LevelStep):
            return MultiLevelReader(where.location, levels=self._levels(), **self.reader_options)
        return MultiLevelReader(where, **self.reader_options)

    def _levels(self) -> list[Level]:
        if self.levels is None:
            raise ConfigError("MultiLevelStorage: a level step needs levels=[...]")
        return self.levels


def _prepare_folder(path: Path) -> None:
    # As Lightning: a single-file checkpoint at the path gives way to a folder.
    # Every rank runs this; on a shared file system another rank may have
    # removed the file first, hence missing_ok.
    if path.is_file():
        path.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)


def _sharded_state(checkpoint: dict[str, Any], model_key: str) -> dict[str, Any]:
    """Take weights and optimizer states out of Lightning's checkpoint dict (in place,
    as Lightning does): what is left is ``meta.pt``."""
    state = {model_key: checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    return state


def _refuse_storage_options(strategy: object, storage_options: Any) -> None:
    if storage_options is not None:
        name = type(strategy).__name__
        raise TypeError(
            f"`{name}.save_checkpoint(..., storage_options=...)` is not supported: {name} "
            "writes through dcp_multilevel, not through the `CheckpointIO`; pass "
            "writer_options={'storage_options': ...} to the strategy instead."
        )


class _OurStorage:
    """What both strategies share: the constructor (the strategy's own arguments, plus
    ours), the save through our writer, the load through our reader (each strategy's
    ``_load_ours`` puts the state into its model and optimizers) and, with levels,
    the drains waited for at teardown."""

    def __init__(
        self,
        *args: Any,
        writer_options: Mapping[str, Any] | None = None,
        reader_options: Mapping[str, Any] | None = None,
        planner: SavePlanner | None = None,
        levels: Sequence[Level] | None = None,
        storage: MultiLevelStorage | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if storage is not None and levels is not None:
            raise ConfigError(
                f"{type(self).__name__}: pass levels=[...] or a storage, not both "
                "(MultiLevelStorage(levels=...) takes them)"
            )
        self.storage = storage or MultiLevelStorage(writer_options, reader_options, planner, levels)
        #: With levels: the step this process last saved or loaded (saved once per step).
        self.held_step: HeldStep | None = None
        self._failed = False

    def _save_ours(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], model_key: str
    ) -> None:
        """Weights and optimizer states with our writer, then ``meta.pt`` (rank 0); with
        levels, all three as a level step, then the marker (rank 0)."""
        # Rank 0's path, as Lightning: every rank must write the same checkpoint.
        path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
        if self.storage.levels is not None:
            return self._save_step(checkpoint, path, model_key)
        _prepare_folder(path)
        self.storage.save(_sharded_state(checkpoint, model_key), path)
        if self.global_rank == 0:  # type: ignore[attr-defined]
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def _save_step(self, checkpoint: dict[str, Any], path: Path, model_key: str) -> None:
        # global_step is the same on every rank, so every rank takes the same branch.
        step = int(checkpoint["global_step"])
        full = "optimizer_states" in checkpoint
        state = _sharded_state(checkpoint, model_key)
        held = self.held_step
        if held is None or held.step != step:
            state[META_KEY] = pack_meta(checkpoint)
            self.storage.save(state, LevelStep.of(step))
            self.held_step = HeldStep(step, full)
        elif full and not held.full:
            raise ConfigError(
                f"{type(self).__name__}: step {step} was saved weights-only to the levels; "
                f"a full save of the same step ({path}) would lose its optimizer states. "
                "Save full checkpoints first, or use save_weights_only=True on every "
                "ModelCheckpoint of the step"
            )
        if self.global_rank == 0:  # type: ignore[attr-defined]
            write_marker(path, step)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load our checkpoint into the model and optimizers (``_load_ours``); return
        ``meta.pt``'s content. With levels, a marker, ``"latest"`` or ``"step-<N>"``
        loads a level step (a marker naming a quarantined step: the newest clean
        one). A path that holds no dcp_multilevel checkpoint goes to Lightning's
        loader."""
        if self.storage.levels is not None:
            target = level_target(checkpoint_path)  # collective
            if target is not None:
                return self._load_step(self.storage.resume_target(target), weights_only)
        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        if not self.storage.holds(path):
            return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        assert self.model is not None and self.lightning_module is not None  # type: ignore[attr-defined]
        self._load_ours(path, {})
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _load_step(self, target: LevelStep, weights_only: bool | None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None  # type: ignore[attr-defined]
        extra: dict[str, Any] = {META_KEY: io.BytesIO()}
        loaded = self._load_ours(target, extra)
        assert isinstance(loaded, LevelStep) and loaded.step is not None
        self.held_step = HeldStep(loaded.step, full=bool(self.optimizers))  # type: ignore[attr-defined]
        return unpack_meta(extra[META_KEY], weights_only)

    def _load_ours(self, where: Path | LevelStep, extra: dict[str, Any]) -> Path | LevelStep:
        """Load the checkpoint at ``where`` into the model and optimizers, and the items
        ``extra`` names into it (with the model's); return where the rest is."""
        raise NotImplementedError

    def on_exception(self, exception: BaseException) -> None:
        """Lightning's hook, before ``teardown``: a failed run does not wait for drains
        (another rank may be gone; the exit hook finishes and logs them)."""
        self._failed = True
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        """With levels, wait for every due drain (``dcp_multilevel.wait()``), then
        Lightning's teardown.

        Raises:
            DrainError: drains that failed (the first level still holds their steps).
        """
        try:
            if self.storage.levels is not None and not self._failed:
                wait()
        finally:
            self._failed = False  # the next run of this strategy starts afresh
            super().teardown()  # type: ignore[misc]


class MultiLevelModelParallelStrategy(_OurStorage, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) saving through us.

    Takes every argument of ``ModelParallelStrategy`` plus those of
    :class:`MultiLevelStorage` (or a ``storage``). With
    ``save_distributed_checkpoint=True`` (the default) a checkpoint path is a
    folder holding our checkpoint and Lightning's ``meta.pt`` or, with
    ``levels``, a marker naming the level step that holds both (see the module
    docstring); with False, Lightning's single-file save is used unchanged.

    Runs wherever ``ModelParallelStrategy`` does, CPU with gloo included.
    """

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save weights and optimizer states with our writer, the rest as ``meta.pt``
        (with levels: all of it as a level step, and a marker at ``filepath``)."""
        _refuse_storage_options(self, storage_options)
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath)
        return self._save_ours(checkpoint, filepath, "state_dict")

    def _load_ours(self, where: Path | LevelStep, extra: dict[str, Any]) -> Path | LevelStep:
        """Our checkpoint into the model and optimizers: the same steps as Lightning's
        own sharded load (fabric's _load_checkpoint)."""
        module_state = {"state_dict": get_model_state_dict(self.model), **extra}
        where = self.storage.load(module_state, where)
        extra.update({key: module_state[key] for key in extra})
        self.model.load_state_dict(
            module_state["state_dict"], strict=self.lightning_module.strict_loading
        )
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            self.storage.load(optim_state, where)
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return where


class MultiLevelFSDPStrategy(_OurStorage, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) saving its sharded checkpoints through us.

    Takes every argument of ``FSDPStrategy`` plus those of
    :class:`MultiLevelStorage` (or a ``storage``); with ``levels``, a checkpoint
    path holds a marker naming a level step, as for
    :class:`MultiLevelModelParallelStrategy`. ``state_dict_type`` defaults
    to ``"sharded"`` here (Lightning's default is ``"full"``, a single file):
    only sharded checkpoints go through us; ``"full"`` is Lightning's
    single-file save, unchanged.

    Needs a GPU, as ``FSDPStrategy`` does: FSDP1 refuses CPU-only execution
    in torch 2.13 ("FSDP needs a non-CPU accelerator device"). Its test runs
    only where CUDA is available.
    """

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save weights and optimizer states with our writer, the rest as ``meta.pt``
        (with levels: all of it as a level step, and a marker at ``filepath``)."""
        _refuse_storage_options(self, storage_options)
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath)
        return self._save_ours(checkpoint, filepath, "model")

    def _load_ours(self, where: Path | LevelStep, extra: dict[str, Any]) -> Path | LevelStep:
        """Our checkpoint into the model and optimizers: the same steps as
        FSDPStrategy.load_checkpoint's sharded branch."""
        with _get_sharded_state_dict_context(self.model):
            module_state = {"model": self.model.state_dict(), **extra}
            where = self.storage.load(module_state, where)
            extra.update({key: module_state[key] for key in extra})
            self.model.load_state_dict(
                module_state["model"], strict=self.lightning_module.strict_loading
            )
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                for idx, optimizer in enumerate(self.optimizers):
                    key = f"optimizer_{idx}"
                    reader = self.storage.reader(where)
                    optim_state = load_sharded_optimizer_state_dict(
                        model_state_dict=module_state["model"],
                        optimizer_key=key,
                        storage_reader=reader,
                    )
                    self.storage.rest_of(where, reader)  # the same step as the weights'
                    flattened = FSDP.optim_state_dict_to_load(
                        optim_state_dict=optim_state[key], model=self.model, optim=optimizer
                    )
                    optimizer.load_state_dict(flattened)
        return where
