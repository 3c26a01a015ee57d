"""The extension bases, in one place: what a third-party store, codec, level kind or
save policy implements.

A store, codec or level kind is registered the way the built-ins are, through
an entry-point group of its own, and found by name (``docs/architecture.md``,
"Where a change goes"); a save policy is given to the manager:

- :class:`Store`: bytes below one location (entry points ``dcp_multilevel.stores``);
- :class:`Codec`: a coding of tensor chunks (``dcp_multilevel.codecs``);
- :class:`LevelDriver`: how one kind of level holds checkpoints
  (``dcp_multilevel.levels``);
- :class:`SavePolicy`: which levels take each save (given to the manager).

Each base's module documents the order of its calls and which ranks make them
(``stores/base.py``, ``codecs/base.py``, ``levels/base.py``,
``schedule/base.py``). The conformance suites a subclass runs are in
:mod:`dcp_multilevel.testing` (``StoreTests``, ``CodecTests``, ``LevelTests``).
"""

from .codecs.base import Codec
from .levels.base import LevelDriver
from .schedule.base import SavePolicy
from .stores.base import Store

__all__ = ["Codec", "LevelDriver", "SavePolicy", "Store"]
