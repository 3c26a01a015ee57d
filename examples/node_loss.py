"""Lose a node, restart, restore it from the other nodes: dcp_multilevel on CPU.

Four ranks on simulated nodes, on one machine: each node is a directory
(``<out>/node<k>``), each rank is told its node through ``DCP_ML_NODE``, and
``{node}`` in a level's path becomes that index. ``make demo-nodeloss`` runs
it twice over::

    # partner copies: 2 nodes of 2 ranks, each rank's files also on the other node
    torchrun --standalone --nproc-per-node=4 examples/node_loss.py --out OUT/partner save
    rm -rf OUT/partner/node1          # node 1 is lost with its disk; a new, empty one comes
    torchrun --standalone --nproc-per-node=4 examples/node_loss.py --out OUT/partner restore

    # erasure coding: 4 nodes of 1 rank, Reed-Solomon groups of 2 nodes + 1 parity block
    torchrun ... examples/node_loss.py --out OUT/erasure --level erasure --ranks-per-node 1 save
    rm -rf OUT/erasure/node2
    torchrun ... examples/node_loss.py --out OUT/erasure --level erasure --ranks-per-node 1 restore

``save``: every rank trains the same small MLP with AdamW (the replicas of
data parallelism) and, after each of ``--steps`` steps, saves model,
optimizer and plain values with a plain ``dcp.save`` and a new
``MultiLevelWriter(f"step-{step}", levels=...)`` (as training stacks build a
writer per save), over two levels: a first level on each node's own disk,
and the partner (or erasure) level, which copies (or codes) each step onto
the other nodes in the background; ``dcp_multilevel.wait()`` waits for those
copies. Rank 0 then shows which files each node holds.

``restore``: a fresh model (another random init) loads with a plain
``dcp.load`` and ``MultiLevelReader("latest", levels=...)``. The ranks agree
on the newest step every rank can read; the ranks of the replaced node find
their directory empty, and the files they need are brought onto their node
first (copied from another node, or rebuilt from the surviving blocks of an
erasure group), then DCP loads. Rank 0 prints, per rank, the step, where the
files its node lacked came from and how long it took, and everything loaded
is checked bit for bit against a replay of the same training steps.

The exit status is non-zero, on every rank, when the restored state is not
bit-exact, when it is not the newest step saved, or when the checkpoint
cannot be restored at all (too many nodes lost, damaged copies).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dcp_multilevel
from dcp_multilevel import BalancedSavePlanner, Level, MultiLevelReader, MultiLevelWriter

# The bit-for-bit state check, size formatting and exit of the main demo (this
# directory is the script's own, first on sys.path under torchrun).
from demo_tools import diff_tree, exit_now, human

D_IN, D_HIDDEN, D_OUT = 32, 384, 8
BATCH = 32
FIRST = "first level"  # how the tables name the first level


# --------------------------------------------------------------------------- levels


def levels(args: argparse.Namespace) -> list[Level]:
    """The first level and the level between nodes, one directory per node each."""
    node_dir = f"{args.out}/node{{node}}"  # {node}: this rank's node (DCP_ML_NODE)
    first = Level(f"{node_dir}/local", every=1, keep=2)
    if args.level == "partner":
        # Each rank's files on replicas - 1 = 1 other node: (replicas - 1)x the bytes.
        return [first, Level(f"partner:{node_dir}/partner", every=1, keep=2, replicas=2)]
    # Groups of 2 nodes, 1 parity block on a node outside each group: 1.5x the bytes,
    # plus each member padded to whole 4 MiB chunks (most of it for this small demo).
    return [first, Level(f"erasure:{node_dir}/erasure", every=1, keep=2, data=2, parity=1)]


# --------------------------------------------------------------------------- training


def build(init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(init_seed)
    model = nn.Sequential(
        nn.Linear(D_IN, D_HIDDEN),
        nn.GELU(),
        nn.Linear(D_HIDDEN, D_HIDDEN),
        nn.GELU(),
        nn.Linear(D_HIDDEN, D_OUT),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    # Every batch is a pure function of the step: a replay gives the same bits.
    g = torch.Generator().manual_seed(1_000_003 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.randn(BATCH, D_OUT, generator=g)
    optim.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss.item()


def train(seed: int, steps: int) -> dict[str, Any]:
    """The state after ``steps`` steps from scratch: what the checkpoint must hold."""
    model, optim = build(seed)
    losses = [train_step(model, optim, s) for s in range(1, steps + 1)]
    return snapshot(model, optim, steps, losses)


def snapshot(
    model: nn.Module, optim: torch.optim.Optimizer, step: int, losses: list[float]
) -> dict[str, Any]:
    """What is saved: model and optimizer state (DCP's state_dict functions), plain values."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "trainer": {"step": step, "losses": losses}}


# --------------------------------------------------------------------------- reports


def newest_step_dir(level_dir: Path) -> Path | None:
    # Not only committed ones: a node-local first level has the manifest on rank 0's node only.
    steps = [p for p in level_dir.glob("step-*") if (p / "data").is_dir()]
    return max(steps, key=lambda p: int(p.name.split("-")[1]), default=None)


def holdings(out: Path) -> Iterator[str]:
    """Lines saying what each simulated node's disk holds of its newest step."""
    for node_dir in sorted(out.glob("node*"), key=lambda p: int(p.name[4:])):
        yield f"  {node_dir.name}/"
        level_dirs = [p for p in node_dir.iterdir() if p.is_dir()]
        for level_dir in sorted(level_dirs, key=lambda p: (p.name != "local", p.name)):
            step_dir = newest_step_dir(level_dir)
            if step_dir is None:
                continue
            ranks: dict[str, list[int]] = {}  # rank -> [bytes, linked bytes]
            for f in (step_dir / "data").iterdir():
                st = f.stat()
                entry = ranks.setdefault(f.name.split("-")[0], [0, 0])
                entry[0] += st.st_size
                entry[1] += st.st_size if st.st_nlink > 1 and level_dir.name != "local" else 0
            parts = []
            for rank, (size, linked) in sorted(ranks.items(), key=lambda e: int(e[0])):
                parts.append(f"rank {rank} {human(size)}{' (hard link)' if linked else ''}")
            parity = sorted((step_dir / "parity").glob("*.bin"))
            for p in parity:
                parts.append(f"parity {p.stem} {human(p.stat().st_size)}")
            if (step_dir / "manifest.json").exists():
                parts.append("manifest")
            where = f"{level_dir.name}/{step_dir.name}"
            yield f"    {where:<18} " + ", ".join(parts)


def describe(received: dict[str, int], names: dict[str, str]) -> str:
    """A restore's report, shortened: ``{"partner:/x/node{node}/partner (node 0)": 2}``
    becomes ``"2 copied from partner (node 0)"``."""
    groups: dict[str, tuple[int, list[str]]] = {}
    for key, count in received.items():
        url, _, where = key.rpartition(" (")  # "(node 0)", "(this node)", "(rebuilt from ...)"
        label, where = names.get(url, url), where.rstrip(")")
        if where.startswith("node "):
            what = f"copied from {label}"
        elif where.startswith("rebuilt "):
            what, where = f"rebuilt by {label}", where.removeprefix("rebuilt ")
        else:
            what = f"linked from {label}"
        n, places = groups.get(what, (0, []))
        groups[what] = (n + count, [*places, where])
    return ", ".join(f"{n} {what} ({', '.join(p)})" for what, (n, p) in sorted(groups.items()))


# --------------------------------------------------------------------------- phases


def save(args: argparse.Namespace, rank: int) -> bool:
    model, optim = build(args.seed)
    planner = BalancedSavePlanner()  # reused: DCP's plan cache works across saves
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        losses.append(train_step(model, optim, step))
        # A new writer per save; every writer given these levels shares their drains.
        writer = MultiLevelWriter(f"step-{step}", levels=levels(args))
        t_save = time.perf_counter()
        dcp.save(snapshot(model, optim, step, losses), storage_writer=writer, planner=planner)
        blocked = time.perf_counter() - t_save
    # The copies run in the background; this waits for them (DrainError if one failed).
    drained = dcp_multilevel.wait()
    seconds = time.perf_counter() - t0
    if rank == 0:
        reached = sorted({r.step for r in drained if r.committed})
        world, per_node = dist.get_world_size(), args.ranks_per_node
        print(
            f"dcp_multilevel node-loss demo ({args.level} level): {world} ranks on "
            f"{world // per_node} simulated nodes of {per_node}"
        )
        print(
            f"  saved     steps 1..{args.steps} (trained and saved in {seconds:.2f} s); "
            f"steps {reached} reached the {args.level} level (a newer step replaces one "
            "that waits behind a running copy)"
        )
        print(
            f"            step {args.steps}: dcp.save returned once the first level committed, "
            f"in {blocked * 1000:.0f} ms ({human(writer.bytes_written)} from rank 0)"
        )
        print(f"  on disk   ({args.out}/node<k>/<level>/step-<N>/data, newest step):")
        for line in holdings(Path(args.out)):
            print(line)
        print("SAVE OK")
    return True


def restore(args: argparse.Namespace, rank: int) -> bool:
    world = dist.get_world_size()
    node = int(os.environ["DCP_ML_NODE"])
    # Which nodes come back empty (looked at before the manager makes their directories).
    empty = dist_all(not (Path(args.out) / f"node{node}").exists())
    lost = sorted({n for n, gone in zip(node_of_ranks(world, args), empty, strict=True) if gone})
    names = dict(zip((lv.url for lv in levels(args)), (FIRST, args.level), strict=True))

    model, optim = build(args.seed + 1)  # another init: the load must overwrite every bit
    state = snapshot(model, optim, -1, [])
    reader = MultiLevelReader("latest", levels=levels(args))
    loads = reader.loads
    assert loads is not None
    t0 = time.perf_counter()
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:
        # Every rank reaches the same verdict (the step is agreed collectively).
        if rank == 0:
            print(f"RESTORE FAILED: {loads.failure or e}", file=sys.stderr, flush=True)
        return False
    load_s = time.perf_counter() - t0
    step = loads.restore.step if loads.restore is not None else None
    report = loads.last_restore
    received = report.received if report is not None else {}
    sources = describe(received, names)
    restore_s = report.seconds if report is not None else 0.0
    # A restore onto a replaced node makes the copies it held for the others again.
    dcp_multilevel.wait()

    problems = []
    if step is None:
        problems.append("no checkpoint on any node")
    elif step != args.steps:
        problems.append(f"restored step {step}, the newest saved is {args.steps}")
    if step is not None:
        expected = train(args.seed, step)
        problems += diff_tree(expected, state, "loaded state")
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        live_model, live_optim = get_state_dict(model, optim)
        problems += diff_tree(expected["model"], live_model, "model after set_state_dict")
        problems += diff_tree(expected["optim"], live_optim, "optimizer after set_state_dict")
    for p in problems[:20]:
        print(f"[rank {rank}] MISMATCH {p}", file=sys.stderr, flush=True)

    row = (rank, node, step, restore_s, load_s, sources or "none needed (all on this node)")
    rows = dist_all(row)
    bad = sum(dist_all(len(problems)))
    if rank == 0:
        print(f"dcp_multilevel node-loss demo ({args.level} level): restart, {world} ranks")
        print(
            f"  lost      node(s) {lost} (their directories were empty at the restart)"
            if lost
            else "  lost      nothing: every node's directory is there"
        )
        print("  restored  per rank: seconds spent bringing the node's missing files onto it,")
        print("            seconds in all (with the load), and what its node received from where")
        print(f"    {'rank':>4} {'node':>4} {'step':>4} {'restore':>8} {'load':>6}  files")
        for r, n, s, rs, ls, src in rows:
            print(f"    {r:>4} {n:>4} {s!s:>4} {rs:>7.2f}s {ls:>5.2f}s  {src}")
        if not any("copied" in r[-1] or "rebuilt" in r[-1] for r in rows):
            print("  note      no file came from another node: was a node's directory removed?")
        if bad == 0:
            print(
                f"  check     model, optimizer and trainer values of step {step} bit-exact "
                "on every rank (against a replay of the training)"
            )
            print("RESTORE OK")
        else:
            print(f"RESTORE FAILED: {bad} mismatch(es), see above")
        sys.stdout.flush()
    return bad == 0


# --------------------------------------------------------------------------- main


def dist_all(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def node_of_ranks(world: int, args: argparse.Namespace) -> list[int]:
    """The simulated node of each rank: consecutive ranks share a node, as torchrun numbers them."""
    return [r // args.ranks_per_node for r in range(world)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["save", "restore"])
    p.add_argument("--out", default="demo_out/nodeloss", help="directory holding the nodes")
    p.add_argument("--level", choices=["partner", "erasure"], default="partner")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps trained (and saved) before")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # four ranks share the cores; also keeps the replay bit-exact
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g. `make demo-nodeloss`", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % args.ranks_per_node:
        print(f"{world} ranks do not fill nodes of {args.ranks_per_node}", file=sys.stderr)
        return 2
    # One machine plays every node: tell each rank its node (torchrun would say
    # node 0 for all of them). On real nodes, leave DCP_ML_NODE unset.
    os.environ["DCP_ML_NODE"] = str(node_of_ranks(world, args)[rank])
    dist.init_process_group("gloo")
    try:
        ok = save(args, rank) if args.phase == "save" else restore(args, rank)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())  # without interpreter teardown: see demo_tools.exit_now
