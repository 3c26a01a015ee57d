"""What the Lightning strategies given ``levels`` keep where Lightning asks: a step marker.

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
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME

from .. import _dist
from ..errors import ManifestError
from ..format import parse_step_dir
from ..levels import Topology
from ..levels.config import LATEST, Level
from ..levels.runtime import newest_step, runtime_for

__all__ = [
    "MARKER_FILE",
    "META_KEY",
    "HeldStep",
    "LevelStep",
    "latest_if_newest",
    "level_target",
    "pack_meta",
    "past_quarantine",
    "read_marker",
    "unpack_meta",
    "write_marker",
]

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
