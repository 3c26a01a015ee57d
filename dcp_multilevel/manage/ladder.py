"""The manager's levels, checked and bound: which node each rank is on, each level's
driver, the group restores move bytes over.

Call order (construction, every rank, collective)::

    ladder = Ladder.build(levels, topology, timeout_s)
    ladder.sweep(older_than_s)     crash leftovers on every level
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _dist
from ..config import Level
from ..errors import ConfigError
from ..levels import LEVEL_KINDS, LevelDriver, driver_for, level_kind
from ..levels.base import LevelContext
from ..levels.topology import NODE_FIELD, Topology, expand_node, node_from_env
from ..stores.location import parse_location

__all__ = ["Ladder"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ladder:
    """The levels of one manager, fastest first, ready to use."""

    levels: list[Level]  # {node} replaced by this rank's node
    names: list[str]  # the levels as the user wrote them ({node} kept)
    drivers: list[LevelDriver]
    topology: Topology | None  # given, or gathered when a level needs it
    restore_group: Any  # the gloo group restores use (None: no level between nodes)

    @classmethod
    def build(
        cls,
        levels: Sequence[Level] | None,
        topology: Topology | None,
        timeout_s: float,
    ) -> Ladder:
        """Check the levels and bind their drivers (collective: every rank).

        Raises:
            ConfigError: what is wrong with the levels, and what to change.
        """
        given = _levels_argument(levels)
        # The levels' kinds (name, driver class); store levels have none. {node}
        # does not change a kind.
        kinds = [(k, LEVEL_KINDS.get(k)) for k in map(level_kind, given) if k is not None]
        needs_nodes = any(NODE_FIELD in level.url for level in given) or any(
            kind.needs_topology for _, kind in kinds
        )
        if topology is None and needs_nodes:  # gathered from every rank's environment
            topology = Topology(tuple(_dist.all_gather_object(node_from_env())))
        placed = list(given)
        if topology is not None:
            if topology.world_size != _dist.world_size():
                raise ConfigError(
                    f"the topology names {topology.world_size} ranks, the process group "
                    f"has {_dist.world_size()}"
                )
            placed = [_on_node(level, topology.nodes[_dist.rank()]) for level in given]
        first = placed[0]
        node_kinds = [name for name, kind in kinds if kind.node_local]
        if node_kinds and parse_location(first.url).scheme != "file":
            raise ConfigError(
                f"the first level ({first.url}) must be a path on each node's own disk "
                f"when a level keeps copies between nodes ({', '.join(node_kinds)}): those "
                "levels protect node-local checkpoints, and restore into that path"
            )
        if level_kind(first) is not None:
            raise ConfigError(
                f"the first level ({first.url}) must be a store (a path or URL): "
                "save() writes each checkpoint there, and the other levels start from it"
            )
        _check_deltas(placed)
        drivers = [driver_for(level) for level in placed]
        context = LevelContext(topology, timeout_s)
        for driver in drivers:
            driver.bind(context)  # collective: node-local kinds make their groups here
        # Restores move files between nodes over a group of their own (never a
        # drain's: a drain may be running in its thread while the main thread loads).
        group = _dist.new_group(timeout_s) if any(d.node_local for d in drivers) else None
        return cls(placed, [level.url for level in given], drivers, topology, group)

    def survives(self) -> list[str]:
        """What each level survives, for the schedule: the first level, a node, a store."""
        return ["first"] + ["node" if d.node_local else "store" for d in self.drivers[1:]]

    def sweep(self, older_than_s: float) -> None:
        """Remove crash leftovers older than ``older_than_s`` from every level."""
        for driver in self.drivers:
            try:
                driver.sweep(older_than_s)
            except OSError as e:  # housekeeping: never stops a run from starting
                logger.warning("dcp_multilevel: sweeping %s failed: %s", driver.url, e)


def _levels_argument(levels: Sequence[Level] | None) -> list[Level]:
    out = list(levels or ())
    if not out or not all(isinstance(lv, Level) for lv in out):
        raise ConfigError("CheckpointManager needs a non-empty list of Level(...) objects")
    return out


def _on_node(level: Level, node: int) -> Level:
    """``level`` with ``{node}`` in its path replaced (a plain Level: no second warning)."""
    if NODE_FIELD not in level.url:
        return level
    values = {f.name: getattr(level, f.name) for f in dataclasses.fields(Level)}
    return Level(**{**values, "url": expand_node(level.url, node)})


def _check_deltas(levels: Sequence[Level]) -> None:
    """Deltas are for store levels (a level between nodes copies the first level's as
    they are, with their references)."""
    for level in levels:
        if level.deltas and level_kind(level) is not None:
            raise ConfigError(
                f"Level({level.url!r}, keyframe_every={level.keyframe_every}): deltas are stored "
                "on store levels (a path or URL); a level between nodes copies the first "
                "level's files as they are"
            )
