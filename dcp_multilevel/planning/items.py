"""What the partitioner works on: items to place and the pieces it places.

Deliberately free of torch and DCP types so the algorithm can be tested (and
fuzzed) in isolation; ``planner.py`` translates DCP ``WriteItem``s to these.

Both are immutable ``NamedTuple``s rather than frozen dataclasses: the planner
makes one per stored item on every save, and a frozen dataclass costs
several times as much to build (one ``object.__setattr__`` per field), a
large share of planning time at small world sizes.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Item", "Piece"]


class Item(NamedTuple):
    """One stored object (a tensor chunk or a bytes blob) as the partitioner sees it.

    Attributes:
        key: the caller's identifier (returned in every ``Piece`` of this item).
        nbytes: bytes to store.
        owners: ranks that hold this item, sorted. One owner: it stays there.
            Several: any of them may write it (replicated data).
        sort_key: total order for deterministic tie-breaking (e.g. "fqn@offsets")
            among replicated items; never read for an item with one owner.
        group: sub-collection name; items of one group stay on one rank when
            balance allows. ``""`` means no group. Replicated items only.
        shape: element shape if the item may be split into sub-boxes (plain
            replicated tensors); ``None`` if it must be written whole.
        itemsize: bytes per element (with ``shape``).
    """

    key: int
    nbytes: int
    owners: tuple[int, ...]
    sort_key: str
    group: str = ""
    shape: tuple[int, ...] | None = None
    itemsize: int = 1


class Piece(NamedTuple):
    """An item, or a box of it, assigned to one rank.

    ``offsets``/``sizes`` are ``None`` for a whole item; otherwise the box
    (in elements) relative to the item, with ``sizes`` covering all dims.
    """

    key: int
    rank: int
    nbytes: int
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None

    @property
    def is_split(self) -> bool:
        """Whether this piece is a box of its item rather than the whole item."""
        return self.offsets is not None
