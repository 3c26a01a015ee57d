"""Where a checkpoint's data files are: at the one location given, or in every node's part.

A level whose path has ``{node}`` in it (``Level("/nvme/{node}/ckpt")``, and
every partner or erasure level) keeps each step on the nodes' own disks: a
node's *part* is its ``step-<N>/`` directory there, holding the data files of
the node's own ranks (and a partner level's copies of other nodes' files). The
manifest is in the first level's part on the coordinator's node only (rank
0's: the coordinator commits there), and in every node's part of a partner or
erasure level (each node's lowest rank commits the node's part).

So a command given one node's directory sees one part: a manifest that names
files it does not hold (node 0), or data files and no manifest (node 1).
Neither is damage. Given the level's path with ``{node}`` in place of the
node's index (``/nvme/{node}/ckpt``), a command sees every node's part: the
nodes are the directories whose names match that path component, each
node's files are checked against the one manifest.

Which rank wrote a file is in its name (``format/layout.py``: ``data/<rank>-...``);
which node a rank was on is recorded by partner and erasure levels
(``placement.json``) and otherwise inferred from where the rank's files are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint import CheckpointRoot, StoredCheckpoint
from ..errors import CheckpointNotFoundError, DcpMultilevelError
from ..format import MANIFEST_NAME, PLACEMENT_NAME, Manifest, rank_of_file
from ..levels.topology import NODE_FIELD, expand_node
from ..stores import parse_location, store_for

__all__ = [
    "EVERY_NODE",
    "Absent",
    "Part",
    "Parts",
    "counted",
    "has_node_field",
    "node_locations",
    "node_roots",
    "not_committed",
    "part_hint",
    "part_ranks",
    "spans",
    "template_url",
]

#: What to do to see every node's part (the end of several messages).
EVERY_NODE = (
    f"pass the level's path with {NODE_FIELD} in place of the node's index to see every node's part"
)


def spans(values: Iterable[int]) -> str:
    """Integers for people, runs joined: ``0-1``, ``2``, ``0, 2, 5-7``."""
    out: list[str] = []
    run: list[int] = []
    for v in sorted(set(values)):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [v]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def counted(word: str, values: Iterable[int]) -> str:
    """``rank 2`` / ``ranks 2-3`` (``node 1`` / ``nodes 0-1``)."""
    values = sorted(set(values))
    return f"{word}{'s' if len(values) != 1 else ''} {spans(values)}"


# --------------------------------------------------------------------------- {node}


def has_node_field(url: str) -> bool:
    """True when ``url`` stands for every node's part (``{node}`` in it)."""
    return NODE_FIELD in url


def template_url(url: str) -> str:
    """``url`` as a URL, ``{node}`` kept (``file:///nvme/{node}/ckpt``): how reports name it."""
    return parse_location(url).url


def _options_for(url: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    # _common.options_for, which imports this module: a local path takes no options.
    return {} if parse_location(url).scheme == "file" else dict(storage_options)


def node_locations(url: str, storage_options: Mapping[str, Any]) -> dict[int, str]:
    """Every node's location for a ``url`` with ``{node}`` in it, by node, ascending.

    The nodes are the entries of the directory above the first path component
    holding ``{node}`` whose names match it with a node's index in its place
    (``/nvme/{node}/ckpt``: ``/nvme/0``, ``/nvme/1``, ...). A node whose
    directory is there but holds nothing below it is a node without a part.

    Raises:
        CheckpointNotFoundError: no entry matches.
    """
    head, _, tail = url.partition(NODE_FIELD)
    parent, slash, before = head.rpartition("/")
    component = f"{before}{NODE_FIELD}{tail.split('/', 1)[0]}"
    listed = parent or ("/" if slash else ".")
    # Node indexes are written as expand_node writes them: no sign, no leading zero.
    pieces = [re.escape(p) for p in component.split(NODE_FIELD)]
    pattern = re.compile(pieces[0] + "(?P<node>0|[1-9][0-9]*)" + "(?P=node)".join(pieces[1:]))
    store = store_for(listed, **_options_for(listed, storage_options))
    nodes = sorted(
        int(m["node"]) for name in store.listdir("") if (m := pattern.fullmatch(name)) is not None
    )
    if not nodes:
        raise CheckpointNotFoundError(
            f"no node's part at {template_url(url)}: nothing in {store.url} is named "
            f"{component!r} with a node's index in place of {NODE_FIELD} (0, 1, ...); check "
            "the path",
            checkpoint=template_url(url),
        )
    return {n: expand_node(url, n) for n in nodes}


def node_roots(url: str, storage_options: Mapping[str, Any]) -> dict[int, CheckpointRoot]:
    """Every node's root for a level path with ``{node}`` in it (see :func:`node_locations`)."""
    return {
        n: CheckpointRoot(loc, _options_for(loc, storage_options))
        for n, loc in node_locations(url, storage_options).items()
    }


# --------------------------------------------------------------------------- a part alone


def part_ranks(ckpt: StoredCheckpoint) -> tuple[int, ...] | None:
    """For a step directory without a manifest: the ranks whose data files it holds, when
    it looks like one node's part of a first level (none is rank 0's: the coordinator
    commits on its own node, so rank 0's part would hold the manifest); else None
    (nothing there, rank 0's files there, or a partner or erasure level's sidecar:
    those levels commit every node's part, so a part without a manifest did not finish).
    """
    if ckpt.store.exists(PLACEMENT_NAME):
        return None
    ranks = {rank_of_file(f) for f in ckpt.data_files()}
    if not ranks or None in ranks or 0 in ranks:
        return None
    return tuple(sorted(r for r in ranks if r is not None))


def part_hint(ckpt: StoredCheckpoint, subject: str = "it") -> str | None:
    """What a step directory without a manifest is, when it is one node's part (see
    :func:`part_ranks`): a clause for a "no committed checkpoint" message, about
    ``subject`` (the directory). None otherwise."""
    ranks = part_ranks(ckpt)
    if ranks is None:
        return None
    return (
        f"{subject} holds the data files of {counted('rank', ranks)} only: one node's part of a "
        f"checkpoint on a level with {NODE_FIELD} in its path, whose manifest the coordinator "
        f"(rank 0) writes on its own node. Look there, or {EVERY_NODE}"
    )


def not_committed(ckpt: StoredCheckpoint) -> CheckpointNotFoundError:
    """The error for a location without a manifest; it says when that is one node's part."""
    hint = part_hint(ckpt)
    why = (
        f": it has no {MANIFEST_NAME}; {hint}"
        if hint is not None
        else f" (no {MANIFEST_NAME}: not a checkpoint, or a save that did not finish)"
    )
    return CheckpointNotFoundError(
        f"no committed checkpoint at {ckpt.url}{why}", checkpoint=ckpt.url
    )


# --------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class Part:
    """What one location holds of a checkpoint.

    Attributes:
        node: the node's index; None for a location given without ``{node}``.
        ckpt: the checkpoint's directory there, read with the one manifest.
        files: the data files there (one listing), the manifest's or not.
        committed: whether a manifest of this save is there.
        other_save: the save id of another save committed there (its files are
            not this checkpoint's); None when there is none.
    """

    node: int | None
    ckpt: StoredCheckpoint
    files: frozenset[str]
    committed: bool
    other_save: str | None = None


@dataclass(frozen=True)
class Absent:
    """Data files of the checkpoint that are not at the location given (not checked).

    ``node`` is the node their ranks were on, when a placement records it.
    """

    ranks: tuple[int, ...]
    node: int | None
    files: tuple[str, ...]
    items: int

    def describe(self) -> str:
        """One line for people: whose files these are and where they are."""
        counts = f"{len(self.files)} data file(s), {self.items} item(s)"
        if self.node is not None:
            return (
                f"node {self.node}'s files ({counted('rank', self.ranks)}; {counts}) are on "
                f"node {self.node}, not here"
            )
        return (
            f"the files of {counted('rank', self.ranks)} ({counts}) are not on this disk: on a "
            f"level with {NODE_FIELD} in its path they are on their ranks' node ({EVERY_NODE}); "
            "on any other level they are lost"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON shape (``verify --json``'s ``elsewhere``, ``inspect --json``'s)."""
        return {
            "node": self.node,
            "ranks": list(self.ranks),
            "files": list(self.files),
            "items": self.items,
        }


class Parts:
    """One committed checkpoint and where each of its data files is.

    Made by :meth:`at`: for a location with ``{node}`` in it, every node's part
    (the manifest read from the lowest node that holds it); otherwise the one
    location given. Answers, per data file, which parts hold it
    (:meth:`holders`), whether its absence is damage (:meth:`missing`), and
    which files are simply elsewhere (:meth:`absent`: only for a location
    given without ``{node}``).
    """

    def __init__(
        self, url: str, manifest: Manifest, parts: list[Part], placement: tuple[int, ...] | None
    ) -> None:
        self.url = url
        self.manifest = manifest
        self.parts = parts
        #: The node of each rank of the save, as a partner or erasure level records it.
        self.placement = placement
        self.expanded = any(p.node is not None for p in parts)
        self._by_rank: dict[int | None, set[str]] = {}
        for f in manifest.files:
            self._by_rank.setdefault(rank_of_file(f), set()).add(f)
        self._items: dict[str, int] = {}
        for loc in manifest.locations.values():
            self._items[loc.file] = self._items.get(loc.file, 0) + 1
        # At one location: the nodes (with a placement) or ranks whose files are there.
        self._here = (
            set()
            if self.expanded
            else {self._group(rank_of_file(f)) for f in parts[0].files & set(manifest.files)}
        )

    # ------------------------------------------------------------------ opening

    @classmethod
    def at(cls, url: str, storage_options: Mapping[str, Any]) -> Parts:
        """The committed checkpoint at ``url`` (with ``{node}``: at every node), its
        manifest read and validated, each part's data files listed.

        Raises:
            CheckpointNotFoundError: no manifest there (with ``{node}``: on no node);
                the message says when the location is one node's part.
            ManifestError: the manifest is invalid.
        """
        if not has_node_field(url):
            ckpt = StoredCheckpoint.at(url, _options_for(url, storage_options))
            if not ckpt.is_committed():
                raise not_committed(ckpt)
            manifest = ckpt.manifest()
            part = Part(None, ckpt, frozenset(ckpt.data_files()), True)
            return cls(ckpt.url, manifest, [part], _placement([ckpt], manifest))
        return cls._at_nodes(url, storage_options)

    @classmethod
    def _at_nodes(cls, url: str, storage_options: Mapping[str, Any]) -> Parts:
        locations = node_locations(url, storage_options)
        here = {
            n: StoredCheckpoint.at(loc, _options_for(loc, storage_options))
            for n, loc in locations.items()
        }
        committed = [n for n, ckpt in here.items() if ckpt.is_committed()]
        if not committed:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {template_url(url)}: no node's part holds a "
                f"{MANIFEST_NAME} ({counted('node', locations)} looked at; a save that did not "
                "finish leaves none)",
                checkpoint=template_url(url),
            )
        raw = here[committed[0]].manifest_bytes()
        manifest = here[committed[0]].manifest()
        parts = []
        for n, loc in locations.items():
            other = None
            if n in committed and n != committed[0]:
                mine = here[n].manifest_bytes()
                if mine != raw:
                    try:
                        save_id = here[n].manifest().save_id
                    except DcpMultilevelError as e:
                        save_id = f"unreadable: {e}"
                    other = None if save_id == manifest.save_id else save_id
            # Every part reads the one manifest: a node without one is still checked.
            ckpt = StoredCheckpoint.at(loc, _options_for(loc, storage_options), manifest_bytes=raw)
            files = frozenset() if other is not None else frozenset(here[n].data_files())
            parts.append(Part(n, ckpt, files, n in committed and other is None, other))
        return cls(template_url(url), manifest, parts, _placement(list(here.values()), manifest))

    # ------------------------------------------------------------------ where files are

    def nodes_json(self) -> list[dict[str, Any]]:
        """Each node's part as JSON (``verify --json``'s and ``inspect --json``'s ``nodes``):
        its location, whether it holds the manifest, how many of the data files, and the
        save id of another save committed there (None: none)."""
        files = set(self.manifest.files)
        return [
            {
                "node": p.node,
                "url": p.ckpt.url,
                "manifest": p.committed,
                "files": len(p.files & files),
                "other_save": p.other_save,
            }
            for p in self.parts
        ]

    def holders(self, file: str) -> list[Part]:
        """The parts that hold data file ``file``."""
        return [p for p in self.parts if file in p.files]

    def items_in(self, file: str) -> int:
        """How many stored items data file ``file`` holds."""
        return self._items.get(file, 0)

    def node_of(self, rank: int | None) -> int | None:
        """The node ``rank`` was on, when a placement records it."""
        if rank is None or self.placement is None or rank >= len(self.placement):
            return None
        return self.placement[rank]

    def expected_node(self, file: str) -> int | None:
        """The node whose part should hold ``file`` (with ``{node}``): its rank's, from the
        placement, or the one node that holds its rank's other files; else None."""
        if not self.expanded:
            return None
        rank = rank_of_file(file)
        node = self.node_of(rank)
        if node is not None:
            return node
        others = self.nodes_with_files_of(rank)
        return others[0] if len(others) == 1 else None

    def nodes_with_files_of(self, rank: int | None) -> list[int]:
        """The nodes whose part holds some data file of ``rank`` (with ``{node}``)."""
        mine = self._by_rank.get(rank, set())
        return [p.node for p in self.parts if p.node is not None and mine & p.files]

    def _group(self, rank: int | None) -> int | None:
        """Files stored together: a node's (from the placement), else a rank's."""
        node = self.node_of(rank)
        return rank if node is None else node

    def missing(self, file: str) -> bool:
        """True when ``file``'s absence from the part that should hold it is damage.

        With ``{node}``: the file is missing on its rank's node (from the
        placement), or, with no placement, on every node. At one location: its
        rank's other files (with a placement: its node's) are there, or no file
        of the checkpoint is (nothing there is a part of another node's).
        """
        rank = rank_of_file(file)
        if self.expanded:
            node = self.node_of(rank)
            if node is not None:
                return not any(p.node == node and file in p.files for p in self.parts)
            return not self.holders(file)
        if self.holders(file):
            return False
        return rank is None or not self._here or self._group(rank) in self._here

    def absent(self) -> list[Absent]:
        """At one location: the data files that are not there and whose absence is no
        damage (every file of their rank, or node, is elsewhere), by node or ranks."""
        if self.expanded:
            return []
        groups: dict[int | None, list[str]] = {}
        for f in sorted(self.manifest.files):
            if not self.holders(f) and not self.missing(f):
                groups.setdefault(self.node_of(rank_of_file(f)), []).append(f)
        out = []
        for node, files in sorted(groups.items(), key=lambda g: (g[0] is None, g[0] or 0)):
            ranks = tuple(sorted({r for f in files if (r := rank_of_file(f)) is not None}))
            out.append(Absent(ranks, node, tuple(files), sum(self.items_in(f) for f in files)))
        return out

    def missing_message(self, file: str, fqn: str) -> str:
        """Why data file ``file`` counts as missing, naming the item ``fqn`` it holds."""
        needed = f"needed for {fqn!r}"
        if not self.expanded:
            return (
                f"data file {file!r} of checkpoint {self.url} is missing ({needed}); the "
                "checkpoint is damaged"
            )
        rank = rank_of_file(file)
        whose = f"data file {file!r} (rank {rank}'s)" if rank is not None else f"data file {file!r}"
        node = self.node_of(rank)
        if node is not None:
            copies = [p.node for p in self.holders(file) if p.node is not None]
            also = f"; a copy is on {counted('node', copies)}" if copies else ""
            return (
                f"{whose} of checkpoint {self.url} is missing on node {node}, which rank "
                f"{rank} was on ({needed}{also}); node {node}'s part is damaged"
            )
        looked = counted("node", [p.node for p in self.parts if p.node is not None])
        others = self.nodes_with_files_of(rank) if rank is not None else []
        if others:
            where = f"{counted('node', others)} hold(s) rank {rank}'s other files"
        elif rank is not None:
            where = f"no node holds any file of rank {rank}"
        else:
            where = "no node holds it"
        return (
            f"{whose} of checkpoint {self.url} is on no node's disk ({looked} looked at; "
            f"{where}; {needed}); the checkpoint is damaged"
        )


def _placement(ckpts: list[StoredCheckpoint], manifest: Manifest) -> tuple[int, ...] | None:
    """The node of each rank, from the first ``placement.json`` among ``ckpts`` that
    reads as one for this save's world size (partner and erasure levels write one)."""
    for ckpt in ckpts:
        try:
            nodes = json.loads(ckpt.store.read_bytes(PLACEMENT_NAME))["nodes"]
        except (OSError, ValueError, KeyError, TypeError):
            # None there (a first level), or unreadable: where the files are still says.
            continue
        if (
            isinstance(nodes, list)
            and len(nodes) == manifest.world_size
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nodes)
        ):
            return tuple(nodes)
    return None
