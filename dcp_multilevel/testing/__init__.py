"""Conformance suites a plugin runs, as the built-ins do (as ``zarr.testing`` ships its own).

- :class:`StoreTests` (``stores.py``): the byte-store contract (a new URL scheme).
- :class:`LevelTests` (``levels.py``): a level kind under the manager, on real
  processes: drains, retention, and a restore after a lost node.
- :class:`CodecTests` (``codecs.py``): chunk round trips, damaged payloads,
  registration, a DCP checkpoint through the codec.
- ``ranks.py``: :func:`run_ranks`, the multi-process harness they use (gloo,
  forked from a server that imported torch once).

Needs pytest (the ``test`` extra). Subclass a suite in a test module, give
it its fixture or class attributes, and pytest collects the inherited tests.
"""

from .codecs import CodecTests
from .levels import LevelTests
from .ranks import RankError, RankTimeoutError, run_ranks
from .stores import StoreTests

__all__ = ["CodecTests", "LevelTests", "RankError", "RankTimeoutError", "StoreTests", "run_ranks"]
