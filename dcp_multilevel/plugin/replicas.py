"""The replica check's digests: what each rank hashes, what travels, what it learns.

:class:`~dcp_multilevel.BalancedSavePlanner` with ``verify_replicas`` (the
``replicas`` health check, ``docs/health.md``) compares every replicated item's
copies before deduplicating (``plans.check_replicas``). The digests travel
with the local plans and the answer comes back with the final ones::

    every rank    create_local_plan   plan + LocalDigests(digests)     (Digests.attach)
    coordinator   create_global_plan  strip them (stripped), compare, partition;
                                      each final plan + FinalReplicated (with_replicated)
    every rank    finish_plan         learn which of its items are replicated (Digests.learn)

A rank hashes every item it holds until a save of its layout showed which of
them other ranks hold: then only those (nothing under FSDP, where no item is
replicated; about half a ZeRO-1 rank's state). In a single process, nothing.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .. import _dist
from ..format.tensor_bytes import byte_view, value_tensor
from ..planning.fingerprint import fingerprint

__all__ = ["Digests", "FinalReplicated", "LocalDigests", "digest", "stripped", "with_replicated"]


@dataclasses.dataclass(frozen=True)
class LocalDigests:
    """A local plan's ``planner_data`` with the replica check: DCP's mappings, and a
    digest of the items this rank hashed."""

    mappings: Any
    digests: dict[MetadataIndex, str]


@dataclasses.dataclass(frozen=True)
class FinalReplicated:
    """A final plan's ``planner_data`` with the replica check: DCP's mappings, and the
    FQNs of the items the rank writes that other ranks hold too."""

    mappings: Any
    replicated: tuple[str, ...]


class Digests:
    """One planner's side of the exchange (every rank; see the module docstring)."""

    def __init__(self) -> None:
        # The FQNs the last save of this layout showed replicated (None: unknown).
        self._hint: frozenset[str] | None = None

    def forget(self) -> None:
        """The layout changed: hash every item at the next save."""
        self._hint = None

    def attach(self, plan: SavePlan, resolve: Callable[[WriteItem], Any]) -> SavePlan:
        """``plan`` with the digests of the items to compare (``resolve``: the item's data)."""
        if not plan.usable or _dist.world_size() <= 1:
            return plan
        hint = self._hint
        digests = {
            item.index: d
            for item in plan.items
            if (hint is None or item.index.fqn in hint) and (d := digest(item, resolve))
        }
        return dataclasses.replace(plan, planner_data=LocalDigests(plan.planner_data, digests))

    def learn(self, local: SavePlan, final: SavePlan) -> SavePlan:
        """``final`` (this rank's final plan) as DCP expects it; notes which of the items
        of ``local`` are replicated: those others write, and those it was told of."""
        data = final.planner_data
        if not isinstance(data, FinalReplicated):
            return final
        final = dataclasses.replace(final, planner_data=data.mappings)
        held = {item.index.fqn for item in local.items}
        written = {item.index.fqn for item in final.items}
        self._hint = frozenset((held - written) | set(data.replicated))
        return final


def stripped(plans: Sequence[SavePlan]) -> tuple[list[dict[MetadataIndex, str]], list[SavePlan]]:
    """The coordinator: each rank's digests, and the plans as DCP made them."""
    digests = [
        p.planner_data.digests if isinstance(p.planner_data, LocalDigests) else {} for p in plans
    ]
    plain = [
        dataclasses.replace(p, planner_data=p.planner_data.mappings)
        if isinstance(p.planner_data, LocalDigests)
        else p
        for p in plans
    ]
    return digests, plain


def with_replicated(
    plans: Sequence[SavePlan], replicated: Sequence[tuple[str, ...]]
) -> list[SavePlan]:
    """The coordinator: each final plan with the FQNs of its replicated items."""
    return [
        dataclasses.replace(p, planner_data=FinalReplicated(p.planner_data, rep))
        for p, rep in zip(plans, replicated, strict=True)
    ]


def digest(item: WriteItem, resolve: Callable[[WriteItem], Any]) -> str | None:
    """The item's digest; None for a value that does not serialize (the writer reports
    that, naming it, when it stores the value) or has no values (the meta device)."""
    if item.type == WriteItemType.BYTE_IO:
        try:
            data = resolve(item)
        except Exception:  # noqa: BLE001 - not this check's to report
            return None
    else:
        data = resolve(item)
    if isinstance(data, io.BytesIO):
        return xxhash.xxh3_64_hexdigest(data.getbuffer())
    t: torch.Tensor = data.detach()
    if t.device.type == "meta":  # a planning dry run: nothing to compare
        return None
    if t.device.type != "cpu":  # on the device: no whole copy to the host
        return fingerprint(t.resolve_conj().resolve_neg())  # (values, not memory)
    return xxhash.xxh3_64_hexdigest(byte_view(value_tensor(t)))
