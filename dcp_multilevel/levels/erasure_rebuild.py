"""How an erasure level rebuilds lost members in a restore (``rebuild.py``'s protocol).

A group description (``erasure.py`` writes one per group, ``holdings`` reports
it) names the group's ``data`` members (their node and files), its ``parity``
blocks and the nodes that keep them. Any ``data`` intact blocks rebuild every
member a node lacks, in one pass (``erasure_blocks.rebuild``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..checkpoint import StoredCheckpoint
from ..stores import Store
from .erasure_blocks import block_chunks, rebuild, send_block
from .rebuild import RebuildChoice

__all__ = ["ErasureRebuilder"]


class ErasureRebuilder:
    """Rebuilds of Reed-Solomon groups (``ErasureLevel.rebuilder``)."""

    def plan(
        self,
        level: int,
        file: str,
        wanted: set[str],
        groups: dict[str, dict[str, Any]],
        inventories: Sequence[Any],
        copyable: Callable[[str], bool],
        block_damaged: Callable[[str, int, int], bool],
    ) -> RebuildChoice | str | None:
        reason: str | None = None
        for g, desc in sorted(groups.items()):
            members = [{f for f, _ in m["files"]} for m in desc["members"]]
            if not any(file in m for m in members):
                continue
            k, m = desc["data"], desc["parity"]
            # Rebuild the members this node lacks and cannot copy (together: one pass).
            lost = [y for y in range(k) if any(not copyable(f) for f in members[y] & wanted)]
            holders = _block_holders(level, g, desc, members, inventories, block_damaged)
            usable = [(b, holders[b]) for b in range(k + m) if b not in lost and b in holders]
            if len(usable) >= k:
                brings = tuple(sorted(f for y in lost for f in members[y]))
                return RebuildChoice(g, tuple(lost), tuple(usable[:k]), brings)
            gone = [
                desc["members"][b]["node"] if b < k else desc["parity_nodes"][b - k]
                for b in range(k + m)
                if b not in holders
            ]
            reason = (
                f"group {g}: RS({k}+{m}) needs {k} intact blocks, has {len(usable)} (blocks "
                f"of nodes {gone} lost or damaged; tolerates {m})"
            )
        return reason

    def receive(
        self,
        desc: dict[str, Any],
        members: Sequence[int],
        sources: Sequence[tuple[int, int]],
        local: dict[int, StoredCheckpoint],
        into: StoredCheckpoint,
        store: Store,
        group: Any,
    ) -> list[tuple[int, int]]:
        return rebuild(desc, members, sources, local, store, into, group)

    def send(
        self, desc: dict[str, Any], block: int, source: StoredCheckpoint, dst: int, group: Any
    ) -> None:
        send_block(block_chunks(source, desc, block), desc["stripe"], dst, group)


def _block_holders(
    level: int,
    g: str,
    desc: dict[str, Any],
    members: list[set[str]],
    inventories: Sequence[Any],
    block_damaged: Callable[[str, int, int], bool],
) -> dict[int, int]:
    """block -> the lowest rank that can stream it intact."""
    out: dict[int, int] = {}
    k = desc["data"]
    # Only the group's nodes hold its blocks: a restore at scale asks about a few
    # groups among thousands of nodes.
    nodes = {m["node"] for m in desc["members"]} | set(desc["parity_nodes"])
    for inv in sorted((i for i in inventories if i.node in nodes), key=lambda i: i.rank):
        held = set(inv.files.get(level, ()))
        for y, files in enumerate(members):
            if y not in out and files <= held and not block_damaged(g, y, inv.rank):
                out[y] = inv.rank
        for pg, b in inv.parity.get(level, ()):
            if pg == g and b >= k and b not in out and not block_damaged(g, b, inv.rank):
                out[b] = inv.rank
    return out
