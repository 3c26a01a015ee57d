"""Reed-Solomon over a group of byte strings of different sizes (zfec), chunk by chunk.

An erasure-coded level keeps, for a group of ``data`` nodes, ``parity``
parity blocks on further nodes: any ``data`` of the ``data + parity`` blocks
rebuild the rest, so the group survives any ``parity`` node losses at a
storage overhead of ``(data + parity) / data``. This module is the code alone
(pure: no I/O, no torch.distributed).

The group's members (one per data node: its files for one checkpoint, back
to back) differ in size. Each is padded with zeros to the group's *stripe
length* (the largest member's size, rounded up to a whole :data:`CHUNK`) and
the sizes are kept, so a rebuilt member is cut back to its exact size and
never loses its tail. Coding runs :data:`CHUNK` bytes at a time, so memory
stays at ``data + parity`` chunks whatever the members' sizes, and every
parity chunk carries its own xxh3 checksum, so a damaged parity chunk is
named and not used.

Which coder (:attr:`ErasureCode.coder`; ``benchmarks/bench_erasure.py``
measures them): with one parity block the code is plain XOR (numpy, whole
words at a time: several times faster than zfec's general code on the same
bytes; the parity a ``ReduceOp.BXOR`` would compute); with two or more,
zfec, a maintained C implementation of Rizzo's Reed-Solomon (Vandermonde
over GF(2^8)), faster than GF(2^8) arithmetic written with numpy (a table
lookup per coefficient and byte).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zfec

from ..errors import ConfigError, CorruptCheckpointError
from ..format import checksum_of

__all__ = ["CHUNK", "ErasureCode", "ParityChunk", "stripe_length"]

#: Bytes of each member coded at once (and the unit of parity checksums).
CHUNK = 4 << 20


def stripe_length(sizes: Sequence[int], chunk: int = CHUNK) -> int:
    """The padded length every member of a group is coded at (whole chunks)."""
    longest = max(sizes, default=0)
    return -(-longest // chunk) * chunk


@dataclass(frozen=True)
class ParityChunk:
    """One chunk of one parity block, with the checksum that vouches for it."""

    index: int  # chunk number within the stripe
    data: bytes | bytearray
    checksum: str


class ErasureCode:
    """RS(``data`` + ``parity``) over members of any sizes, ``chunk`` bytes at a time.

    Blocks are numbered as zfec numbers them: ``0 .. data-1`` are the members
    themselves, ``data .. data+parity-1`` the parity blocks.

    Raises:
        ConfigError: ``data`` < 1, ``parity`` < 1, or more than 256 blocks in
            all (GF(2^8) has no more distinct evaluation points).
    """

    def __init__(self, data: int, parity: int, chunk: int = CHUNK) -> None:
        if not isinstance(data, int) or data < 1:
            raise ConfigError(f"erasure data must be an integer >= 1, got {data!r}")
        if not isinstance(parity, int) or parity < 1:
            raise ConfigError(f"erasure parity must be an integer >= 1, got {parity!r}")
        if data + parity > 256:
            raise ConfigError(
                f"erasure data + parity must be at most 256 (GF(2^8)), got {data} + {parity}"
            )
        if chunk < 1:
            raise ConfigError(f"erasure chunk must be >= 1 byte, got {chunk!r}")
        self.data = data
        self.parity = parity
        self.chunk = chunk
        #: "xor" (one parity block) or "zfec"; a level records it beside its parity.
        self.coder = "xor" if parity == 1 else "zfec"
        self._encoder = zfec.Encoder(data, data + parity)
        self._decoder = zfec.Decoder(data, data + parity)

    @property
    def overhead(self) -> float:
        """Bytes stored per byte of data: ``(data + parity) / data`` (before padding)."""
        return (self.data + self.parity) / self.data

    def encode(self, members: Sequence[memoryview | bytes]) -> Iterator[list[ParityChunk]]:
        """The parity of ``members`` (exactly ``data`` of them), one chunk index at a time.

        Yields, for each chunk index of the stripe, ``parity`` :class:`ParityChunk`
        (one per parity block, in block order). Members shorter than the stripe
        are padded with zeros.
        """
        if len(members) != self.data:
            raise ConfigError(f"erasure encode needs {self.data} members, got {len(members)}")
        views = [memoryview(m).cast("B") for m in members]
        length = stripe_length([len(v) for v in views], self.chunk)
        for index, start in enumerate(range(0, length, self.chunk)):
            parity = self.encode_chunk([self._piece(v, start) for v in views])
            yield [ParityChunk(index, p, checksum_of(p)) for p in parity]

    def encode_chunk(self, pieces: Sequence[memoryview | bytes]) -> list[bytes | bytearray]:
        """The ``parity`` parity pieces of one chunk index (``data`` whole-chunk pieces)."""
        if self.coder == "xor":
            return [_xor(pieces)]
        wanted = tuple(range(self.data, self.data + self.parity))
        return [bytes(p) for p in self._encoder.encode(tuple(pieces), wanted)]

    def decode_chunk(
        self, pieces: Sequence[memoryview | bytes], blocks: Sequence[int]
    ) -> list[bytes | bytearray | memoryview]:
        """The ``data`` member pieces of one chunk index, from any ``data`` pieces of
        blocks ``blocks`` (whole chunks; the caller vouches for their bytes)."""
        if len(pieces) != self.data or len(set(blocks)) != self.data:
            raise ConfigError(
                f"erasure decode needs {self.data} distinct blocks, got {list(blocks)}"
            )
        if self.coder == "xor":
            given = dict(zip(blocks, pieces, strict=True))
            lost = [i for i in range(self.data) if i not in given]
            if lost:  # the one lost member is the XOR of every other block
                given[lost[0]] = _xor(pieces)
            return [given[i] for i in range(self.data)]
        # No copy: zfec hands back the surviving members' own buffers (views the
        # caller owns) and new bytes for the rebuilt ones; copying them would
        # touch every byte again, about what the decode itself costs.
        return list(self._decoder.decode(tuple(pieces), tuple(blocks)))

    def rebuild(
        self,
        sizes: Sequence[int],
        members: Mapping[int, memoryview | bytes],
        parity: Mapping[int, Sequence[ParityChunk]],
        *,
        checkpoint: str = "",
    ) -> dict[int, bytes]:
        """The missing members, rebuilt from any ``data`` surviving blocks.

        Args:
            sizes: every member's true size (from the level's manifest).
            members: the surviving members, by block number (``0 .. data-1``).
            parity: the surviving parity blocks, by block number
                (``data .. data+parity-1``), each as its chunks in order.
            checkpoint: names the checkpoint in errors (the error's ``checkpoint``).

        Returns:
            ``{block number: bytes}`` for every member not in ``members``, cut to
            its size.

        Raises:
            CorruptCheckpointError: fewer than ``data`` intact blocks survive (the
                message names the lost blocks, and why each damaged parity block was
                not used: a chunk that does not match its checksum, a wrong count).
        """
        missing = [i for i in range(self.data) if i not in members]
        if not missing:
            return {}
        length = stripe_length(sizes, self.chunk)
        chunks = length // self.chunk
        # A damaged parity block counts as lost: never decode from unverified bytes.
        damaged = {b: why for b, pieces in parity.items() if (why := _damage(pieces, chunks))}
        intact = sorted(b for b in parity if b not in damaged)
        usable = sorted(members)[: self.data]
        usable += intact[: self.data - len(usable)]
        if len(usable) < self.data:
            lost = sorted(set(range(self.data + self.parity)) - set(members) - set(intact))
            why = "".join(f"; parity block {b}: {damaged[b]}" for b in sorted(damaged))
            raise CorruptCheckpointError(
                f"RS({self.data}+{self.parity}) cannot rebuild members {missing}: blocks "
                f"{lost} are lost or damaged and at most {self.parity} may be{why}",
                checkpoint=checkpoint,
            )
        out = {i: bytearray(length) for i in missing}
        views = {i: memoryview(members[i]).cast("B") for i in members}
        for index, start in enumerate(range(0, length, self.chunk)):
            blocks = [
                self._piece(views[b], start) if b < self.data else parity[b][index].data
                for b in usable
            ]
            decoded = self.decode_chunk(blocks, usable)
            for i in missing:
                out[i][start : start + self.chunk] = decoded[i]
        return {i: bytes(out[i][: sizes[i]]) for i in missing}

    def _piece(self, view: memoryview, start: int) -> memoryview | bytes:
        """Chunk ``start`` of a member (a view, no copy), zero-padded to a whole chunk."""
        piece = view[start : start + self.chunk]
        if len(piece) == self.chunk:
            return piece
        return bytes(piece) + bytes(self.chunk - len(piece))


def _xor(pieces: Sequence[memoryview | bytes]) -> bytearray:
    """The XOR of equal-length pieces (8 bytes at a time where the length allows).

    The result is a ``bytearray`` filled in place: a fresh ``bytes`` per chunk
    (``ndarray.tobytes``) is new memory to page-fault every time, which costs
    many times what the XOR does.
    """
    out = bytearray(pieces[0])
    width = np.uint64 if len(out) % 8 == 0 else np.uint8
    acc = np.frombuffer(out, dtype=width)
    for piece in pieces[1:]:
        np.bitwise_xor(acc, np.frombuffer(piece, dtype=width), out=acc)
    return out


def _damage(pieces: Sequence[ParityChunk], chunks: int) -> str:
    """Why a parity block cannot be used ("" when it can)."""
    if len(pieces) != chunks:
        return f"{len(pieces)} chunks, the stripe needs {chunks}"
    for n, piece in enumerate(pieces):
        if piece.index != n or checksum_of(piece.data) != piece.checksum:
            return f"chunk {n} does not match its checksum"
    return ""
