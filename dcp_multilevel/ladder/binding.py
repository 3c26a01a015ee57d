"""A level list, checked and bound: which node each rank is on, each level's driver,
the group restores move bytes over.

Call order (construction, every rank, collective)::

    binding = Binding.build(levels, topology, timeout_s)
    binding.sweep(older_than_s)     crash leftovers on every level
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _dist
from ..errors import ConfigError
from ..levels import LEVEL_KINDS, LevelDriver, driver_for, level_kind
from ..levels.base import LevelContext
from ..levels.options import Level, check_codec
from ..levels.topology import NODE_FIELD, Topology, expand_node, node_from_env
from ..stores.location import parse_location

__all__ = ["Binding", "root_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Binding:
    """The levels of one ladder, fastest first, ready to use."""

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
    ) -> Binding:
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
        for level in given:  # a codec (un)registered since the Level was made
            check_codec(level)
        _check_roots(given, topology)
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
        raise ConfigError(
            f"levels must be a non-empty list of dcp_multilevel.Level(...) objects, got {levels!r}"
        )
    return out


def _on_node(level: Level, node: int) -> Level:
    """``level`` with ``{node}`` in its path replaced (a plain Level: no second warning)."""
    if NODE_FIELD not in level.url:
        return level
    values = {f.name: getattr(level, f.name) for f in dataclasses.fields(Level)}
    return Level(**{**values, "url": expand_node(level.url, node)})


#: fsspec's other spellings of one protocol (the same bucket either way).
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}


def root_of(url: str, kind: str | None) -> tuple[str, str] | None:
    """``(scheme, normalized path)`` of the root a level's url names (its kind stripped).

    Plain paths and ``file://`` URLs are made absolute and normalized; other
    URLs lose repeated, leading and trailing slashes (``s3://b/run/`` is
    ``s3://b/run``), as fsspec reads them.
    """
    where = url[len(kind) + 1 :] if kind is not None else url
    if not where.strip():  # "partner:": the kind's driver says what is missing
        return None
    location = parse_location(where)
    if location.scheme == "file":
        return "file", os.path.normpath(os.path.abspath(location.path))
    rest = location.url.split("://", 1)[1]
    path = posixpath.normpath("/" + rest.strip("/")) if rest.strip("/") else "/"
    return _SCHEME_ALIASES.get(location.scheme, location.scheme), path


def _inside(outer: str, inner: str) -> bool:
    """Whether normalized path ``inner`` is ``outer`` or below it."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _check_roots(levels: Sequence[Level], topology: Topology | None) -> None:
    """No level's root is another's or inside it (ConfigError naming both levels).

    Two levels in one place would see each other's checkpoints: retention,
    crash sweeps and loads of one would count, delete or read the other's.
    ``{node}`` paths are compared as each node's ranks expand them, for every
    node of the topology: ``/nvme/{node}/ckpt`` and ``partner:/nvme/{node}/copies``
    never meet; ``/nvme/{node}/ckpt`` and ``/nvme/0/ckpt`` do on node 0.
    """
    nodes = sorted(set(topology.nodes)) if topology is not None else [None]
    for node in nodes:
        urls = [lv.url if node is None else expand_node(lv.url, node) for lv in levels]
        roots = [root_of(url, level_kind(lv)) for url, lv in zip(urls, levels, strict=True)]
        for i, root_i in enumerate(roots):
            for j in range(i + 1, len(roots)):
                root_j = roots[j]
                if root_i is None or root_j is None or root_i[0] != root_j[0]:
                    continue
                path_i, path_j = root_i[1], root_j[1]
                templated = NODE_FIELD in levels[i].url or NODE_FIELD in levels[j].url
                on = f" on node {node}" if templated else ""
                first, second = f"{i} ({levels[i].url!r})", f"{j} ({levels[j].url!r})"
                if path_i == path_j:
                    what = f"levels {first} and {second} are the same location{on} ({urls[j]})"
                elif _inside(path_i, path_j):
                    what = f"level {second} is inside level {first}{on} ({urls[j]} is in {urls[i]})"
                elif _inside(path_j, path_i):
                    what = f"level {first} is inside level {second}{on} ({urls[i]} is in {urls[j]})"
                else:
                    continue
                raise ConfigError(
                    f"{what}: each level needs a root of its own, outside the others' (a "
                    "level's retention, crash sweeps and loads would see the other's "
                    "checkpoints)"
                )


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
