"""Which node each rank lives on, and which ranks hold copies of a rank's files.

Levels between nodes (partner copies, erasure-coded parity) only protect
anything when a rank's bytes land on *another* node: a copy on the same node
is lost with it. This module is pure (no I/O, no torch.distributed): the
manager gathers every rank's node once (:func:`node_from_env` on each rank,
then one all-gather) and builds a :class:`Topology` from the answers.

Node of a rank, in order of precedence:

1. ``DCP_ML_NODE`` (an explicit override: tests put several "nodes" on one
   machine this way);
2. ``GROUP_RANK`` (torchrun's index of the node's agent), then ``NODE_RANK``
   (the launcher's ``--node-rank``);
3. otherwise ``RANK // LOCAL_WORLD_SIZE`` (torchrun numbers ranks node by
   node), and otherwise node 0 (one process, or a launcher that says nothing).

Placement (:meth:`Topology.partners`) follows NVIDIA resiliency-ext's
replication jump: the copies of a rank's files go to the rank with the same
local index on the nodes ``jump``, ``2*jump``, ... further along the ring of
nodes. A larger ``jump`` spreads copies over racks or other failure domains
numbered node by node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["NODE_ENV", "NODE_FIELD", "Topology", "expand_node", "node_from_env"]

#: Environment variable that sets this process's node explicitly.
NODE_ENV = "DCP_ML_NODE"

#: The placeholder a level path may hold for the node's index (``/nvme/{node}/run``).
NODE_FIELD = "{node}"


def node_from_env(env: Mapping[str, str] | None = None) -> int:
    """This process's node index, from the environment (see the module docstring).

    Raises:
        ConfigError: a variable holds something other than a non-negative integer.
    """
    env = os.environ if env is None else env
    for name in (NODE_ENV, "GROUP_RANK", "NODE_RANK"):
        if env.get(name, "") != "":
            return _index(env, name)
    if env.get("RANK", "") != "" and env.get("LOCAL_WORLD_SIZE", "") != "":
        local = _index(env, "LOCAL_WORLD_SIZE")
        if local == 0:
            raise ConfigError(
                "LOCAL_WORLD_SIZE is 0 in the environment; it counts this node's ranks"
            )
        return _index(env, "RANK") // local
    return 0


def _index(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    if not text.isdigit():
        raise ConfigError(
            f"environment variable {name}={env[name]!r} must be a non-negative integer "
            f"(the index of this process's node{' or rank' if name == 'RANK' else ''})"
        )
    return int(text)


def expand_node(path: str, node: int) -> str:
    """``path`` with every ``{node}`` replaced by ``node`` (other braces are left alone)."""
    return path.replace(NODE_FIELD, str(node))


@dataclass(frozen=True)
class Topology:
    """The node of every rank, in rank order (``nodes[r]`` is rank ``r``'s node).

    Node indexes are labels: they need not be contiguous. Nodes are ordered
    by their index for placement.
    """

    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.nodes or any(not isinstance(n, int) or n < 0 for n in self.nodes):
            raise ConfigError(
                f"a topology needs a non-negative node index for every rank, got {self.nodes!r}"
            )

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> Topology:
        """``ranks_per_node`` consecutive ranks on each node (as torchrun numbers them)."""
        if world_size < 1 or ranks_per_node < 1:
            raise ConfigError(
                f"Topology.uniform needs world_size >= 1 and ranks_per_node >= 1, got "
                f"{world_size} and {ranks_per_node}"
            )
        return cls(tuple(r // ranks_per_node for r in range(world_size)))

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return len(self.nodes)

    @property
    def node_ids(self) -> tuple[int, ...]:
        """The nodes, ascending."""
        return tuple(sorted(set(self.nodes)))

    def ranks_on(self, node: int) -> tuple[int, ...]:
        """The ranks on ``node``, ascending (empty for an unknown node)."""
        return tuple(r for r, n in enumerate(self.nodes) if n == node)

    def leader(self, node: int) -> int:
        """The lowest rank on ``node``: the one that acts for the node (its commits,
        its retention, what it receives in a restore)."""
        return self.ranks_on(node)[0]

    def leads(self, rank: int) -> bool:
        """True when ``rank`` is the lowest rank on its node."""
        return self.leader(self.nodes[rank]) == rank

    def local_index(self, rank: int) -> int:
        """``rank``'s position among the ranks of its node (0 for the lowest)."""
        return self.ranks_on(self.nodes[rank]).index(rank)

    def partners(self, rank: int, replicas: int, jump: int = 1) -> tuple[int, ...]:
        """The ``replicas - 1`` ranks that hold copies of ``rank``'s files, each on another node.

        The ``i``-th copy goes to the node ``i * jump`` places further along the
        ring of nodes, to the rank with the same local index there (modulo that
        node's rank count, when nodes hold different numbers of ranks).

        Raises:
            ConfigError: fewer nodes than copies, or a ``jump`` that would put two
                copies on one node or a copy on the source's own node (it would be
                lost with it); the message says what to change.
        """
        self._check_placement(replicas, jump)
        ring = self.node_ids
        here = ring.index(self.nodes[rank])
        local = self.local_index(rank)
        out = []
        for i in range(1, replicas):
            node = ring[(here + i * jump) % len(ring)]
            ranks = self.ranks_on(node)
            out.append(ranks[local % len(ranks)])
        return tuple(out)

    def holders(self, rank: int, replicas: int, jump: int = 1) -> tuple[int, ...]:
        """The ranks whose files ``rank`` holds copies of (the inverse of :meth:`partners`)."""
        return tuple(
            src for src in range(self.world_size) if rank in self.partners(src, replicas, jump)
        )

    def _check_placement(self, replicas: int, jump: int) -> None:
        if not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
        if not isinstance(jump, int) or jump < 1:
            raise ConfigError(f"jump must be an integer >= 1, got {jump!r}")
        count = len(self.node_ids)
        if replicas > count:
            raise ConfigError(
                f"replicas={replicas} needs {replicas} nodes (each copy on another node than "
                f"its source; a copy on the same node is lost with it), but the ranks are on "
                f"{count} node(s) {list(self.node_ids)}. Lower replicas, or run on more nodes "
                f"(set {NODE_ENV} per process to simulate nodes on one machine)."
            )
        offsets = {(i * jump) % count for i in range(replicas)}
        if len(offsets) < replicas:
            raise ConfigError(
                f"jump={jump} places copies on the same node as their source or as each other "
                f"with {count} nodes and replicas={replicas} (node offsets "
                f"{[(i * jump) % count for i in range(replicas)]}); choose a jump coprime with "
                f"{count}, or one with (replicas - 1) * jump < {count}"
            )
