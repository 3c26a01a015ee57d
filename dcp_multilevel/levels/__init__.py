"""The levels: what each level holds, what moves between them, and how a lost node
comes back.

One package, read in this order (``docs/architecture.md`` has the glossary and
the save and load paths through it):

- ``config.py``: :class:`Level`, a level list as the user writes it, checked.
- ``topology.py``: which node each rank is on, where copies go.
- ``base.py``: the level-kind contract with its call order (:class:`LevelDriver`,
  :class:`DrainJob`, :class:`DrainResult`, the drain's channel, the rebuild a
  block-keeping kind offers a restore) and the kind registry.
- The kinds, one file each: ``store.py`` (each rank copies its files to one URL),
  ``node_level.py`` (what kinds on the nodes' own disks share), ``partner.py``,
  ``erasure.py`` (+ ``erasure_code.py``, the pure coding); ``wire.py``: verified
  bytes between nodes.
- The runtime, one per level list in a process (``runtime.py``), owns the state
  and the threads: the ``follower.py`` (each save's outcome, in order), the
  ``dispatch.py`` of drain jobs onto the ``lanes.py`` (one thread per higher
  level), the ``books.py`` (what each level holds; ``retention.py``: the pure
  rules), the ``deltas.py`` (each delta level's history). ``saves.py`` and
  ``loads.py`` tie a writer and a reader to it.
- The restore before a load after a loss: ``restore.py`` (the step agreed, rounds
  that re-plan around faults), ``restore_inventory.py``, ``restore_plan.py``,
  ``restore_actions.py``, ``restore_execute.py``.

A level whose ``url`` is a path or store URL is a store level. A level
``Level("<kind>:...")`` uses the driver registered under ``<kind>`` in the
``dcp_multilevel.levels`` entry-point group (built-ins register the same way): a
new kind of level is a new file plus that registration.

Importing this package loads only ``config.py``: a writer or reader without
levels never loads the machinery, and never starts a thread. The other names
below load their module on first use.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .config import LATEST, Level, level_kind

if TYPE_CHECKING:
    from .base import DrainResult
    from .topology import Topology

__all__ = [
    "LATEST",
    "LEVEL_KINDS",
    "DrainJob",
    "DrainResult",
    "Lanes",
    "Level",
    "LevelDriver",
    "StoreLevel",
    "Topology",
    "driver_for",
    "level_kind",
    "newest_step",
    "run_one",
    "wait",
]

#: Name -> the module of this package that defines it, loaded on first use.
_LAZY = {
    "LEVEL_KINDS": "base",
    "DrainJob": "base",
    "DrainResult": "base",
    "LevelDriver": "base",
    "Lanes": "lanes",
    "run_one": "lanes",
    "StoreLevel": "store",
    "Topology": "topology",
    "driver_for": "runtime",
    "runtime_for": "runtime",
    "runtimes": "runtime",
    "release": "runtime",
    "Runtime": "runtime",
    "LevelSaves": "saves",
    "LevelLoads": "loads",
    "SaveTicket": "follower",
    "Restore": "restore",
    "Views": "restore",
    "RestoreReport": "restore_execute",
    "needed_ranges": "restore_inventory",
}

#: Names 0.1.0 exported here under other names: old name -> (module, new name).
_RENAMED = {"Drainer": ("lanes", "Lanes"), "run_drain": ("lanes", "run_one")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _RENAMED:
        module, new = _RENAMED[name]
        warnings.warn(
            f"dcp_multilevel.levels.{name} is renamed dcp_multilevel.levels.{new}; use the "
            "new name (the old one goes in the next major release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f".{module}", __name__), new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wait() -> list[DrainResult]:
    """Wait until every save of this process is followed up and every due drain has
    landed, on every level list; the newest drain outcomes (``dcp_multilevel.wait()``).

    Not collective, but a drain needs every rank's part: call it on every rank
    (after an async save, once its future is done). Without a runtime in this
    process (no save or load was given levels) there is nothing to wait for: ``[]``.

    Raises:
        DrainError: drains that failed since the last call (the first level still
            holds their steps), naming each step and level.
    """
    runtime = sys.modules.get(f"{__name__}.runtime")
    return [] if runtime is None else runtime.wait()


def newest_step(levels: Sequence[Level], *, topology: Topology | None = None) -> int | None:
    """The newest step some rank lists on some level of ``levels``; None when no level
    holds a checkpoint (a fresh start). Collective (every rank).

    For a resume that must not fail on a fresh start::

        if dcp_multilevel.newest_step(levels) is not None:
            dcp.load(state, storage_reader=MultiLevelReader("latest", levels=levels))

    ``MultiLevelReader("latest")`` then loads the newest step *every* rank can read,
    which may be older (a lost node's newest files only it held).
    """
    runtime = importlib.import_module(f"{__name__}.runtime")
    return runtime.newest_step(levels, topology=topology)
