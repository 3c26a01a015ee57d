"""What each rank needs of a step and what its node holds: the restore's inventories.

Before a load, every rank takes an :class:`~dcp_multilevel.levels.restore_plan.Inventory`
(:func:`take_inventory`): the files (or the items' byte ranges) its ranks need
(a dry run of DCP's load planner on its state_dict, :func:`needed_ranges`),
and what its node holds of the step on every level, parity blocks and group
descriptions included (``LevelDriver.holdings``). The inventories are
exchanged by node (:func:`gather_inventories`): the ranks of a node send their
needs (:func:`split_needs`) to its lowest rank, which alone lists what the node
holds, and every rank gets every rank's inventory back; every rank then plans
alike (``plan.py``). What each rank sends and receives: ``docs/scale.md``.

Collective: every function that says so is called by every rank in the
same order, on the main thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..format import PLACEMENT_NAME, Manifest
from . import restore_plan
from .base import LevelDriver
from .restore_actions import Inventory
from .restore_execute import parts_copy
from .restore_plan import merge_node_needs, merge_ranges

__all__ = [
    "ExchangeBytes",
    "expand_records",
    "gather_inventories",
    "join_records",
    "needed_ranges",
    "needs_message",
    "node_record",
    "placement_digest",
    "placement_senders",
    "simulate_exchange",
    "split_needs",
    "take_inventory",
    "whole_files_of",
]

logger = logging.getLogger(__name__)


#: The length before each rank's needs sent to its node's receiver (u64).
_LENGTH = struct.Struct("<Q")


def needed_ranges(
    state_dict: dict[str, Any], manifest: Manifest, planner: Any
) -> dict[str, list[list[int]]] | None:
    """Per data file, the ``[offset, end)`` byte ranges of the items this rank's load
    will read (merged), or None (every byte of every file) when unknown.

    A dry run of DCP's default load planner on ``state_dict`` (no data is
    read). Unknown, and so everything, when the caller passes its own
    planner or a ``Stateful`` (whose ``state_dict()`` DCP calls itself).
    """
    if planner is not None and type(planner) is not DefaultLoadPlanner:
        return None
    if any(isinstance(v, Stateful) for v in state_dict.values()):
        return None
    try:
        dry = DefaultLoadPlanner()
        dry.set_up_planner(state_dict, manifest.metadata, is_coordinator=False)
        plan = dry.create_local_plan()
        per_file: dict[str, list[list[int]]] = {}
        for item in plan.items:
            loc = manifest.locations[item.storage_index]
            per_file.setdefault(loc.file, []).append([loc.offset, loc.offset + loc.length])
    except Exception as e:  # noqa: BLE001 - the real load will report it; fetch everything
        logger.debug("dcp_multilevel: load dry run failed (%s); restoring every file", e)
        return None
    return {f: [list(r) for r in merge_ranges(rs)] for f, rs in sorted(per_file.items())}


def split_needs(
    ranges: dict[str, list[list[int]]] | None,
    manifest: Manifest,
    part_share: float = restore_plan.PART_SHARE,
) -> tuple[list[str] | None, dict[str, list[list[int]]] | None]:
    """What a rank's load reads (``needed_ranges``) as an inventory says it: the files
    (None: every one), and the byte ranges of only those it reads at most
    ``part_share`` of (the others are copied whole anyway: a rank that reads
    everything sends no ranges at all)."""
    if ranges is None:
        return None, None
    needs = None if set(ranges) >= set(manifest.files) else sorted(ranges)
    partly = {
        f: rs
        for f, rs in ranges.items()
        if sum(b - a for a, b in rs) <= part_share * manifest.files[f]
    }
    return needs, partly


def take_inventory(
    step: int,
    drivers: Sequence[LevelDriver],
    manifest: Manifest,
    needs: tuple[list[str] | None, dict[str, list[list[int]]] | None],
    node: int,
    whole: Sequence[int],
) -> Inventory:
    """What this rank's node holds of ``step``: file listings only (no data is read).

    ``needs``: what this rank's load reads, as :func:`split_needs` gives it.
    """
    names = set(manifest.files)
    inv = Inventory(_dist.rank(), node, needs[0], needs[1], whole=list(whole))
    for i, driver in enumerate(drivers):
        if i > 0 and not driver.node_local:
            continue
        ckpt = driver.checkpoint(step)
        try:
            if i > 0 and not ckpt.is_committed():
                continue
            inv.files[i] = sorted(ckpt.data_files() & names)
            held = driver.holdings(step)
            if held is not None:
                inv.parity[i], inv.groups[i] = held["parity"], held["groups"]
            if i > 0 and inv.placement is None:
                inv.placement = _placement(ckpt)
        except (OSError, ValueError) as e:  # an unreadable part is a part not held
            logger.warning("dcp_multilevel: cannot list step %d on %s: %s", step, driver.url, e)
    inv.parts = parts_copy(drivers[0].checkpoint(step), manifest) is not None
    return inv


def _placement(ckpt: StoredCheckpoint) -> list[int] | None:
    try:
        return list(json.loads(ckpt.store.read_bytes(PLACEMENT_NAME))["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gather_inventories(
    inv: Inventory, members: Sequence[int] = (), group: Any = None
) -> list[Inventory]:
    """Every rank's inventory, in rank order. Collective.

    ``members``: the ranks of this rank's node, when known, and ``group`` the
    restore's group. With a group, the exchange goes by node (``docs/scale.md``):

    1. each rank but the node's lowest sends that rank its needs, ranges and
       store levels (:func:`needs_message`), point to point;
    2. the lowest rank merges them (``merge_node_needs``) and sends rank 0 one
       record for the node (:func:`node_record`): the ranks of a node list the
       same node's files, parity and groups, so those travel once per node, and
       the placement (an int per rank, the same on every node) as its digest;
    3. rank 0 asks the lowest rank naming each placement digest for it (one
       small broadcast, usually one placement, usually rank 0's own);
    4. rank 0 joins the records, each group description and placement once
       (:func:`join_records`: every node of a group holds its description), and
       broadcasts them; every rank rebuilds every rank's inventory
       (:func:`expand_records`): the ones the planner read before.

    So every rank receives O(files + nodes x node needs + ranks) bytes, rank 0
    also a length and a record per node, not ranks x the largest inventory as
    ``all_gather_object`` sends (it pads every rank's pickle to the largest: a
    node's merged ranges, files and group descriptions, and the placement).

    Without a group (no node-local level: no files move between nodes) every
    rank's own inventory is all-gathered.
    """
    if group is None:
        return [_inventory(d) for d in _dist.all_gather_object(asdict(inv))]
    members = sorted(members) if inv.rank in members else [inv.rank]
    records = _dist.gather_bytes(_record_at_leader(inv, members, group), 0, group)
    asked = None if records is None else json.dumps(placement_senders(records)).encode()
    senders: dict[str, int] = json.loads(_dist.broadcast_bytes(asked, 0, group))
    placements = _placements_at_root(inv, senders, group)
    joined = None if records is None else join_records(records, placements)
    return expand_records(_dist.broadcast_bytes(joined, 0, group))


def _record_at_leader(inv: Inventory, members: list[int], group: Any) -> bytes:
    """Steps 1 and 2 of :func:`gather_inventories`: this node's record on its lowest
    rank, nothing (``b""``) on the others."""
    receiver = members[0]
    if inv.rank != receiver:
        _send(needs_message(inv), receiver, group)
        return b""
    return node_record(inv, [(rank, _recv(rank, group)) for rank in members[1:]])


def _placements_at_root(
    inv: Inventory, senders: dict[str, int], group: Any
) -> dict[str, list[int]]:
    """Step 3: on rank 0, each asked digest's placement (the asked ranks send theirs)."""
    me, out = _dist.rank(), {}
    for digest, rank in sorted(senders.items(), key=lambda item: item[1]):
        if rank == me == 0:
            out[digest] = inv.placement
        elif rank == me:
            _send(json.dumps(inv.placement).encode(), 0, group)
        elif me == 0:
            out[digest] = json.loads(_recv(rank, group))
    return out


def _send(body: bytes, dst: int, group: Any) -> None:
    _dist.send_bytes(bytearray(_LENGTH.pack(len(body))), dst, group)
    _dist.send_bytes(bytearray(body), dst, group)


def _recv(src: int, group: Any) -> bytes:
    head = bytearray(_LENGTH.size)
    _dist.recv_bytes(head, src, group)
    body = bytearray(_LENGTH.unpack(head)[0])
    _dist.recv_bytes(body, src, group)
    return bytes(body)


def needs_message(inv: Inventory) -> bytes:
    """What a rank sends its node's lowest rank: its needs, ranges and store levels
    (JSON); what its node holds the lowest rank lists itself."""
    return json.dumps([inv.needs, inv.ranges, inv.whole]).encode()


def placement_digest(placement: Sequence[int]) -> str:
    """A short digest naming a placement in a node's record (equal placements, equal
    digests)."""
    return hashlib.blake2b(json.dumps(list(placement)).encode(), digest_size=12).hexdigest()


def node_record(leader: Inventory, messages: Sequence[tuple[int, bytes]]) -> bytes:
    """What a node's lowest rank sends rank 0 (JSON): its inventory (``leader``, as
    taken) with the needs of the node's other ranks merged in (``messages``:
    ``(rank, needs_message)`` each; ``merge_node_needs``) and its placement as
    :func:`placement_digest`, and of each other rank only its rank and store
    levels (its files, parity, groups, placement and parts are the node's: the
    leader's)."""
    node, ranks = [leader], []
    for rank, body in messages:
        needs, ranges, whole = json.loads(body)
        node.append(replace(leader, rank=rank, needs=needs, ranges=ranges, whole=whole))
        ranks.append([rank, whole])
    merged = merge_node_needs(node) if messages else leader
    d = asdict(merged)
    if merged.placement is not None:
        d["placement"] = placement_digest(merged.placement)
    return json.dumps({"inventory": d, "ranks": ranks}).encode()


def placement_senders(records: Sequence[bytes]) -> dict[str, int]:
    """Step 3, on rank 0: placement digest -> the lowest rank whose record names it
    (``records``: every rank's, in rank order; ``b""``: none)."""
    out: dict[str, int] = {}
    for raw in records:
        if raw:
            inv = json.loads(raw)["inventory"]
            if inv["placement"] is not None:
                out.setdefault(inv["placement"], inv["rank"])
    return out


def join_records(records: Sequence[bytes], placements: Mapping[str, list[int]]) -> bytes:
    """What rank 0 broadcasts (JSON): every node's record (``records``, in rank order;
    ``b""``: a rank that sent none), with each group description and placement
    (``placements``: digest -> placement) kept once in ``shared`` and named by index
    (the data and parity nodes of a group all hold its description)."""
    shared: list[Any] = []
    index: dict[str, int] = {}

    def ref(value: Any) -> int:
        i = index.setdefault(json.dumps(value, sort_keys=True), len(shared))
        if i == len(shared):
            shared.append(value)
        return i

    placed = {digest: ref(placement) for digest, placement in placements.items()}
    nodes = []
    for raw in records:
        if not raw:
            continue
        record = json.loads(raw)
        inv = record["inventory"]
        inv["groups"] = {
            level: {g: ref(desc) for g, desc in descs.items()}
            for level, descs in inv["groups"].items()
        }
        if inv["placement"] is not None:
            inv["placement"] = placed[inv["placement"]]
        nodes.append(record)
    return json.dumps({"shared": shared, "nodes": nodes}).encode()


def expand_records(payload: bytes) -> list[Inventory]:
    """Every rank's inventory, in rank order, from what rank 0 broadcast
    (:func:`join_records`): a node's other ranks as their own inventories said,
    after ``merge_node_needs``, they need nothing (``merged``) and hold what the
    node holds. Shared values (descriptions, placement) are one object each: the
    planner only reads them."""
    joined = json.loads(payload)
    shared = joined["shared"]
    out: list[Inventory] = []
    for record in joined["nodes"]:
        d = record["inventory"]
        d["groups"] = {
            level: {g: shared[i] for g, i in descs.items()} for level, descs in d["groups"].items()
        }
        if d["placement"] is not None:
            d["placement"] = shared[d["placement"]]
        leader = _inventory(d)
        out.append(leader)
        out.extend(_member(leader, rank, whole) for rank, whole in record["ranks"])
    out.sort(key=lambda inv: inv.rank)
    return out


@dataclass(frozen=True)
class ExchangeBytes:
    """What one exchange by node (:func:`gather_inventories`) moves, in bytes, length
    words included: for benchmarks and tests (:func:`simulate_exchange`)."""

    to_leader: int  # the most a rank sends its node's lowest rank
    record: int  # the most a node's lowest rank sends rank 0
    at_root: int  # what rank 0 receives: lengths, records, placements
    everyone: int  # what every rank receives: the senders map, the joined records


def simulate_exchange(taken: Sequence[Inventory]) -> tuple[list[Inventory], ExchangeBytes]:
    """:func:`gather_inventories` in one process, from every rank's inventory as taken
    (the ranks of a node: those with its ``node``): what every rank gets, and the
    bytes moved. Pure, the same encodings; for benchmarks and tests."""
    nodes: dict[int, list[Inventory]] = {}
    for inv in sorted(taken, key=lambda i: i.rank):
        nodes.setdefault(inv.node, []).append(inv)
    leaders = {invs[0].rank: invs for invs in nodes.values()}
    to_leader, records = 0, []
    for inv in sorted(taken, key=lambda i: i.rank):
        invs = leaders.get(inv.rank)
        if invs is None:
            records.append(b"")
            continue
        messages = [(m.rank, needs_message(m)) for m in invs[1:]]
        to_leader = max([to_leader, *(_LENGTH.size + len(body) for _, body in messages)])
        records.append(node_record(inv, messages))
    senders = placement_senders(records)
    by_rank = {inv.rank: inv for inv in taken}
    placements = {d: by_rank[r].placement for d, r in senders.items()}
    joined = join_records(records, placements)  # type: ignore[arg-type]
    asked = json.dumps(senders).encode()
    moved = ExchangeBytes(
        to_leader=to_leader,
        record=max(len(r) for r in records),
        at_root=_LENGTH.size * len(records)
        + sum(len(r) for r in records[1:])  # rank 0's own stays there
        + sum(_LENGTH.size + len(json.dumps(p)) for d, p in placements.items() if senders[d]),
        everyone=2 * _LENGTH.size + len(asked) + len(joined),
    )
    return expand_records(joined), moved


def _member(leader: Inventory, rank: int, whole: list[int]) -> Inventory:
    return Inventory(
        rank=rank,
        node=leader.node,
        needs=[],
        ranges={},
        parts=leader.parts,
        files={k: list(v) for k, v in leader.files.items()},
        whole=list(whole),
        parity={k: [list(b) for b in v] for k, v in leader.parity.items()},
        groups={k: dict(v) for k, v in leader.groups.items()},
        placement=leader.placement,
        merged=True,
    )


def _inventory(d: dict[str, Any]) -> Inventory:
    return Inventory(
        rank=d["rank"],
        node=d["node"],
        needs=d["needs"],
        ranges=d["ranges"],
        parts=d["parts"],
        files={int(k): v for k, v in d["files"].items()},
        whole=list(d["whole"]),
        parity={int(k): v for k, v in d["parity"].items()},
        groups={int(k): v for k, v in d["groups"].items()},
        placement=d["placement"],
        merged=d["merged"],
    )


def whole_files_of(
    ranges: dict[str, list[list[int]]] | None, manifest: Manifest
) -> dict[str, list[list[int]]] | None:
    """``ranges`` widened to whole files: a reference is read in its step's directory,
    where a restore brings whole files only (ranges go to a parts copy beside it)."""
    if ranges is None:
        return None
    return {f: [[0, manifest.files[f]]] for f in ranges}
