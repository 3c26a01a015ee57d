"""The level conformance suite: what every kind of level must do under the manager.

A level kind (``Level("<kind>:...")``, registered in the ``dcp_multilevel.levels``
entry-point group) runs the very tests the built-in kinds run, on real
processes (:func:`~dcp_multilevel.testing.ranks.run_ranks`: gloo, one
directory per simulated node)::

    from dcp_multilevel.testing import LevelTests

    class TestMirrorLevel(LevelTests):
        world, ranks_per_node = 3, 1

        @classmethod
        def level(cls, root):
            return Level(f"mirror:{root}/n{{node}}/mirror")

The suite puts the level above a first level on each simulated node's own
disk (``<root>/n<node>/l1``), with ``every=1, keep=2``, saves four steps
faster than they drain, and checks on every rank that the newest reached
the level and that it keeps the two newest it received (the same on every
rank), then deletes node ``lose``'s directory (its disk is lost) and checks
that a new job restores the newest step bit-exact.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import _dist
from ..levels.config import Level
from ..manage.manager import CheckpointManager
from .ranks import run_ranks

__all__ = ["LevelTests", "bit_equal"]

#: The steps every test saves, in order.
STEPS = (1, 2, 3, 4)


def _state(step: int) -> dict[str, Any]:
    """The same on every rank (data parallel), different for every step."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(192, 128, generator=g),
        "b": torch.randn(3000, generator=g).to(torch.bfloat16),
        "layers": {str(i): torch.randn(64, 64, generator=g) for i in range(4)},
        "step": step,
    }


def bit_equal(a: Any, b: Any) -> bool:
    """Bit-exact equality of two nested state dicts (tensors by their bytes and dtype)."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, torch.Tensor):
        bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
        return a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    return bool(a == b)


def _levels(cls: type[LevelTests], root: str) -> list[Level]:
    under_test = dataclasses.replace(cls.level(root), every=1, keep=2)
    return [Level(f"{root}/n{{node}}/l1", keep=2), under_test]


def _save_job(rank: int, world: int, cls: type[LevelTests], root: str) -> dict[str, Any]:
    os.environ["DCP_ML_NODE"] = str(rank // cls.ranks_per_node)
    cls.setup_rank()
    mgr = CheckpointManager(_levels(cls, root))
    for step in STEPS:
        mgr.save(_state(step), step=step)  # faster than the drains: steps wait, or are replaced
    results = mgr.wait()
    mgr.close()
    # Every rank's lane is idle, and with it the retention each node's lowest rank
    # applies there: only now does every rank see the same part on its node.
    _dist.all_gather_object(None)
    mine = [r for r in results if r.level == mgr.drivers[1].url]
    return {
        "held": mgr.steps(1),
        "committed": sorted(r.step for r in mine if r.committed),
        "newest": [(r.committed, r.error) for r in mine if r.step == STEPS[-1]],
        "failed": [r.error for r in mine if r.error],
    }


def _load_job(rank: int, world: int, cls: type[LevelTests], root: str) -> tuple[Any, bool]:
    os.environ["DCP_ML_NODE"] = str(rank // cls.ranks_per_node)
    cls.setup_rank()
    mgr = CheckpointManager(_levels(cls, root))
    state = _state(0)
    step = mgr.load_latest(state)
    mgr.close()  # a restore may copy the lost node's part again
    return step, step is not None and bit_equal(state, _state(step))


class LevelTests:
    """A level kind's contract under :class:`~dcp_multilevel.CheckpointManager`.

    Subclass it in a test module: set :attr:`world` and :attr:`ranks_per_node`
    (enough nodes for the kind), return the level in :meth:`level`, and, if the
    kind needs it in each rank's process, register it in :meth:`setup_rank`.
    """

    #: Ranks (processes) and how many share one simulated node.
    world: int = 2
    ranks_per_node: int = 1
    #: The node whose disk the node-loss test deletes.
    lose: int = 1
    #: Seconds each group of ranks may take.
    timeout_s: float = 240.0

    @classmethod
    def level(cls, root: str) -> Level:  # pragma: no cover - overridden
        """The level under test, below ``root`` (``{node}`` for a node's own disk)."""
        raise NotImplementedError

    @classmethod
    def setup_rank(cls) -> None:
        """Run in every rank's process before its manager is built (default: nothing)."""

    def test_saves_reach_the_level_keep_two_and_survive_a_lost_node(self, tmp_path):
        root = str(tmp_path)
        out = run_ranks(_save_job, self.world, type(self), root, timeout=self.timeout_s)
        for rank, seen in enumerate(out):
            assert seen["failed"] == [], (rank, seen)
            # The newest due step reached the level (older ones waiting behind a
            # drain may have been replaced by it), and retention kept the two newest.
            assert seen["newest"] == [(True, None)], (rank, seen)
            assert seen["held"] == seen["committed"][-2:], (rank, seen)
        assert len({tuple(seen["committed"]) for seen in out}) == 1, out  # one decision
        shutil.rmtree(Path(root) / f"n{self.lose}")  # the node and its disk are gone
        loaded = run_ranks(_load_job, self.world, type(self), root, timeout=self.timeout_s)
        assert loaded == [(STEPS[-1], True)] * self.world, loaded
