"""How the ranks of one drain agree, from background threads: the c10d store protocol.

A drain runs in a background thread on every rank. Background threads never
use the trainer's process group (a collective issued there can interleave
with the trainer's own and deadlock), so ranks exchange small JSON values
through the c10d store instead, under keys unique to the drain
(``dcp_multilevel/drain/<drain id>/<what>``). Large data never goes
through the store.

Call order for one drain (``link = DrainLink(drain_id, timeout_s)``)::

    every rank    link.share_manifest(read)   rank 0 reads and publishes the
                                              source manifest, the others take it
    rank != 0     link.send(value)            e.g. the item locations it wrote
    rank 0        link.gather()               every other rank's value, in rank order
    rank 0        link.announce_commit()      after its commit on the level
    rank != 0     link.wait_commit()          returns once rank 0 committed
    any rank      link.put(name, value)       a named value for any rank (e.g.
                  link.get(names)             parity checksums)
    every rank    link.done()                 this rank's part is done
    node's lowest link.wait_all_done(nodes)   every rank's is (by node: R + 2N gets)
    any rank      link.fail(error)            on any failure: no rank waits out
                                              the timeout for a peer that failed

With one rank (or no process group) nothing is exchanged.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

from .. import _dist
from ..errors import DrainError

__all__ = ["DrainLink"]


class DrainLink:
    """The ranks of one drain, talking through the c10d store (see the module docstring)."""

    def __init__(self, drain_id: str, timeout_s: float) -> None:
        self.drain_id = drain_id
        self.timeout_s = timeout_s
        self.rank = _dist.rank()
        self.world_size = _dist.world_size()

    def _key(self, what: int | str) -> str:
        return f"dcp_multilevel/drain/{self.drain_id}/{what}"

    def _wait(self, keys: list[str]) -> list[Any]:
        return _dist.store_wait_get(keys, self.timeout_s)

    def share_manifest(self, read: Callable[[], bytes], source: str) -> bytes:
        """The source manifest's bytes as rank 0 reads them with ``read()``, on every rank.

        With a node-local first level only rank 0's node holds the manifest
        (every node holds its own ranks' data files); on a shared one, all
        ranks then still copy by the very same manifest.

        Raises:
            DrainError: rank 0 could not read it (names ``source``).
        """
        key = self._key("manifest")
        if self.world_size == 1:
            return read()
        if self.rank == 0:
            try:
                raw = read()
            except Exception as e:
                _dist.store_set(key, {"error": f"{type(e).__name__}: {e}"})
                raise
            _dist.store_set(key, {"manifest": base64.b64encode(raw).decode("ascii")})
            return raw
        (value,) = self._wait([key])
        if "error" in value:
            raise DrainError(f"rank 0 could not read the manifest of {source}: {value['error']}")
        return base64.b64decode(value["manifest"])

    def send(self, value: Any) -> None:
        """Publish this rank's JSON-able ``value`` for rank 0 (ranks other than 0)."""
        _dist.store_set(self._key(self.rank), {"value": value})

    def gather(self) -> list[Any]:
        """Every other rank's sent value, ranks 1..n-1 in order (rank 0).

        Raises:
            DrainError: a rank reported a failure instead (names the rank).
        """
        if self.world_size == 1:
            return []
        others = self._wait([self._key(r) for r in range(1, self.world_size)])
        for r, value in enumerate(others, start=1):
            if "error" in value:
                raise DrainError(f"rank {r} failed: {value['error']}")
        return [value["value"] for value in others]

    def announce_commit(self) -> None:
        """Rank 0 committed the drain on its level: the other ranks' drains may end."""
        if self.world_size > 1:
            _dist.store_set(self._key("commit"), {"ok": True})

    def wait_commit(self) -> None:
        """Block until rank 0 committed (ranks other than 0).

        Raises:
            DrainError: rank 0 could not commit (its error in the message).
        """
        (outcome,) = self._wait([self._key("commit")])
        if "error" in outcome:
            raise DrainError(f"rank 0 could not commit: {outcome['error']}")

    def put(self, name: str, value: Any) -> None:
        """Publish a JSON-able ``value`` under ``name`` for any rank of this drain."""
        if self.world_size > 1:
            _dist.store_set(self._key(f"named/{name}"), {"value": value})

    def get(self, names: list[str]) -> list[Any]:
        """The values published under ``names`` (waits for each).

        Raises:
            DrainError: the rank that was to publish one failed instead.
        """
        values = self._wait([self._key(f"named/{n}") for n in names])
        for name, value in zip(names, values, strict=True):
            if "error" in value:
                raise DrainError(f"{name}: {value['error']}")
        return [value["value"] for value in values]

    def done(self) -> None:
        """This rank's part of the drain is done (see :meth:`wait_done`)."""
        self.put(f"done/{self.rank}", True)

    def wait_done(self, ranks: list[int]) -> None:
        """Block until every rank in ``ranks`` called :meth:`done` (or raise its failure)."""
        self.get([f"done/{r}" for r in ranks if r != self.rank])

    def wait_all_done(self, nodes: Sequence[int]) -> None:
        """Block until every rank called :meth:`done` (or raise the first failure seen);
        called by each node's lowest rank (``nodes``: each rank's node).

        By node, so the store serves ``R + 2N`` gets, not ``N x R`` (every node's
        lowest rank waiting on every rank's key): each waits on its node's ranks
        and publishes ``node-done/<rank>``; rank 0 (the lowest of its node) waits
        on those and publishes ``all-done``, which the others wait on. A failure
        travels the same way (:meth:`fail` publishes it under all three names).
        """
        if self.world_size == 1:
            return
        mine = nodes[self.rank]
        self.wait_done([r for r, n in enumerate(nodes) if n == mine])
        self.put(f"node-done/{self.rank}", True)
        if self.rank != 0:
            self.get(["all-done"])
            return
        leaders: dict[int, int] = {}
        for r, n in enumerate(nodes):
            leaders.setdefault(n, r)
        self.get([f"node-done/{r}" for r in sorted(leaders.values()) if r != 0])
        self.put("all-done", True)

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks this rank's part of the drain failed with ``error``."""
        if self.world_size > 1:
            why = f"{type(error).__name__}: {error}"
            _dist.store_set(self._key("commit" if self.rank == 0 else self.rank), {"error": why})
            done = {"error": f"rank {self.rank} failed: {why}"}
            _dist.store_set(self._key(f"named/done/{self.rank}"), done)
            # (Only a node's lowest rank's is waited on; rank 0's all-done, by all of those.)
            _dist.store_set(self._key(f"named/node-done/{self.rank}"), done)
            if self.rank == 0:
                _dist.store_set(self._key("named/all-done"), done)
