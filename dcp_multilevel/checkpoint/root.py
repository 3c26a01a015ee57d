"""The checkpoints below one root: ``<root>/step-<N>/``, listed, opened and swept.

A level of a :class:`~dcp_multilevel.CheckpointManager` keeps its
checkpoints below one root (``format/layout.py`` names them). A
:class:`CheckpointRoot` answers what a process sees there: which steps are
committed, and which step directories hold no manifest (abandoned by a save
or a drain that died). On a node-local root each node sees only its own view.

Finding the steps never lists inside a step (:meth:`CheckpointRoot.scan`):
one listing of the root names the ``step-<N>`` directories, and one lookup
per step asks whether its manifest exists (a ``stat`` on a local disk, a
HEAD on S3, sent concurrently there): the cost grows with the steps, never
with their files.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..format import MANIFEST_NAME, checkpoint_url, parse_step_dir
from ..stores import Store, store_for
from .stored import StoredCheckpoint

__all__ = ["CheckpointRoot", "StepDirs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDirs:
    """The ``step-<N>`` directories below a root, as one scan saw them (each ascending)."""

    committed: tuple[int, ...]  # a manifest is there: the checkpoint exists
    uncommitted: tuple[int, ...]  # no manifest: a save or drain that did not finish


class CheckpointRoot:
    """The checkpoints stored below ``url`` (a path or URL).

    Args:
        url: the root (``/nvme/run1``, ``s3://bucket/run1``).
        storage_options: options for its store.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.store: Store = store_for(url, **self.storage_options)

    def __repr__(self) -> str:
        return f"CheckpointRoot({self.store.url!r})"

    def location(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (a path or URL, as ``url`` is spelled)."""
        return checkpoint_url(self.url, step)

    def checkpoint(self, step: int, *, manifest_bytes: bytes | None = None) -> StoredCheckpoint:
        """The checkpoint of ``step`` (committed or not: see :meth:`StoredCheckpoint.manifest`)."""
        return StoredCheckpoint.at(
            self.location(step), self.storage_options, manifest_bytes=manifest_bytes
        )

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint in this view of the root, ascending."""
        return list(self.scan().committed)

    def uncommitted(self) -> list[int]:
        """Steps whose directory holds no manifest (a save or drain that did not finish)."""
        return list(self.scan().uncommitted)

    def scan(self) -> StepDirs:
        """Every step directory below the root and whether it is committed, in one pass.

        One listing of the root, then one lookup per step directory for its
        manifest, all asked at once (``Store.existing``); nothing inside a step
        is listed, so the cost grows with the steps, not with their files.
        """
        manifests = []
        for name in self.store.listdir(""):
            step = parse_step_dir(name)
            if step is not None:
                manifests.append((step, f"{name}/{MANIFEST_NAME}"))
        present = self.store.existing(path for _, path in manifests)
        committed = sorted(step for step, path in manifests if path in present)
        uncommitted = sorted(step for step, path in manifests if path not in present)
        return StepDirs(tuple(committed), tuple(uncommitted))

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step``, committed or not (manifest first)."""
        self.checkpoint(step).delete()

    def sweep(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        """Remove the store's crash leftovers older than ``older_than_s`` (see ``Store.sweep``;
        ``dry_run``: list them only)."""
        return self.store.sweep(older_than_s, dry_run=dry_run)
