"""Train, checkpoint on three levels, lose a node, resume bit-exact: dcp_multilevel on CPU.

Four ranks play two nodes on one machine (``DCP_ML_NODE`` tells each rank its
node; ``{node}`` in a level's path becomes that index, so each simulated node
gets a directory of its own). ``make demo`` runs::

    torchrun --standalone --nproc-per-node=4 examples/train_demo.py --out demo_out train
    rm -rf demo_out/node1     # node 1 is lost with its disk; a new, empty one comes
    torchrun --standalone --nproc-per-node=4 examples/train_demo.py --out demo_out resume

``train``: the ranks train a small transformer language model, data-parallel,
with AdamW, and call ``mgr.step(...)`` after every step. The schedule
(``Schedule.auto``: Young/Daly per level from the measured cost of a save and
the failure rates, saves kept under 3.5 % of the time) decides which steps
are saved, and to which levels:

1. each node's own disk (``demo_out/node<k>/local``): training waits for this one;
2. partner copies: each rank's files also on the other node's disk, copied in
   the background (survives losing a node);
3. a "remote" (``demo_out/remote``, or any fsspec URL: ``--remote s3://bucket/run``),
   compressed with the ``bytegroup`` codec, copied in the background.

The manager's default planner (``BalancedSavePlanner``) spreads the bytes
every data-parallel rank holds over all ranks. A live line shows training
and saves; closing tables show what each level holds, its stored bytes
against the raw state, and the training time a save blocks, against
``dcp.async_save`` with our writer and with stock DCP's ``FileSystemWriter``,
measured on the same state in the same run. The final state is kept
(``torch.save``) as the reference an uninterrupted run reached.

``resume``: the same training script after a restart. A fresh model
(another random init) calls ``mgr.load_latest``: the ranks agree on the newest
step every rank can still read, the files node 1 lacks are brought onto it
(from the partner copies and node 0's disk; a step that only the remote took
is read from the remote), and DCP loads. Training then replays the steps
after the restored one and must reach the reference bit for bit. The exit
status is non-zero, on every rank, on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.box import SIMPLE_HEAD
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dcp_multilevel import (
    BalancedSavePlanner,
    CheckpointManager,
    DcpMultilevelError,
    Level,
    MultiLevelWriter,
    Schedule,
)

# This directory's shared functions, also used by node_loss.py (first on sys.path under torchrun).
from demo_tools import diff_tree, exit_now, human

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH = 64, 64, 128, 4, 4, 8
RANKS_PER_NODE = 2
LEVEL_NAMES = ("node-local", "partner", "remote")
TABLE_STYLE: dict[str, Any] = {"box": SIMPLE_HEAD, "pad_edge": False, "title_justify": "left"}

# --------------------------------------------------------------------------- model and data


class TinyLM(nn.Module):
    """A small decoder-only transformer (pre-norm, causal): ~820K parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        # dropout=0: no random state to checkpoint, so a replay is bit-exact.
        layer = nn.TransformerEncoderLayer(
            D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))


# The "language": a fixed random Markov chain over VOCAB tokens. Every batch is a pure
# function of (step, rank), so a resumed run sees exactly the batches an uninterrupted
# run would have seen: that is what makes a bit-exact check possible.
_CHAIN = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7)), 1)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 + step * world + rank)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=g)
    for i in range(SEQ):
        tokens[:, i + 1] = torch.multinomial(_CHAIN[tokens[:, i]], 1, generator=g).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def build(init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(init_seed)  # the same seed on every rank: all ranks start equal
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step, dist.get_rank(), dist.get_world_size())
    optim.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    average_gradients(model)
    optim.step()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the mean over ranks: the same number on every rank
    return total.item() / dist.get_world_size()


def average_gradients(model: nn.Module) -> None:
    """Data parallelism: what DDP does, in one all-reduce of every gradient.

    Not DDP itself, because of the bit-exact check: DDP regroups the gradients
    into new buckets after its first step, and a restarted DDP's first step
    uses the old grouping. Gloo sums each element across ranks in an order
    that depends on its place in the bucket, so with more than two ranks the
    first step after a restart rounds differently: a correct resume, but not a
    bit-exact one. Here every gradient always sits at the same place.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(averaged.view_as(g))


# --------------------------------------------------------------------------- checkpointing


def levels(args: argparse.Namespace) -> list[Level]:
    """Fastest first; ``{node}`` is this rank's node (one directory per simulated node)."""
    node_dir = f"{args.out}/node{{node}}"
    return [
        # 1. The node's own disk: every save lands here first (training waits for it).
        Level(f"{node_dir}/local", keep=2),
        # 2. Each rank's files also on 1 other node (replicas=2 copies in all), copied
        #    in the background: a lost node is restored from the other one.
        Level(f"partner:{node_dir}/partner", keep=2, replicas=2),
        # 3. The remote: a store every node reaches (a folder here, or any fsspec URL),
        #    compressed, copied in the background from the first level.
        Level(args.remote or f"{args.out}/remote", keep=3, codec="bytegroup"),
    ]


def checkpoint_manager(args: argparse.Namespace, view: LiveView) -> CheckpointManager:
    """The manager: levels, the schedule, and a metrics callback. Collective."""
    return CheckpointManager(
        levels(args),
        # Per level, Young/Daly's interval from the measured cost of a save and the rate
        # of the failures that level is the lowest to survive (node losses: the partner
        # level), saves kept under 3.5 % of the time. A real job gives its own failure
        # rate (mtbf_hours=8, or gpus=N: published figures); the demo's job "fails" every
        # --mtbf-seconds so that a short run saves often enough to watch.
        schedule=Schedule.auto(
            mtbf_hours=args.mtbf_seconds / 3600, max_seconds={2: args.remote_max_seconds}
        ),
        on_metrics=view.record,  # every decision, save, drain and load, as a dict
        # mgr.step returns once the state is copied into reused host buffers; the first
        # level is written in the background and finished by the next save (or wait()).
        async_save=True,
    )


def snapshot(
    model: nn.Module, optim: torch.optim.Optimizer, step: int, losses: list[float]
) -> dict[str, Any]:
    """What is saved: model and optimizer state (live tensors, no copy) and plain values."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "trainer": {"step": step, "losses": losses}}


def train(
    mgr: CheckpointManager,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    steps: range,
    losses: list[float],
    view: LiveView,
) -> None:
    """The training loop: ``mgr.step`` after every step saves when the schedule says so."""
    for step in steps:
        loss = train_step(model, optim, step)
        losses.append(loss)
        mgr.step(snapshot(model, optim, step, losses), step=step, loss=loss)
        view.stepped(step, loss)


# --------------------------------------------------------------------------- the two runs


def run_train(args: argparse.Namespace) -> bool:
    rank = dist.get_rank()
    view = LiveView(rank, args.steps)
    mgr = checkpoint_manager(args, view)
    model, optim = build(args.seed)
    losses: list[float] = []
    # A training script starts with load_latest; this run must start from scratch.
    if mgr.load_latest(snapshot(model, optim, 0, losses)) is not None:
        if rank == 0:
            print(
                f"TRAIN FAILED: {args.out} or the remote already holds checkpoints; remove "
                "them (make demo does) or give a fresh --remote",
                file=sys.stderr,
            )
        return False
    view.header(args, model)
    t0 = time.perf_counter()
    with view.progress():
        train(mgr, model, optim, range(1, args.steps + 1), losses, view)
    mgr.wait()  # the background copies: the newest step due on each level is there
    train_s = time.perf_counter() - t0

    # What an uninterrupted run reached: the reference the resumed run must meet bit
    # for bit (torch.save: a plain file, independent of the library under test).
    state = snapshot(model, optim, args.steps, losses)
    reference = Path(args.out) / "reference" / f"rank{rank}.pt"
    reference.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, reference)

    # The same state through dcp.async_save: our writer, then stock DCP's.
    compared = compare_async_saves(args, state)
    held = [mgr.steps(i) for i in range(len(mgr.levels))]
    urls = [level.url for level in mgr.levels]  # this rank's: {node} filled in
    mine = {
        "held": held,
        "saves": [(m.step, m.bytes_written, m.seconds) for m in mgr.metrics],
        "drains": [
            (urls.index(d.level), d.step, d.bytes_stored)
            for d in mgr.drain_results
            if not (d.skipped or d.superseded or d.error)
        ],
        **compared,
    }
    everyone = all_ranks(mine)
    held = everyone[0]["held"]  # rank 0's view, the same verdict on every rank
    mgr.close()
    if rank == 0:
        raw = sum(t.numel() * t.element_size() for t in tensors(state))
        view.closing_tables(held, raw, everyone, train_s)
        if not held[1]:
            print(
                "TRAIN FAILED: no save reached the partner level: a lost node could not be "
                "restored (more --steps, or a shorter --mtbf-seconds)"
            )
            return False
        newest = max(held[0])
        on = ", ".join(LEVEL_NAMES[i] for i, steps in enumerate(held) if newest in steps)
        remote = levels(args)[2].url
        print(f"  look inside: dcp-multilevel ls {remote}   (or inspect, verify a step there)")
        print(f"TRAIN OK: the newest save, step {newest}, is on: {on}. Now lose node 1.")
    return bool(held[1])


def run_resume(args: argparse.Namespace) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["DCP_ML_NODE"])
    # Which nodes come back empty (looked at before the manager makes their directories).
    empty = all_ranks(not (Path(args.out) / f"node{node}").exists())
    lost = sorted({r // RANKS_PER_NODE for r, gone in enumerate(empty) if gone})
    reference = torch.load(Path(args.out) / "reference" / f"rank{rank}.pt", weights_only=True)
    last = reference["trainer"]["step"]  # where the uninterrupted run stopped

    view = LiveView(rank, last)
    mgr = checkpoint_manager(args, view)
    model, optim = build(args.seed + 1)  # another init: the load must overwrite every bit
    state = snapshot(model, optim, -1, [])
    t0 = time.perf_counter()
    try:
        step = mgr.load_latest(state)  # brings the lost node's files back, then loads
    except DcpMultilevelError as e:
        if rank == 0:  # every rank reaches the same verdict (the plan is agreed collectively)
            print(f"RESUME FAILED: {e}", file=sys.stderr, flush=True)
        return False
    load_s = time.perf_counter() - t0
    if step is None:
        if rank == 0:
            print("RESUME FAILED: no checkpoint found (run the train phase first)", file=sys.stderr)
        return False
    restore = mgr.last_restore  # what this rank's node was missing, and where it came from
    # ... and which copy served each item this rank loaded (its node's files, or a store).
    urls = [level.url for level in mgr.levels]
    read = {level_of(copy, urls): n for copy, n in mgr.last_load_sources.items()}
    restored = (node, restore.received if restore else {}, restore.seconds if restore else 0.0)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = list(state["trainer"]["losses"])
    view.header(args, model, restored=step)
    with view.progress(done=step):
        train(mgr, model, optim, range(step + 1, last + 1), losses, view)
    mgr.close()  # waits for the background copies (DrainError if one failed)

    problems = diff_tree(reference, snapshot(model, optim, last, losses), "state")
    for p in problems[:20]:
        print(f"[rank {rank}] MISMATCH {p}", file=sys.stderr, flush=True)
    rows = all_ranks((*restored, read, len(problems)))
    bad = sum(row[-1] for row in rows)
    if rank == 0:
        names = {level.url: LEVEL_NAMES[i] for i, level in enumerate(levels(args))}
        view.restore_report(lost, step, rows, load_s, names)
        if bad:
            print(f"RESUME FAILED: {bad} mismatch(es), see above")
        else:
            replayed = f"replayed steps {step + 1}..{last}" if step < last else "no step to replay"
            print(
                f"  check     {replayed}: {len(tensors(reference))} tensors (model, AdamW) "
                f"and {len(losses)} losses bit-exact with the uninterrupted run, all {world} ranks"
            )
            print("RESUME OK")
    return bad == 0


# --------------------------------------------------------------------------- the comparison


def compare_async_saves(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, list]:
    """``dcp.async_save`` of ``state``, ``--async-saves`` times each: with our writer (its
    host buffers reused from the second save on), then with stock DCP's
    ``FileSystemWriter`` (a new one per save, as its docs do). Per save, on this rank:
    (seconds training was blocked, bytes this rank wrote)."""
    out = Path(args.out) / "async"
    ours = MultiLevelWriter(out / "ours", overwrite=True)
    results: dict[str, list] = {"ours": [], "stock": []}
    for name, saves in results.items():
        for i in range(args.async_saves):
            path = out / f"{name}-{i}"
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours":
                future = dcp.async_save(
                    state, storage_writer=ours, planner=BalancedSavePlanner(), checkpoint_id=path
                )
            else:
                future = dcp.async_save(state, storage_writer=FileSystemWriter(path))
            blocked = time.perf_counter() - t0
            future.result()  # written and committed before the next one starts
            if name == "ours":
                written = ours.bytes_written
            else:  # stock names each rank's files __<rank>_<n>.distcp
                written = sum(f.stat().st_size for f in path.glob(f"__{dist.get_rank()}_*"))
            saves.append((blocked, written))
    ours.close()
    return results


# --------------------------------------------------------------------------- what rank 0 shows


class LiveView:
    """Rank 0's output: a live progress line, a line per save, the closing tables."""

    def __init__(self, rank: int, steps: int) -> None:
        self.rank, self.steps = rank, steps
        self.args: argparse.Namespace | None = None
        self.console = Console(highlight=False)
        self._bar: Progress | None = None
        self._task: Any = None
        self._t0 = time.perf_counter()
        self._saves = 0
        self._remote: int | None = None
        self._decision: dict[str, Any] = {}

    def record(self, record: dict[str, Any]) -> None:
        """``on_metrics`` (every rank; drain records come from the drains' threads): rank 0
        prints each save and each step that reached the remote."""
        if self.rank != 0:
            return
        kind, seconds = record["kind"], time.perf_counter() - self._t0
        if kind == "decision":
            self._decision = record
        elif kind == "save":
            self._saves += 1
            to = " + ".join(["local", *(short(url) for url in record["drains_started"])])
            self.log(
                f"{seconds:5.1f} s  step {record['step']:>4} -> {to:<24} blocked "
                f"{record['blocked_seconds'] * 1000:3.0f} ms  [dim]{self._decision.get('policy')}"
            )
        elif kind == "drain" and record["error"]:
            self.log(f"[red]step {record['step']} to {record['level']}: {record['error']}")
        elif kind == "drain" and record["committed"] and short(record["level"]) == "remote":
            self._remote = record["step"]
            self.log(
                f"{seconds:5.1f} s  step {record['step']:>4} reached the remote "
                f"({record['lag_seconds']:.2f} s after its first-level commit)"
            )

    def log(self, text: str) -> None:
        (self._bar.console if self._bar is not None else self.console).print(text)

    def header(
        self, args: argparse.Namespace, model: nn.Module, restored: int | None = None
    ) -> None:
        self.args = args
        if self.rank != 0:
            return
        world, n = dist.get_world_size(), sum(p.numel() for p in model.parameters())
        phase = "train" if restored is None else f"resume from step {restored}"
        print(
            f"dcp_multilevel demo, {phase}: {world} ranks on {world // RANKS_PER_NODE} simulated "
            f"nodes, a transformer of {n:,} parameters, AdamW"
        )
        if restored is None:
            for i, level in enumerate(levels(args)):
                print(f"  level {i + 1}  {LEVEL_NAMES[i]:<10}  {level.url}")
            print(
                f"  schedule Schedule.auto: Young/Daly per level for a job failing every "
                f"{args.mtbf_seconds:.0f} s, remote at least every {args.remote_max_seconds:.0f} s"
            )
        sys.stdout.flush()

    def progress(self, done: int = 0) -> Progress:
        self._bar = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            disable=self.rank != 0,
        )
        self._task = self._bar.add_task("train", total=self.steps, completed=done, status="")
        self._t0 = time.perf_counter()
        return self._bar

    def stepped(self, step: int, loss: float) -> None:
        if self._bar is not None and self.rank == 0:
            remote = f", remote has step {self._remote}" if self._remote is not None else ""
            status = f"loss {loss:.3f}  {self._saves} saves{remote}"
            self._bar.update(self._task, completed=step, status=status)

    def closing_tables(
        self, held: list[list[int]], raw: int, everyone: list[dict[str, list]], train_s: float
    ) -> None:
        """Per level: the steps it holds, stored bytes per step against the raw state. Then
        per way of saving: the training time a save blocked, how evenly the ranks wrote."""
        assert self.args is not None
        table = Table(
            title=f"Levels after {self.args.steps} steps ({train_s:.0f} s)", **TABLE_STYLE
        )
        for col in ("level", "codec", "holds steps", "sent", "interval", "stored", "vs raw"):
            table.add_column(
                col, justify="left" if col in ("level", "codec") else "right", no_wrap=True
            )
        intervals = self._decision.get("intervals", {})
        for i, level in enumerate(levels(self.args)):
            per_step: dict[int, int] = {}  # step -> bytes stored there, all ranks together
            for mine in everyone:
                if i == 0:
                    pairs = [(step, size) for step, size, _ in mine["saves"]]
                else:
                    pairs = [(step, size) for index, step, size in mine["drains"] if index == i]
                for step, size in pairs:
                    per_step[step] = per_step.get(step, 0) + size
            stored = statistics.mean(per_step.values()) if per_step else 0
            table.add_row(
                f"{i + 1} {LEVEL_NAMES[i]}",
                str(level.codec or "-"),
                ", ".join(map(str, held[i])) or "-",
                str(len(per_step)),
                f"{intervals[str(i)]:.1f} s" if str(i) in intervals else "-",
                human(stored),
                f"{stored / raw:.2f}x",
            )
        self.console.print(table)
        print(f"  raw: {human(raw)} of tensors (model + AdamW), one replica. The partner level")
        print("  stores the other node's files; its own are hard links to the first level's.")
        print("  sent: steps the schedule sent there; interval: the last one it chose;")
        print("  stored: bytes per step on the level, all ranks together")

        table = Table(title="Training blocked per save (slowest rank)", **TABLE_STYLE)
        for col in ("save", "saves", "median", "first", "busiest rank"):
            table.add_column(col, justify="left" if col == "save" else "right")
        ways = {
            "mgr.step": [[(blocked, size) for _, size, blocked in m["saves"]] for m in everyone],
            "async_save, MultiLevelWriter": [m["ours"] for m in everyone],
            "async_save, stock FileSystemWriter": [m["stock"] for m in everyone],
        }
        for name, by_rank in ways.items():
            saves = list(zip(*by_rank, strict=True))  # per save: (blocked, bytes) of each rank
            if not saves:
                continue
            blocked = [max(b for b, _ in save) for save in saves]
            busiest = statistics.mean(
                max(n for _, n in save) / statistics.mean(n for _, n in save) for save in saves
            )
            table.add_row(
                name,
                str(len(saves)),
                f"{statistics.median(blocked) * 1000:.0f} ms",
                f"{blocked[0] * 1000:.0f} ms",
                f"{busiest:.2f}x mean",
            )
        self.console.print(table)
        print("  mgr.step (async_save=True) blocks for a copy into host memory, and at the next")
        print("  save for the first level's write if it is still running; partner and remote")
        print("  copies run in the background. async_save blocks for a copy into host memory.")
        print("  busiest rank: bytes written by the busiest rank over the mean")

    def restore_report(
        self, lost: list[int], step: int, rows: list[tuple], load_s: float, names: dict
    ) -> None:
        what = f"node(s) {lost}: empty at the restart" if lost else "nothing (no node was empty)"
        print(f"  lost      {what}")
        print(f"  restored  step {step} in {load_s:.2f} s (load_latest); per node:")
        shown: set[int] = set()
        for node, received, seconds, read, _ in rows:  # a node's ranks report the same files
            if node in shown:
                continue
            shown.add(node)
            brought = []
            for source, count in sorted(received.items()):
                url, _, where = source.rpartition(" (")  # "<url> (node 0)", "(this node)"
                brought.append(f"{count} files from {names.get(url, url)} ({where}")
            print(f"    node {node}: brought {', '.join(brought) or 'nothing'} in {seconds:.2f} s")
            served = ", ".join(f"{n} from {LEVEL_NAMES[i]}" for i, n in sorted(read.items()))
            print(f"            items read (one rank): {served}")


# --------------------------------------------------------------------------- small functions


def short(url: str) -> str:
    """A higher level's name in the live lines."""
    return "partner" if url.startswith("partner:") else "remote"


def level_of(copy: str, urls: list[str]) -> int:
    """Which level a copy a load read from is on (``file:///x/remote/step-9`` -> 2)."""
    for i, url in enumerate(urls):
        root = url.split(":", 1)[1] if url.startswith("partner:") else url
        if root.removeprefix("file://") in copy:
            return i
    return len(urls)  # unknown: not expected


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def all_ranks(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["train", "resume"])
    p.add_argument("--out", default="demo_out", help="directory holding the simulated nodes")
    p.add_argument("--remote", help="the remote level: any fsspec URL (default: <out>/remote)")
    p.add_argument("--steps", type=int, default=300, help="training steps of the run")
    p.add_argument("--mtbf-seconds", type=float, default=30.0, help="the demo job's MTBF")
    p.add_argument("--remote-max-seconds", type=float, default=10.0, help="the remote's bound")
    p.add_argument("--async-saves", type=int, default=3, help="saves per async comparison")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Four ranks share the cores: one thread each avoids oversubscription and keeps the
    # arithmetic (and so the bit-exact comparison) deterministic.
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g. `make demo`", file=sys.stderr)
        return 2
    # One machine plays every node: tell each rank its node (torchrun would say node 0
    # for all of them). On real nodes, leave DCP_ML_NODE unset.
    os.environ["DCP_ML_NODE"] = str(int(os.environ["RANK"]) // RANKS_PER_NODE)
    dist.init_process_group("gloo")
    try:
        ok = run_train(args) if args.phase == "train" else run_resume(args)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())  # without interpreter teardown: see demo_tools.exit_now
