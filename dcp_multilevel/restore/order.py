"""The order of a restore's transfers: every rank busy, each copy from a source free to send it.

Every rank carries out its own actions in list order and waits only on its
partners (blocking sends), so actions that share no rank overlap, and any
one total order cannot deadlock (the earliest unfinished action always has
all of its ranks waiting on it). :class:`TransferOrder` simulates those
transfers, a byte per time unit: links and rebuilds first (their ranks are
fixed; a rebuilt member can be forwarded once it ends), then copies, event
by event. Whenever ranks fall idle, the node with the most bytes still to
receive first (its receives are the longest chain), each idle rank of that
node takes one of the node's next :data:`LOOKAHEAD` copies that an idle
source can send now: any rank of the node receives a whole file (it lands
in the node's first level, which all of them read), so a node's ranks
receive side by side; byte ranges go to the plan's receiving rank (a
node's parts copy has one writer). A source is a node holding the file
intact, or the *receiving rank* of a node an earlier copy or rebuild
brought it to (forwarded: with replicated state every node needs every
file, and a file's one holder need not send it to every other node). The
copy taken is the file on the fewest nodes so far (rarest first: it spreads
what later copies forward), then from the lowest level, a copy held before
the restore, the lowest rank. The list is then sorted by start (stable: the
same on every rank). A forwarded copy starts after the action that brings
the file ends, on the same rank, so that rank holds it by then.

Pure: no I/O, no torch.distributed. Call order::

    ordered = TransferOrder(files, inventories, held, bad).order(actions)   once per plan
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import replace

from .actions import Copy, CopyFault, Fault, Inventory, Link, Rebuild, participants

__all__ = ["LOOKAHEAD", "TransferOrder"]

#: Copies of one receiving node weighed at a time.
LOOKAHEAD = 8

Action = Link | Copy | Rebuild


class TransferOrder:
    """Orders one plan's actions (see the module docstring); use each instance once.

    Args:
        files: every file's size in bytes.
        inventories: every rank's inventory (which node each rank is on).
        held: file -> the intact copies the nodes hold before the restore, as
            sorted ``(level, rank, node)`` (``plan.py``'s ``_holders``).
        bad: sources found damaged in an earlier round.
    """

    def __init__(
        self,
        files: dict[str, int],
        inventories: Sequence[Inventory],
        held: dict[str, list[tuple[int, int, int]]],
        bad: Collection[Fault] = frozenset(),
    ) -> None:
        self.files = files
        self.held = held
        self.bad = bad
        self.nodes = {inv.rank: inv.node for inv in inventories}  # rank -> node
        self.ranks_of: dict[int, list[int]] = {}  # node -> its ranks
        for inv in sorted(inventories, key=lambda i: i.rank):
            self.ranks_of.setdefault(inv.node, []).append(inv.rank)
        # The simulation's clock and what it has placed.
        self.now = 0
        self.free: dict[int, int] = {}  # rank -> when its last action ends
        self.starts: list[int] = []
        self.placed: list[Action] = []
        self.ends: list[int] = []  # a heap of the times a transfer ends (the events)
        self.ending: dict[int, set[int]] = {}  # time -> ranks whose last transfer ends then
        # What is left to place, and who can send what from when.
        self.copies: dict[int, list[Copy]] = {}  # receiving node -> its copies, plan order
        self.left: dict[int, int] = {}  # receiving node -> bytes still to receive
        self.forwards: dict[str, list[tuple[int, int, int]]] = {}  # file -> [(ready, rank, node)]
        self.holding: dict[str, int] = {}  # file -> nodes holding it before the restore
        self.can_send: dict[int, set[str]] = {}  # rank -> files it holds or forwards
        self.ready: dict[int, set[str]] = {}  # time -> files forwardable from then on
        self.ready_at: list[int] = []  # a heap of ready's times
        # Only nodes whose options may have changed are scanned at an event: those
        # with a rank that fell idle (``rescan``), and those waiting (idle ranks, no
        # source) on a file that a rank that fell idle can send or that became
        # forwardable (``woken``; scanned only while one of those ranks is still
        # idle when its turn comes). The others would find what they found before
        # (nothing): the order is the one a scan of every node makes.
        self.waiting: dict[str, set[int]] = {}  # file -> nodes that found no source for it
        self.rescan: set[int] = set()
        self.woken: set[int] = set()
        self.fresh: set[int] = set()  # the ranks that woke nodes at this event

    def order(self, actions: Sequence[Action]) -> list[Action]:
        """``actions`` in one total order (see the module docstring)."""
        self._place_fixed(actions)
        self._index()
        while any(self.copies.values()):
            self._assign_idle_ranks()
            if not any(self.copies.values()):
                break  # the last ones were empty files: no transfer ends to wait for
            if self._next_event():
                continue
            # Nothing busy and nothing sendable (the plan's own source is always among
            # the candidates, so this does not happen): the plan's choice, at the end.
            node = next(n for n, cs in self.copies.items() if cs)
            first = self.copies[node][0]
            self._send(node, 0, first.dst, first.level, first.src)
            self.rescan = {n for n, cs in self.copies.items() if cs}
        order = sorted(range(len(self.placed)), key=lambda i: (self.starts[i], i))
        return [self.placed[i] for i in order]

    # ------------------------------------------------------------------ steps

    def _place(self, action: Action, start: int, length: int) -> None:
        if length:
            end = start + length
            for r in participants(action):
                self.free[r] = end
            if end not in self.ending:
                heapq.heappush(self.ends, end)
            self.ending.setdefault(end, set()).update(participants(action))
        self.starts.append(start)
        self.placed.append(action)

    def _place_fixed(self, actions: Sequence[Action]) -> None:
        """Links and rebuilds where they must run; copies grouped by receiving node."""
        for action in actions:
            if isinstance(action, Copy):
                self.copies.setdefault(self.nodes[action.dst], []).append(action)
            elif isinstance(action, Link):
                self._place(action, 0, 0)  # no transfer: the file is on the node already
            else:
                members = max(1, len(action.members))
                length = (
                    sum(self.files.get(f, 0) for f in action.brings)
                    // members
                    * sum(1 for _, r in action.sources if r != action.dst)
                )
                start = max(self.free.get(r, 0) for r in participants(action))
                self._place(action, start, length)
                for f in action.brings:
                    entry = (start + length, action.dst, self.nodes[action.dst])
                    self.forwards.setdefault(f, []).append(entry)

    def _index(self) -> None:
        """What each node still receives, who holds and forwards what, from when."""
        self.left = {node: sum(map(self._length, cs)) for node, cs in self.copies.items()}
        self.holding = {f: len({node for _, _, node in hs}) for f, hs in self.held.items()}
        for f, hs in self.held.items():
            for _, rank, _ in hs:
                self.can_send.setdefault(rank, set()).add(f)
        for f, entries in self.forwards.items():
            for at, rank, _ in entries:
                self.can_send.setdefault(rank, set()).add(f)
                self._ready_when(at, f)
        self.rescan = {n for n, cs in self.copies.items() if cs}

    def _assign_idle_ranks(self) -> None:
        """At ``now``: each idle rank of each node to scan takes the best copy it can."""
        scan, self.rescan = self.rescan, set()
        wake, self.woken = self.woken, set()
        order = sorted(
            (n for n in scan | wake if self.copies.get(n)), key=lambda n: (-self.left[n], n)
        )
        for node in order:
            if node not in scan and not any(self.free.get(r, 0) <= self.now for r in self.fresh):
                # Nodes before it took what woke it: it waits on as it did.
                for copy in self.copies[node][:LOOKAHEAD]:
                    self.waiting.setdefault(copy.file, set()).add(node)
                continue
            self._assign_node(node)

    def _assign_node(self, node: int) -> None:
        for dst in self.ranks_of[node]:
            if self.free.get(dst, 0) > self.now or not self.copies[node]:
                continue  # busy (or became a source in this pass)
            ahead = self.copies[node][:LOOKAHEAD]
            # The least (spread, level, forwarded, rank, i) over every copy's
            # sources; spread first, so a rarer copy with a source ends the search.
            rarest = sorted(
                (self.holding.get(copy.file, 0) + len(self.forwards.get(copy.file, ())), i)
                for i, copy in enumerate(ahead)
                if dst in self._receivers(node, copy)
            )
            best = None
            for spread, i in rarest:
                if best is not None and spread > best[0]:
                    break
                source = self._best_source(ahead[i])
                if source is not None and (best is None or (spread, *source, i) < best):
                    best = (spread, *source, i)
            if best is not None:
                _, level, _, src, i = best
                self._send(node, i, dst, level, src)
                continue
            for copy in ahead:
                self.waiting.setdefault(copy.file, set()).add(node)
            if all(copy.ranges is None for copy in ahead):
                break  # the node's other idle ranks would find no source either

    def _next_event(self) -> bool:
        """Move ``now`` to the next time a rank falls idle; False when none will."""
        self.fresh = set()
        at = self.now
        while self.ends and not self.fresh:  # the next time a rank's last transfer ends
            at = heapq.heappop(self.ends)
            self.fresh = {r for r in self.ending.pop(at) if self.free[r] == at}
        if not self.fresh:
            return False
        self.now = at
        for rank in self.fresh:
            self.rescan.add(self.nodes[rank])
            for f in self.can_send.get(rank, ()):
                self.woken.update(self.waiting.pop(f, ()))
        while self.ready_at and self.ready_at[0] <= self.now:  # (a rebuild may end between)
            for f in self.ready.pop(heapq.heappop(self.ready_at)):
                self.woken.update(self.waiting.pop(f, ()))
                self.fresh.update(rank for at, rank, _ in self.forwards[f] if at <= self.now)
        return True

    def _send(self, node: int, i: int, dst: int, level: int, src: int) -> None:
        copy = replace(self.copies[node].pop(i), dst=dst, level=level, src=src)
        length = self._length(copy)
        self._place(copy, self.now, length)
        if copy.ranges is None:
            self.forwards.setdefault(copy.file, []).append((self.now + length, dst, node))
            self.can_send.setdefault(dst, set()).add(copy.file)
            self._ready_when(self.now + length, copy.file)
        if not length:  # an empty file: both ranks stay idle, the file is forwardable now
            self.rescan.add(node)
            self.rescan.update(self.waiting.pop(copy.file, ()))
            self.fresh.add(dst)  # woken nodes later in this pass may take it from there
        self.left[node] -= length

    # ------------------------------------------------------------------ lookups

    def _length(self, copy: Copy) -> int:
        if copy.ranges is None:
            return self.files.get(copy.file, 0)
        return sum(b - a for a, b in copy.ranges)

    def _best_source(self, copy: Copy) -> tuple[int, int, int] | None:
        """The least ``(level, forwarded, rank)`` of the sources that can send ``copy``
        now (None: none can)."""
        here = self.nodes.get(copy.dst)
        now = self.now
        best = None
        for level, rank, node in self.held.get(copy.file, ()):
            if node != here and self.free.get(rank, 0) <= now:
                option = (level, 0, rank)
                if best is None or option < best:
                    best = option
        for ready, rank, node in self.forwards.get(copy.file, ()):
            if (
                ready <= now
                and node != here
                and self.free.get(rank, 0) <= now
                and not (self.bad and CopyFault(node, copy.file) in self.bad)
            ):
                option = (0, 1, rank)
                if best is None or option < best:
                    best = option
        return best

    def _receivers(self, node: int, copy: Copy) -> list[int]:
        """The ranks that may receive ``copy`` on its node: any for a whole file (it
        lands in the node's first level, where all of them read), the plan's one
        for byte ranges (each node's parts copy has one writer)."""
        return self.ranks_of[node] if copy.ranges is None else [copy.dst]

    def _ready_when(self, at: int, file: str) -> None:
        if at not in self.ready:
            heapq.heappush(self.ready_at, at)
        self.ready.setdefault(at, set()).add(file)
