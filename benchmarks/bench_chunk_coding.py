"""What coding one chunk costs: bytegroup on one thread, in memory, no pipeline.

Codes every float tensor of each set (MiniLM's real weights; BERT-large +
AdamW after a few steps; fp32 and bf16) in 1 MiB chunks with
``ByteGroupCodec.encode_into``, one thread, into reused buffers, and reports
MB/s (medians of ``--repeat``), the ratio, and how many of the bytes each
plane-method mix coded (per plane, low byte first: 0 raw, 1 zstd, 2/3 split).
No threads, GIL hand-offs, copies or I/O in the way: this is the coder's own
cost per byte, what every save and tool path pays at least. Run it at two
commits to compare coders; ``bench_codecs.py`` has the comparisons with other codecs
with stock DCP and ZipNN.

    python benchmarks/bench_chunk_coding.py                # MiniLM + 2 BERT layers
    python benchmarks/bench_chunk_coding.py --layers 6 --repeat 7
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

import dcp_multilevel
from _data import FLOAT_SETS, BertConfig, float_sets, tensor_bytes
from _measure import median
from _report import markdown_table, print_header
from dcp_multilevel.codecs.bytegroup import ByteGroupCodec

CHUNK = 1 << 20


def chunks(state: dict[str, torch.Tensor]) -> list[memoryview]:
    """Every tensor in CHUNK-byte pieces, as a writer frames them (tails under 4 KiB skipped)."""
    out = []
    for t in state.values():
        view = tensor_bytes(t.contiguous())
        out += [view[i : i + CHUNK] for i in range(0, len(view), CHUNK) if len(view) - i >= 4096]
    return out


def code_all(codec: ByteGroupCodec, pieces: list[memoryview], width: int, rotate: int, out):
    """Code every chunk into ``out``; ``(stored bytes, Counter of plane-method mixes by bytes)``."""
    stored, mixes = 0, Counter()
    for piece in pieces:
        n = codec.encode_into(piece, width, rotate, out)
        if n is None:
            stored += len(piece)
            mixes["raw chunk"] += len(piece)
        else:
            stored += n
            mixes[",".join(str(out[1 + 5 * p]) for p in range(width))] += len(piece)
    return stored, mixes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="BERT-large encoder layers; default 2")
    p.add_argument("--repeat", type=int, default=5, help="timed passes per set; default 5")
    args = p.parse_args(argv)
    if args.layers < 1 or args.repeat < 1:
        p.error("--layers and --repeat must be >= 1")

    print_header(__file__, Path(__file__).parent)
    # The package imported may come from another checkout (PYTHONPATH), to compare commits.
    package = Path(dcp_multilevel.__file__).parent
    git = ["git", "-C", str(package), "rev-parse", "--short", "HEAD"]
    done = subprocess.run(git, check=False, capture_output=True, text=True)
    commit = done.stdout.strip() or "unknown"
    print(f"- coder: {package} at git {commit}\n")
    codec = ByteGroupCodec()
    rows = []
    for set_name, state in float_sets(FLOAT_SETS, BertConfig(num_hidden_layers=args.layers)):
        name = set_name.replace("bert-adamw", f"bert-adamw-{args.layers}l")
        dtype = next(iter(state.values())).dtype
        width, rotate = codec.layout(dtype)
        pieces = chunks(state)
        raw = sum(len(c) for c in pieces)
        out = memoryview(np.empty(codec.payload_bound(CHUNK, width), np.uint8))
        code_all(codec, pieces, width, rotate, out)  # warm: scratch buffers, zstd contexts
        seconds = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            stored, mixes = code_all(codec, pieces, width, rotate, out)
            seconds.append(time.perf_counter() - t0)
        mix = ", ".join(f"{m}: {b / raw:.0%}" for m, b in mixes.most_common(3))
        s = median(seconds)
        rows.append([name, f"{raw / 1e6:.0f}", f"{stored / raw:.4f}", f"{raw / s / 1e6:.0f}", mix])
        print(f"{name}: {raw / s / 1e6:.0f} MB/s", file=sys.stderr)
    print(markdown_table("set | MB | ratio | code MB/s (1 thread) | plane methods", rows))
    print(f"\nMedians of {args.repeat} passes after one warm-up pass; 1 MB = 1e6 B.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
