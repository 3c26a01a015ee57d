"""Reed-Solomon parity on one core: zfec (the library we use) against numpy GF(2^8).

An erasure-coded level forms ``parity`` parity blocks from the
files of ``data`` nodes. This measures the coder alone, in memory, on one
thread, on the same bytes: real checkpoint bytes (BERT-large-shaped fp32
weights, random values with a fixed seed) split into ``data`` members of
different sizes, coded in 4 MiB chunks:

* ``ErasureCode (<coder>)``: :class:`dcp_multilevel.levels.erasure_code.ErasureCode`,
  parity only (the members are stored as they are): XOR for one parity
  block, zfec's C Vandermonde Reed-Solomon for more;
* ``zfec library``: ``zfec.Encoder`` called directly on the same chunks (the
  library alone: the goal is ErasureCode at least as fast);
* ``numpy-gf256``: the same arithmetic written with numpy (a 256-byte
  multiplication table per coefficient, ``np.take``, XOR), the hand-written
  alternative often named; with one parity block every coefficient is 1
  and it is a plain XOR (what ``ReduceOp.BXOR`` would compute);
* ``rebuild``: ErasureCode rebuilding one lost member from the survivors.

MB/s count the members' bytes per second (medians of ``--repeat``, the
entries alternating every round).

    python benchmarks/bench_erasure.py                       # RS(2+1) and RS(4+2), 256 MB
    python benchmarks/bench_erasure.py --mb 64 --repeat 3    # quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zfec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_seed, parser
from _measure import median, rounds, spread
from _report import markdown_table, print_header
from dcp_multilevel.levels.erasure_code import CHUNK, ErasureCode


def gf256_tables() -> np.ndarray:
    """``mul[a, b]`` = a * b in GF(2^8) with the polynomial 0x11d (as zfec uses)."""
    exp = np.zeros(512, np.uint16)
    log = np.zeros(256, np.uint16)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    exp[255:510] = exp[:255]
    a, b = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    mul = exp[(log[a] + log[b]) % 255].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    return mul


def numpy_parity(members: list[np.ndarray], parity: int, mul: np.ndarray) -> list[np.ndarray]:
    """Parity of equal-length members: ``p_j = XOR_i c_ji * d_i`` (Cauchy-like coefficients)."""
    out = []
    for j in range(parity):
        acc = np.zeros_like(members[0])
        for i, d in enumerate(members):
            c = 1 if parity == 1 else 1 + ((j * 7 + i * 13) % 254)
            acc ^= d if c == 1 else np.take(mul[c], d)
        out.append(acc)
    return out


def make_members(total: int, data: int, seed: int) -> list[bytes]:
    """``data`` members of ``total`` bytes in all, each 5 % larger than the one before."""
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(total // 4, generator=g) * 0.02).numpy().tobytes()
    weights = [1 + 0.05 * i for i in range(data)]
    cuts = [0] + [round(total * sum(weights[: i + 1]) / sum(weights)) for i in range(data)]
    return [raw[cuts[i] : cuts[i + 1]] for i in range(data)]


def group_entries(
    data: int, parity: int, args: argparse.Namespace, mul: np.ndarray
) -> tuple[int, list[tuple[str, Callable[[], None]]]]:
    """(member bytes, the timed entries) for one RS(data+parity) group."""
    members = make_members(args.mb << 20, data, args.seed)
    code = ErasureCode(data, parity)
    longest = max(len(m) for m in members)
    longest += -longest % CHUNK
    padded = [np.frombuffer(m + bytes(longest - len(m)), np.uint8) for m in members]
    parity_blocks: dict[int, list] = {data + j: [] for j in range(parity)}
    for chunks in code.encode(members):
        for j, piece in enumerate(chunks):
            parity_blocks[data + j].append(piece)
    sizes = [len(m) for m in members]
    survivors = dict(enumerate(members))
    del survivors[0]

    def ours_encode() -> None:
        for _ in code.encode(members):
            pass

    library = zfec.Encoder(data, data + parity)
    wanted = tuple(range(data, data + parity))

    def zfec_encode() -> None:
        for start in range(0, longest, CHUNK):
            library.encode(tuple(memoryview(p[start : start + CHUNK]) for p in padded), wanted)

    def numpy_encode() -> None:
        for start in range(0, longest, CHUNK):
            numpy_parity([p[start : start + CHUNK] for p in padded], parity, mul)

    def zfec_rebuild() -> None:
        assert code.rebuild(sizes, survivors, parity_blocks)[0] == members[0]

    entries = [
        (f"ErasureCode ({code.coder})", ours_encode),
        ("zfec library", zfec_encode),
        ("numpy-gf256", numpy_encode),
        (f"rebuild ({code.coder})", zfec_rebuild),
    ]
    return sum(sizes), entries


def measure(args: argparse.Namespace) -> list[list[object]]:
    mul = gf256_tables()
    rows = []
    for data, parity in ((2, 1), (4, 2)):
        total, entries = group_entries(data, parity, args, mul)
        seconds: dict[str, list[float]] = {name: [] for name, _ in entries}
        for _, (name, fn) in rounds(entries, args.repeat):
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
        for name, _ in entries:
            mbps = [total / s / 1e6 for s in seconds[name]]
            rows.append([f"RS({data}+{parity})", name, f"{median(mbps):.0f}", spread(mbps, 0)])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--mb", type=int, default=256, help="MiB of member bytes per group")
    p.add_argument("--repeat", type=int, default=5, help="measurements per entry (median)")
    add_seed(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print_header("bench_erasure", Path.cwd())
    print(f"\n### One core, {args.mb} MiB of members per group, {CHUNK >> 20} MiB chunks\n")
    headers = ["group", "coder", "MB/s (median)", "spread"]
    print(markdown_table(headers, measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
