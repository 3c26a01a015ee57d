"""``gpu_check.py``'s benchmark: how much a save every N steps lengthens training.

One round runs the same training loop once per method, in rotated order:
``none`` (no saves), ``ours`` (``dcp.async_save`` with a
:class:`~dcp_multilevel.MultiLevelWriter`), ``ours-overlap`` (the same with
``StagingConfig(overlap=True)``: copies on a background thread; the loop
waits for ``staging_completion`` before the next optimizer step),
``ours-process`` (the same, written by DCP's daemon process,
``AsyncCheckpointerType.PROCESS``, from buffers in shared memory: no
background thread in the training process but the copies'),
``ours-devsnap`` (the same with ``device_snapshot_bytes`` for the whole
state: the fence waits for a copy within the GPU, the copy to the host runs
after it), ``ours-nocopy`` (``StagingConfig(overlap=True, budget_bytes=0)``: no copy;
the tensors are written from the live state while forward and backward
run, and ``staging_completion`` is done once they are written), ``manager``
(``CheckpointManager(async_save=True)``, one level; a save in flight is
finished by the next, so at most one is written at a time), ``stock`` (``dcp.async_save`` with
``FileSystemWriter``, DCP's default staging) and ``stock-best``
(``FileSystemWriter`` with ``DefaultStager(StagingOptions(pinned, not shared,
async staging, non-blocking copies))``, reused across saves, a fresh one per
save on torch 2.11 and 2.12, pytorch/pytorch#183413; the loop waits for its
``staging_completion`` before the next optimizer step, the fence
torchtitan's ``maybe_wait_for_staging`` keeps). Both writers use one thread
and fsync, as their defaults do. Ours saves with ``BalancedSavePlanner`` (it
caches its plan), stock's best with ``DefaultSavePlanner(enable_plan_caching=True)``,
stock's default with DCP's default planner: the plan is Python that runs on
the save's background thread, beside the training thread.

A step is forward, backward and the optimizer step of the model in
``_gpt.py``, then a device synchronize (as a loss printout would do). Its
time includes the ``async_save`` call of a step that saves. Saves at steps 1, 1 +
N, ...: each has steps after it to slow down. Inflation per save = (the
loop's time - the ``none`` loop's time in the same round) / saves; as a
percentage, of the N steps between saves. CPU per save = (the machine's
busy CPU seconds over the loop and until its saves are durable - the same
for the ``none`` loop) / saves: what the saves cost the cores, kernel
included; on a machine whose cores training keeps busy, inflation cannot
be much below it.
After each loop, untimed: wait for the saves to be durable, note memory,
delete the checkpoints.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import resource
import shutil
import statistics
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from _disk import tree_files
from _gpt import GPT, SHAPES, batch, forward_backward, optimizer
from _measure import machine_busy_s, median
from dcp_multilevel import (
    BalancedSavePlanner,
    CheckpointManager,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
    StagingConfig,
)
from dcp_multilevel.staging import registered_bytes

METHODS = (
    "none",
    "ours",
    "ours-overlap",
    "ours-devsnap",
    "ours-process",
    "ours-nocopy",
    "manager",
    "stock",
    "stock-best",
)
# Left out unless named: on CUDA the no-copy mode writes device tensors item by
# item behind its fence; PROCESS mode cost a save 0.5 s more than THREAD on the
# lent H100 (DCP pickles the staged state for its daemon on the training side);
# on CPU the daemon process's start-up is most of a tiny run, and a device snapshot
# has no device.
NOT_BY_DEFAULT = {"cuda": ("ours-nocopy", "ours-process"), "cpu": ("ours-process", "ours-devsnap")}
# torch 2.11 and 2.12 close a DefaultStager at the end of each staging, so a reused
# one fails from its second save on (pytorch/pytorch#183413): stock's best then
# gets a fresh stager per save, which is what those versions keep anyway.
_STAGER_REUSABLE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pinned_bytes() -> int | None:
    """Pinned bytes: the CUDA caching host allocator's and our staging sets' (page-locked
    outside it, ``staging/buffers.py``); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.host_memory_stats()
    held = int(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)))
    return held + registered_bytes()


def state_nbytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(state_nbytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


class Trainer:
    """The model, its optimizer and the state dict a save takes (live references)."""

    def __init__(self, size: str, device: torch.device) -> None:
        self.shape = SHAPES[size]
        self.device = device
        torch.manual_seed(0)
        self.model = GPT(self.shape).to(device)
        self.opt = optimizer(self.model)
        self.step_no = 0
        self.step(None)  # the optimizer state exists from here on

    def state(self) -> dict[str, Any]:
        return {"model": dict(self.model.state_dict()), "optim": self.opt.state_dict()}

    def step(self, fence: Future | None) -> None:
        forward_backward(self.model, batch(self.shape, self.step_no, self.device))
        if fence is not None:  # the staged copy must be taken before the weights change
            fence.result()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        _sync(self.device)


class Method:
    """One way of saving; ``save`` returns (staging fence or None, durable future)."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root
        self.writer = MultiLevelWriter(root) if name == "ours" else None
        if name == "ours-overlap":  # copies behind the fence, as stock's best
            self.writer = MultiLevelWriter(root, staging=StagingConfig(overlap=True))
        if name == "ours-devsnap":  # the whole state copied on the GPU first
            staging = StagingConfig(overlap=True, device_snapshot_bytes=1 << 40)
            self.writer = MultiLevelWriter(root, staging=staging)
        if name == "ours-process":
            staging = StagingConfig(overlap=True, shared_memory=True)
            self.writer = MultiLevelWriter(root, staging=staging)
        if name == "ours-nocopy":  # writes from the live state behind the fence
            staging = StagingConfig(overlap=True, budget_bytes=0)
            self.writer = MultiLevelWriter(root, staging=staging)
        # CheckpointManager(async_save=True) on one level (its retention keeps 2).
        level = Level(str(root / "level"), every=1, keep=2)
        self.manager = CheckpointManager([level], async_save=True) if name == "manager" else None
        # On CPU, stock's best is async staging alone (pinning and non-blocking
        # copies need an accelerator).
        gpu = torch.cuda.is_available()
        self.opts = StagingOptions(gpu, False, True, gpu)
        self.stager = DefaultStager(self.opts) if name == "stock-best" else None
        # Each side's planner as its users are told to save: ours the balanced one
        # (it caches its plan), stock's best with DCP's plan caching, stock's
        # default with its default planner.
        self.planner: SavePlanner | None = None
        if name.startswith("ours"):
            self.planner = BalancedSavePlanner()
        elif name == "stock-best":
            self.planner = DefaultSavePlanner(enable_plan_caching=True)
        self.n = 0

    def save(self, state: dict[str, Any]) -> tuple[Future | None, Future | None]:
        self.n += 1
        path = self.root / f"step-{self.n}"
        if self.manager is not None:  # commits in the background; finished by the next call
            self.manager.save(state, step=self.n)
            return None, None
        if self.name == "ours":
            fut = dcp.async_save(
                state, storage_writer=self.writer, checkpoint_id=path, planner=self.planner
            )
            return None, fut
        if self.name in ("ours-overlap", "ours-devsnap", "ours-nocopy", "ours-process"):
            kind = AsyncCheckpointerType.PROCESS if self.name == "ours-process" else None
            r = dcp.async_save(
                state,
                storage_writer=self.writer,
                checkpoint_id=path,
                planner=self.planner,
                **({"async_checkpointer_type": kind} if kind else {}),
            )
            return r.staging_completion, r.upload_completion
        w = FileSystemWriter(path)
        if self.name == "stock":
            return None, dcp.async_save(state, storage_writer=w)
        if not _STAGER_REUSABLE and self.n > 1:
            self.stager = DefaultStager(self.opts)
        r = dcp.async_save(state, storage_writer=w, async_stager=self.stager, planner=self.planner)
        return r.staging_completion, r.upload_completion

    def finish(self) -> None:
        """After a loop (untimed): the manager's last save committed and finished."""
        if self.manager is not None:
            self.manager.finish_save()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.manager is not None:
            self.manager.close()


def _settle(fence: Future | None, fut: Future | None) -> None:
    for f in (fence, fut):
        if f is not None:
            f.result()


def run_loop(tr: Trainer, method: Method | None, steps: int, every: int) -> dict[str, Any]:
    blocked, durable, pending, step_s = [], [], [], []
    fence: Future | None = None
    busy0 = machine_busy_s()
    t_loop = t_step = time.perf_counter()
    for i in range(1, steps + 1):
        tr.step(fence)
        fence = None
        now = time.perf_counter()
        step_s.append(now - t_step)  # this step, and the save after its last one's
        t_step = now
        if method is not None and (i - 1) % every == 0:  # each save has steps after it
            t0 = time.perf_counter()
            fence, fut = method.save(tr.state())
            blocked.append(time.perf_counter() - t0)
            if fut is not None:
                fut.add_done_callback(lambda _, t0=t0: durable.append(time.perf_counter() - t0))
                pending.append(fut)
    if fence is not None:
        fence.result()
    loop_s = time.perf_counter() - t_loop
    for fut in pending:
        fut.result()
    if method is not None:
        method.finish()
    busy1 = machine_busy_s()
    time.sleep(0.01)  # the done callbacks ran on the saving threads
    return {
        "loop_s": loop_s,
        # The loop's and its saves' CPU, until the last save is durable.
        "busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
        "saves": len(blocked),
        "step_s": step_s,
        "blocked": blocked,
        "durable": list(durable),
        "rss": rss(),
        "pinned": pinned_bytes(),
    }


def bench_steps(
    size: str,
    device: torch.device,
    root: Path,
    rounds: int,
    steps: int,
    every: int,
    deadline: float,
    only: tuple[str, ...] = METHODS,
) -> dict[str, Any]:
    """``only``: the methods to run (``none``, the baseline, always runs)."""
    names = tuple(m for m in METHODS if m == "none" or m in only)
    tr = Trainer(size, device)
    nbytes = state_nbytes(tr.state())
    print(f"  state: {nbytes / GB:.2f} GB ({size}); warm-up", flush=True)
    for _ in range(3):
        tr.step(None)
    methods = {m: Method(m, root / m) for m in names if m != "none"}
    errors: dict[str, str] = {}
    # First saves pay one-time costs (pools, threads), untimed: two. Ours make the
    # second while the first is written, as the loop's saves overlap (it takes the
    # second buffer set: pinning 4 GB took seconds on the lent H100). Stock's one
    # after the other: DCP's plan cache is a class-level dict that two saves in
    # flight race on (KeyError: 'DefaultSavePlanner', seen here once in a CI run).
    for name, m in methods.items():
        try:
            saves = []
            for _ in range(2):
                saves.append(m.save(tr.state()))
                if m.writer is None:
                    _settle(*saves[-1])
            for fence, fut in saves:
                _settle(fence, fut)
            m.finish()
        except (KeyboardInterrupt, SystemExit):
            raise
        # DCP's CheckpointException derives from BaseException.
        except BaseException as e:  # noqa: BLE001 - a failing method is reported, the others run
            errors[name] = f"{type(e).__name__}: {e}"
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    done_rounds = 0
    for r in range(rounds):
        if time.monotonic() > deadline:
            print(f"  time budget reached after {r} rounds", flush=True)
            break
        order = names[r % len(names) :] + names[: r % len(names)]
        for m in order:
            if m in errors:
                continue
            try:
                rows[m].append(run_loop(tr, methods.get(m), steps, every))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - as above
                errors[m] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            for p in (root / m).glob("step-*"):  # the manager's level keeps its own 2
                shutil.rmtree(p, ignore_errors=True)
        done_rounds += 1
        ran = [m for m in order if m not in errors]
        print(f"  round {r + 1}: " + ", ".join(f"{m} {rows[m][-1]['loop_s']:.2f}s" for m in ran))
    for m in methods.values():
        m.close()
    for m, e in errors.items():
        print(f"  {m} FAILED: {e}", flush=True)
    return {
        "state_bytes": nbytes,
        "errors": errors,
        "rounds": done_rounds,
        "steps": steps,
        "every": every,
        "loops": rows,  # every loop's step times, for a look at where a save's cost lands
        **_table(rows, steps, every),
    }


def _after_save(got: list[dict[str, Any]], base: list[dict[str, Any]], every: int) -> list[float]:
    """Median extra seconds of the k-th step after a save (k = 1..every), against
    the same step of the same round's loop without saves: where a save's cost
    lands (its own call at k = 1, the fence, the background write after)."""
    extra: list[list[float]] = [[] for _ in range(every)]
    for g, b in zip(got, base, strict=False):
        for s in range(0, len(g["step_s"]), every):  # saves after steps 1, 1 + every, ...
            for k in range(1, every + 1):
                if s + k < len(g["step_s"]):
                    extra[k - 1].append(g["step_s"][s + k] - b["step_s"][s + k])
    return [median(x) for x in extra]


def _table(rows: dict[str, list[dict[str, Any]]], steps: int, every: int) -> dict[str, Any]:
    base = rows["none"]
    step_s = median([b["loop_s"] / steps for b in base])
    out: dict[str, Any] = {"step_s": step_s, "methods": {}}
    for m in METHODS[1:]:
        got = rows.get(m, [])
        infl = [
            (g["loop_s"] - b["loop_s"]) / g["saves"]
            for g, b in zip(got, base, strict=False)
            if g["saves"]
        ]
        if not got:
            continue
        cpu = [
            (g["busy_s"] - b["busy_s"]) / g["saves"]
            for g, b in zip(got, base, strict=False)
            if g["saves"] and g.get("busy_s") is not None and b.get("busy_s") is not None
        ]
        out["methods"][m] = {
            "cpu_per_save_s": median(cpu) if cpu else None,
            "inflation_s": median(infl),
            "inflation_spread": [min(infl), max(infl)] if infl else None,
            "inflation_pct": 100 * median(infl) / (step_s * (steps / max(got[0]["saves"], 1)))
            if got and infl
            else None,
            "after_save_s": _after_save(got, base, every),
            "blocked_s": median([x for g in got for x in g["blocked"]]),
            "durable_s": median([x for g in got for x in g["durable"]]),
            "rss_gb": max(g["rss"] for g in got) / GB if got else None,
            "pinned_gb": (max(g["pinned"] or 0 for g in got) / GB) if got else None,
        }
    return out


def file_read_gbps(root: Path, threads: int, pinned: bool, piece: int = 64 << 20) -> float:
    """GB/s of reading every file under ``root`` into one host buffer (page-locked
    when ``pinned``) with ``threads`` threads, 64 MiB a read: no checksum and no
    copy to the device, so the most a load from these files could reach here."""
    files = sorted(tree_files(root))
    total = sum(p.stat().st_size for p in files)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pinned).numpy()
    jobs, at = [], 0
    for p in files:
        size = p.stat().st_size
        jobs += [(p, off, at + off, min(piece, size - off)) for off in range(0, size, piece)]
        at += size

    def read(job: tuple[Path, int, int, int]) -> None:
        path, off, dst, n = job
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(buf[dst : dst + n])], off)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(read, jobs))
    return total / (time.perf_counter() - t0) / GB


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """GB/s of one pinned host-to-device copy of ``nbytes`` (median of 5)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / GB


def _profile_load(tr: Trainer, device: torch.device, reader: Any, top: int = 25) -> str:
    """One more load of ours (untimed) under cProfile: the functions that took the
    most time, all threads' calls seen from the loading thread. Kept in the
    report: earlier loads into CUDA ran at 4 % of the pinned bandwidth for
    a reason no timing could name."""
    dest = tr.state()
    prof = cProfile.Profile()
    prof.enable()
    dcp.load(dest, storage_reader=reader())
    _sync(device)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def bench_flat(size: str, device: torch.device, root: Path, saves: int, deadline: float) -> dict:
    """The memory check: ``saves`` async saves with ``overlap=True``, one after
    each training step, at most two in flight (each waits for the one before the
    last to be durable), and after each the process's RSS, the CUDA host
    allocator's pinned bytes and the staging pool's. Flat: none of them higher
    after the last save than after the second (both buffer sets taken); and the
    pool holds nothing after ``close()``. Stops early at ``deadline``."""
    tr = Trainer(size, device)
    writer = MultiLevelWriter(root, staging=StagingConfig(overlap=True))
    planner = BalancedSavePlanner()
    rows: list[dict[str, Any]] = []
    pending: list[tuple[int, Future]] = []
    fence: Future | None = None
    for i in range(saves):
        if i > 2 and time.monotonic() > deadline:
            break
        tr.step(fence)
        r = dcp.async_save(
            tr.state(), storage_writer=writer, checkpoint_id=root / f"step-{i}", planner=planner
        )
        fence = r.staging_completion
        pending.append((i, r.upload_completion))
        if len(pending) > 1:
            j, fut = pending.pop(0)
            fut.result()
            shutil.rmtree(root / f"step-{j}", ignore_errors=True)
        pool = writer.staging_pool
        rows.append({"rss": rss(), "pinned": pinned_bytes(), "pool": pool.held_bytes})
    if fence is not None:
        fence.result()
    for _, fut in pending:
        fut.result()
    pool = writer.staging_pool
    allocated = pool.allocated_total
    writer.close()
    closed = {"rss": rss(), "pinned": pinned_bytes(), "pool": pool.held_bytes}
    shutil.rmtree(root, ignore_errors=True)
    flat = (
        len(rows) > 2
        and all(
            (rows[-1][k] or 0) <= (rows[1][k] or 0) * 1.01 + (64 << 20) for k in ("rss", "pinned")
        )
        and rows[-1]["pool"] == rows[1]["pool"]
    )
    return {"saves": rows, "closed": closed, "allocated": allocated, "flat": flat}


def bench_load(size: str, device: torch.device, root: Path, repeats: int) -> dict[str, Any]:
    """Synchronous saves from device tensors, then loads into device destinations,
    ours against stock's writer and reader, alternating."""
    tr = Trainer(size, device)
    state = tr.state()
    nbytes = state_nbytes(state)
    saves: dict[str, list[float]] = {"ours": [], "stock": []}
    for r in range(2):  # the last save of each is what the loads read
        for name in ("ours", "stock") if r == 0 else ("stock", "ours"):
            path = root / name
            shutil.rmtree(path, ignore_errors=True)
            w = MultiLevelWriter(path) if name == "ours" else FileSystemWriter(path)
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=w)
            saves[name].append(time.perf_counter() - t0)
    readers: dict[str, Any] = {"ours": lambda: MultiLevelReader(root / "ours")}
    for n in sorted({4, min(16, os.cpu_count() or 1)} - {1}):
        readers[f"ours, {n} threads"] = lambda n=n: MultiLevelReader(root / "ours", thread_count=n)
    readers["stock"] = lambda: FileSystemReader(root / "stock")
    times: dict[str, list[float]] = {k: [] for k in readers}
    names = list(readers)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dest = tr.state()  # live device tensors: loaded in place
            _sync(device)
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=readers[name]())
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    profile = _profile_load(tr, device, lambda: MultiLevelReader(root / "ours"))
    ceiling = {
        n: file_read_gbps(root / "ours", n, pinned=device.type == "cuda") for n in (1, 4, 16)
    }
    shutil.rmtree(root, ignore_errors=True)

    def table(rows: dict[str, list[float]]) -> dict[str, Any]:
        return {
            k: {"s": median(v), "gbps": nbytes / median(v) / GB, "all_s": v}
            for k, v in rows.items()
        }

    return {
        "state_bytes": nbytes,
        "profile": profile,
        "h2d_pinned_gbps": h2d_bandwidth(device),
        "file_read_gbps": ceiling,
        "save": table(saves),
        "load": table(times),
    }
