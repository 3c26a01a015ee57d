"""``gpu_check.py``'s round trips: device state saved and loaded back, bit for bit.

Each check returns a one-line detail or raises; ``run_all`` runs every check,
records PASS/FAIL per check and never stops at the first failure (a device
lease is short: one run must tell everything). A process group of one rank is
initialised by ``gpu_check.py`` before these run (FSDP2 needs a mesh).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from _gpt import GPT, SHAPES, batch, forward_backward, optimizer
from dcp_multilevel import (
    BalancedSavePlanner,
    CheckpointManager,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)


def host_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a (possibly DTensor, possibly device) tensor, on the host."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any, where: str = "") -> None:
    """Raise naming the first value of ``a`` and ``b`` that differs (tensors by their bytes)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise AssertionError(f"{where}: keys {sorted(a)} != {sorted(b)}")
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(
                f"{where}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"
            )
        if not torch.equal(host_bits(a), host_bits(b)):
            raise AssertionError(f"{where}: bytes differ")
    elif a != b:
        raise AssertionError(f"{where}: {a!r} != {b!r}")


def on_device(state: Any, device: torch.device, where: str = "") -> None:
    if isinstance(state, dict):
        for k, v in state.items():
            on_device(v, device, f"{where}/{k}")
    elif isinstance(state, torch.Tensor) and state.device.type != device.type:
        raise AssertionError(f"{where}: loaded onto {state.device}, expected {device}")


def plain_state(device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    big = torch.randn(1024, 1024, generator=g)
    return {
        "fp32": big.to(device),
        "bf16": torch.randn(333, 257, generator=g).to(device, torch.bfloat16),
        "fp16": torch.randn(64, 3, generator=g).to(device, torch.float16),
        "int64": torch.randint(-(2**40), 2**40, (4096,), generator=g).to(device),
        "bool": (torch.rand(100, generator=g) > 0.5).to(device),
        "scalar": torch.tensor(3.5, device=device),
        "strided": big.to(device)[::2, 1::3],  # stored as its projection
        "nested": {"step": 17, "lr": 3e-4, "w": torch.arange(10.0, device=device)},
    }


def empty_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype, device=state.device)
    return None if not isinstance(state, (int, float)) else type(state)(0)


def _expect(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    return out


def _load_plain(path: Path, device: torch.device, expect: dict[str, Any]) -> None:
    dest = empty_like(expect)
    dcp.load(dest, storage_reader=MultiLevelReader(path))
    on_device(dest, device)
    same(expect, dest)


# ------------------------------------------------------------------ the checks


def check_save_load(root: Path, device: torch.device) -> str:
    sd = plain_state(device)
    dcp.save(sd, storage_writer=MultiLevelWriter(root / "sync"), planner=BalancedSavePlanner())
    _load_plain(root / "sync", device, _expect(sd))
    return f"{len(sd)} values, 7 dtypes/layouts, loaded onto {device.type}"


def check_codec(root: Path, device: torch.device) -> str:
    sd = plain_state(device)
    dcp.save(sd, storage_writer=MultiLevelWriter(root / "bg", codec="bytegroup"))
    _load_plain(root / "bg", device, _expect(sd))
    return "codec=bytegroup"


def check_async(root: Path, device: torch.device) -> str:
    sd = plain_state(device)
    expect = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _expect(sd).items()}
    writer = MultiLevelWriter(root / "async")
    fut = dcp.async_save(sd, storage_writer=writer)
    # async_save returned: the state may change now; the checkpoint holds the old values.
    sd["fp32"].add_(1.0)
    sd["bf16"].zero_()
    fut.result()
    _load_plain(root / "async", device, expect)
    pool = writer._stager.pool
    pinned = bool(pool and pool.sets and pool.sets[0].flat.is_pinned())
    return f"mutated right after async_save returned; snapshot intact; pool pinned={pinned}"


def check_manager(root: Path, device: torch.device) -> str:
    levels = [Level(str(root / "l1"), every=1, keep=2), Level(str(root / "l2"), every=2, keep=2)]
    mgr = CheckpointManager(levels)
    sd = plain_state(device)
    mgr.save(sd, step=1)
    sd["fp32"].mul_(2.0)
    mgr.save(sd, step=2)
    mgr.wait()
    mgr.close()
    dest = empty_like(_expect(sd))
    step = CheckpointManager(levels).load_latest(dest)
    if step != 2:
        raise AssertionError(f"load_latest returned step {step}, expected 2")
    on_device(dest, device)
    same(_expect(sd), dest)
    shutil.rmtree(root / "l1")  # the node-local level lost: the second level has step 2
    dest = empty_like(_expect(sd))
    step = CheckpointManager(levels).load_latest(dest)
    if step != 2:
        raise AssertionError(f"after losing level 1, load_latest returned {step}, expected 2")
    same(_expect(sd), dest)
    return "2 levels, save/wait/load_latest, then from level 2 alone"


def _fsdp_model(device: torch.device, seed: int) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = GPT(SHAPES["tiny"]).to(device)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = optimizer(model)
    return model, opt


def _fsdp(root: Path, device: torch.device, use_async: bool) -> str:
    s = SHAPES["tiny"]
    model, opt = _fsdp_model(device, seed=1)
    for step in range(2):
        forward_backward(model, batch(s, step, device))
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    expect = {"model": {k: host_bits(v).clone() for k, v in msd.items()}}
    path = root / ("fsdp-async" if use_async else "fsdp")
    state = {"model": msd, "optim": osd}
    if use_async:
        dcp.async_save(state, storage_writer=MultiLevelWriter(path)).result()
    else:
        dcp.save(state, storage_writer=MultiLevelWriter(path), planner=BalancedSavePlanner())
    kinds = {type(v).__name__ for v in msd.values()}
    # A fresh model with other weights and optimizer state, then the checkpoint.
    model2, opt2 = _fsdp_model(device, seed=2)
    forward_backward(model2, batch(s, 99, device))
    opt2.step()
    opt2.zero_grad()
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, storage_reader=MultiLevelReader(path))
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    got_m, got_o = get_state_dict(model2, opt2)
    for k, v in got_m.items():
        if not torch.equal(host_bits(v), expect["model"][k]):
            raise AssertionError(f"model/{k}: bytes differ after load")
    same(osd, got_o, "optim")
    # One more step on both gives the same weights: the state is whole.
    for m, o in ((model, opt), (model2, opt2)):
        forward_backward(m, batch(s, 2, device))
        o.step()
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        if not torch.equal(host_bits(a), host_bits(b)):
            raise AssertionError(f"after one more step, model/{k} differs")
    return f"fully_shard model+AdamW ({', '.join(sorted(kinds))}), a step after load matches"


def check_fsdp2(root: Path, device: torch.device) -> str:
    return _fsdp(root, device, use_async=False)


def check_fsdp2_async(root: Path, device: torch.device) -> str:
    return _fsdp(root, device, use_async=True)


def check_cli(root: Path, device: torch.device) -> str:
    ckpt = root / "sync"
    if not ckpt.exists():
        check_save_load(root, device)
    cli = [sys.executable, "-m", "dcp_multilevel"]
    done = []
    for args in (["verify", str(ckpt)], ["inspect", str(ckpt)]):
        r = subprocess.run(cli + args, check=False, capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise AssertionError(f"{' '.join(args[:1])}: rc {r.returncode}: {r.stderr[-500:]}")
        done.append(args[0])
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return ", ".join(done) + " (convert skipped: no safetensors)"
    out = root / "sync.safetensors"
    args = ["convert", str(ckpt), str(out), "--to", "safetensors", "--skip-non-tensors"]
    r = subprocess.run(cli + args, check=False, capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise AssertionError(f"convert: rc {r.returncode}: {r.stderr[-500:]}")
    from safetensors.torch import load_file

    got = load_file(out)
    want = _expect(plain_state(torch.device("cpu")))
    if not torch.equal(host_bits(got["fp32"]), host_bits(want["fp32"])):
        raise AssertionError("convert: fp32 differs")
    return ", ".join(done) + ", convert --to safetensors"


CHECKS: dict[str, Callable[[Path, torch.device], str]] = {
    "save/load (dcp.save, BalancedSavePlanner)": check_save_load,
    "save/load, bytegroup codec": check_codec,
    "dcp.async_save, state changed after return": check_async,
    "CheckpointManager, 2 levels": check_manager,
    "FSDP2 DTensor + AdamW, dcp.save": check_fsdp2,
    "FSDP2 DTensor + AdamW, dcp.async_save": check_fsdp2_async,
    "CLI verify/inspect/convert": check_cli,
}


def run_all(root: Path, device: torch.device) -> list[dict[str, Any]]:
    results = []
    for name, fn in CHECKS.items():
        t0 = time.perf_counter()
        try:
            detail, ok = fn(root, device), True
        except (KeyboardInterrupt, SystemExit):
            raise
        # DCP's CheckpointException derives from BaseException.
        except BaseException as e:  # noqa: BLE001 - every check reports, none stops the run
            detail, ok = f"{type(e).__name__}: {e}", False
            traceback.print_exc()
        results.append(
            {"check": name, "ok": ok, "detail": detail, "s": round(time.perf_counter() - t0, 2)}
        )
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return results
