"""Levels of the multi-level ladder: who sends which bytes where, and the drains between them.

- ``base.py``: :class:`LevelDriver` (the interface, with its call order),
  :class:`DrainJob`, :class:`DrainResult`.
- ``store.py``: :class:`StoreLevel`: each rank copies its own files to a URL.
- ``drainer.py``: runs drains in the background (one worker per level, the
  skip/wait policy); ``link.py``: how a drain's ranks agree (c10d store).

A level whose ``url`` is a path or store URL is a store level. A level
``Level("<kind>:...")`` uses the driver registered under ``<kind>`` in the
``dcp_multilevel.levels`` entry-point group (built-ins register the same
way): a new kind of level is a new file plus that registration.
"""

from __future__ import annotations

import re

from .._registry import Registry
from .base import DrainJob, DrainResult, LevelDriver
from .drainer import Drainer, run_drain
from .options import Level
from .store import StoreLevel
from .topology import Topology

__all__ = [
    "LEVEL_KINDS",
    "DrainJob",
    "DrainResult",
    "Drainer",
    "LevelDriver",
    "StoreLevel",
    "Topology",
    "driver_for",
    "level_kind",
    "run_drain",
]

#: kind name -> LevelDriver subclass (constructed as ``cls(level)``).
LEVEL_KINDS: Registry[type[LevelDriver]] = Registry("dcp_multilevel.levels", "level kind")

# "<kind>:" not followed by "//": a kind of level, not a store URL ("s3://...").
_KIND = re.compile(r"^([a-zA-Z][a-zA-Z0-9_\-]*):(?!//)")


def level_kind(level: Level) -> str | None:
    """The kind a level names (``"partner"`` for ``"partner:"``), None for a store level."""
    m = _KIND.match(level.url)
    return m.group(1).lower() if m else None


def driver_for(level: Level) -> LevelDriver:
    """The driver of ``level``: its registered kind's, or a :class:`StoreLevel`.

    Raises:
        RegistryError: the level names a kind that is not installed.
    """
    kind = level_kind(level)
    if kind is None:
        return StoreLevel(level)
    return LEVEL_KINDS.get(kind)(level)
