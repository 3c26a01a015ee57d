"""The cost model: how long one rank takes to write what it was given.

``cost(rank) = bytes / bandwidth + items * per_item_overhead`` (seconds).
Internally costs are integers in *byte-equivalents* (``bytes + items *
overhead_bytes``, with ``overhead_bytes = per_item_overhead * bandwidth``) so
that partitioning is exact and bit-for-bit deterministic on every rank and
platform; :meth:`CostModel.seconds` converts back for reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Per-rank write cost.

    Args:
        bandwidth: bytes per second one rank writes (only the ratio to
            ``per_item_overhead`` matters for balance).
        per_item_overhead: seconds of fixed cost per stored item (request,
            metadata, seek); favours fewer, larger items.
    """

    # The default overhead is small on purpose: DCP's own per-item work runs on
    # every rank whatever the assignment, and byte balance is what sets the
    # slowest rank's write time for checkpoints of MB-sized tensors.
    bandwidth: float = 2e9
    per_item_overhead: float = 1e-6

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ConfigError(f"CostModel.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.per_item_overhead >= 0:
            raise ConfigError(
                f"CostModel.per_item_overhead must be >= 0 s, got {self.per_item_overhead!r}"
            )

    @property
    def overhead_bytes(self) -> int:
        """The per-item overhead expressed in bytes at ``bandwidth``."""
        return round(self.per_item_overhead * self.bandwidth)

    def cost(self, nbytes: int, items: int = 1) -> int:
        """Cost of writing ``items`` items totalling ``nbytes``, in byte-equivalents."""
        return nbytes + items * self.overhead_bytes

    def seconds(self, cost: int) -> float:
        """A cost in byte-equivalents, as seconds."""
        return cost / self.bandwidth
