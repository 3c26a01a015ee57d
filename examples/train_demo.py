"""Train, checkpoint, "crash", resume: dcp_multilevel end to end on CPU.

Run with two ranks (``make demo`` does exactly this)::

    torchrun --standalone --nproc-per-node=2 examples/train_demo.py --out demo_out

What it does, on every rank:

1. trains a small MLP (~650K parameters) with DDP (gloo) and AdamW for a few steps;
2. saves model + optimizer state (``get_state_dict``) and some plain Python
   values (step number, loss history, run info) with ``dcp.save`` and a
   :class:`~dcp_multilevel.MultiLevelWriter`;
3. keeps training a few steps: the reference an uninterrupted run would produce;
4. simulates a restart: throws model and optimizer away, builds fresh ones
   with a *different* random init, loads the checkpoint with ``dcp.load`` and a
   :class:`~dcp_multilevel.MultiLevelReader`, and applies it with ``set_state_dict``;
5. checks that parameters, optimizer state and the plain values equal what was
   saved (bit-exact), then replays the same steps and checks the losses and
   final parameters equal the uninterrupted run's (bit-exact).

Rank 0 prints a report. The exit status is non-zero on any mismatch, on every rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from dcp_multilevel import MultiLevelReader, MultiLevelWriter
from dcp_multilevel.format import MANIFEST_NAME, decode_manifest

D_IN, D_HIDDEN, D_OUT = 64, 768, 16
BATCH = 64


class MLP(nn.Module):
    """Two hidden layers with GELU and a LayerNorm: ~650K parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(D_IN, D_HIDDEN),
            nn.GELU(),
            nn.Linear(D_HIDDEN, D_HIDDEN),
            nn.GELU(),
            nn.LayerNorm(D_HIDDEN),
            nn.Linear(D_HIDDEN, D_OUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# --------------------------------------------------------------------------- data

# A fixed random "teacher" the model learns to imitate. Every batch is a pure
# function of (step, rank), so a resumed run sees exactly the batches an
# uninterrupted run would have seen: that is what makes a bit-exact check possible.
_TEACHER = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(1234)) / math.sqrt(D_IN)


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ _TEACHER)


def train_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(1_000_003 + step * world + rank)


# --------------------------------------------------------------------------- model


def build(init_seed: int, lr: float) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(init_seed)
    # DDP broadcasts rank 0's initial parameters, so all ranks start equal.
    model = DDP(MLP())
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, optim


def train_step(model: DDP, optim: torch.optim.Optimizer, step: int) -> float:
    x, y = train_batch(step, dist.get_rank(), dist.get_world_size())
    optim.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP averages gradients across ranks here
    optim.step()
    # The mean over ranks: the same number on every rank.
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@torch.no_grad()
def eval_loss(model: DDP) -> float:
    x, y = make_batch(42)
    return nn.functional.mse_loss(model.module(x), y).item()


# --------------------------------------------------------------------------- helpers


def clone_tree(obj: Any) -> Any:
    """Deep copy of a state dict (tensors cloned), taken before training mutates it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def leaves_of(obj: Any) -> Iterator[Any]:
    """Leaves as DCP flattens them: a list without tensors or dicts is one leaf."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from leaves_of(v)
    elif isinstance(obj, (list, tuple)) and any(
        isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj
    ):
        for v in obj:
            yield from leaves_of(v)
    else:
        yield obj


def diff_tree(expected: Any, actual: Any, path: str) -> list[str]:
    """Paths where ``actual`` differs from ``expected``; tensors must be bit-identical."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: expected a tensor, got {type(actual).__name__}"]
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [
                f"{path}: {expected.dtype}{list(expected.shape)} vs "
                f"{actual.dtype}{list(actual.shape)}"
            ]
        # Bits, not values: torch.equal calls NaN unequal to itself and -0.0 equal to 0.0.
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (expected, actual)]
        return [] if torch.equal(*bits) else [f"{path}: values differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or expected.keys() != actual.keys():
            return [f"{path}: keys differ"]
        return [d for k in expected for d in diff_tree(expected[k], actual[k], f"{path}[{k!r}]")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return [f"{path}: {expected!r} vs {actual!r}"]
        return [
            d
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for d in diff_tree(e, a, f"{path}[{i}]")
        ]
    return [] if expected == actual else [f"{path}: {expected!r} vs {actual!r}"]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def files_on_disk(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.out) / f"step-{args.steps}"
    # Plain values only: the reader loads them with torch.load(weights_only=True),
    # which refuses arbitrary classes (torch.__version__ is a TorchVersion, hence str()).
    run_info = {
        "model": f"MLP {D_IN}-{D_HIDDEN}-{D_HIDDEN}-{D_OUT}",
        "optimizer": "AdamW",
        "world_size": world,
        "seed": args.seed,
        "torch": str(torch.__version__),
    }

    # 1. Train.
    model, optim = build(args.seed, args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    losses = [train_step(model, optim, step) for step in range(args.steps)]
    loss_at_save = eval_loss(model)

    # 2. Save model + optimizer state and plain Python values.
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "trainer": {"step": args.steps, "losses": losses, "run": run_info},
    }
    dist.barrier()
    t0 = time.perf_counter()
    # overwrite=True is deliberate: re-running the demo replaces the checkpoint an
    # earlier run left in the same directory (atomically: the new manifest replaces
    # the old one, then the old data is deleted). The default, overwrite=False,
    # refuses to replace a committed checkpoint, which is what a training job wants.
    dcp.save(state, storage_writer=MultiLevelWriter(str(ckpt), overwrite=True))
    save_s = time.perf_counter() - t0
    # get_state_dict returns the live tensors: copy them before training moves on.
    saved = clone_tree(state)
    n_tensors = sum(1 for _ in tensors_of(saved))
    n_tensor_bytes = sum(t.numel() * t.element_size() for t in tensors_of(saved))
    n_values = sum(1 for v in leaves_of(saved) if not isinstance(v, torch.Tensor))

    # 3. The reference: what an uninterrupted run does next.
    steps_after = range(args.steps, args.steps + args.extra_steps)
    ref_losses = [train_step(model, optim, step) for step in steps_after]
    ref_final = clone_tree(model.module.state_dict())

    # 4. "Crash" and restart: fresh model (different init) and a fresh optimizer.
    del model, optim, model_sd, optim_sd, state
    model, optim = build(args.seed + 1, args.lr)
    model_sd, optim_sd = get_state_dict(model, optim)
    fresh_differs = bool(diff_tree(saved["model"], model_sd, "fresh model"))
    # The values to load into must have the same structure (keys) as what was
    # saved; DCP loads tensors in place and replaces the plain values.
    placeholder = {k: None for k in run_info}
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "trainer": {"step": -1, "losses": [], "run": placeholder},
    }
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=MultiLevelReader(str(ckpt)))
    load_s = time.perf_counter() - t0

    # 5. Check what was loaded (before set_state_dict, which renames keys in place),
    # what the model and optimizer hold afterwards, and what training does next.
    problems = diff_tree(saved, state, "loaded state")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    live_model, live_optim = get_state_dict(model, optim)
    problems += diff_tree(saved["model"], live_model, "model after set_state_dict")
    problems += diff_tree(saved["optim"], live_optim, "optimizer after set_state_dict")
    if not fresh_differs:
        problems.append("the fresh model equals the saved one: the check would prove nothing")
    resumed_eval = eval_loss(model)
    if resumed_eval != loss_at_save:
        problems.append(f"eval loss {resumed_eval!r} after load, {loss_at_save!r} at save")
    resumed_losses = [train_step(model, optim, step) for step in steps_after]
    if resumed_losses != ref_losses:
        problems.append(f"losses after resume {resumed_losses} != uninterrupted {ref_losses}")
    problems += diff_tree(ref_final, model.module.state_dict(), "model after resumed steps")

    # Every rank must agree, so every rank exits with the same status.
    bad = torch.tensor([len(problems)])
    dist.all_reduce(bad)
    for p in problems[:20]:
        print(f"[rank {rank}] MISMATCH {p}", file=sys.stderr, flush=True)

    if rank == 0:
        files = files_on_disk(ckpt)
        manifest = decode_manifest((ckpt / MANIFEST_NAME).read_bytes(), checkpoint=str(ckpt))
        data_files = [(f, s) for f, s in files if f in manifest.files]
        stray = [f for f, _ in files if f != MANIFEST_NAME and f not in manifest.files]
        on_disk = sum(s for _, s in files)
        print(
            f"dcp_multilevel demo: {world} ranks (DDP, gloo, CPU), MLP with {n_params:,} "
            f"parameters, AdamW"
        )
        print(f"  trained   steps 0..{args.steps - 1}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"  saved     {ckpt} in {save_s * 1000:.0f} ms")
        print(
            f"            {n_tensors} tensors ({human(n_tensor_bytes)}) + {n_values} plain "
            f"values (step, loss history, run info, optimizer hyperparameters)"
        )
        print(
            f"            on disk: {len(files)} files, {human(on_disk)} (save_id "
            f"{manifest.save_id}, format v{manifest.format_version})"
        )
        for f, s in files:
            print(f"              {f:<48} {human(s):>10}")
        if stray:
            print(
                f"            note: {len(stray)} file(s) not named by the manifest "
                "(left by an interrupted earlier run?)"
            )
        print(f"            {len(data_files)} data files hold {len(manifest.locations)} items")
        print("  restarted fresh model (different init) and optimizer")
        print(f"  loaded    in {load_s * 1000:.0f} ms")
        if bad.item() == 0:
            print(
                f"  resume    {n_tensors} tensors bit-exact, step {args.steps} and "
                f"{len(losses)} losses restored, eval loss {resumed_eval:.6f} unchanged"
            )
            print(
                f"  continued steps {steps_after.start}..{steps_after.stop - 1}: loss "
                + ", ".join(f"{x:.4f}" for x in resumed_losses)
                + " - identical to the uninterrupted run"
            )
            print("RESUME OK")
            print(f"  look inside: dcp-multilevel inspect {ckpt}   (or verify, ls {ckpt.parent})")
        else:
            print(f"RESUME FAILED: {bad.item()} mismatch(es), see above")
        sys.stdout.flush()
    return bad.item() == 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="demo_out", help="directory for checkpoints")
    p.add_argument("--steps", type=int, default=20, help="training steps before the save")
    p.add_argument("--extra-steps", type=int, default=5, help="steps replayed after resume")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Two ranks share two cores: one thread each avoids oversubscription and
    # keeps the arithmetic (and so the bit-exact comparison) deterministic.
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g. `make demo`", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    try:
        ok = run(args)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


def exit_now(status: int) -> NoReturn:
    """Leave with ``status`` without interpreter teardown.

    With torch 2.13 (CPU, gloo), about one run in 20 aborts *after* all work is
    done and the process group destroyed: native teardown at exit hits
    "terminate called without an active exception" (SIGABRT, no Python frame
    on any thread). Nothing is left to clean up by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
