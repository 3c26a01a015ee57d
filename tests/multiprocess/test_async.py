"""Async saves through MultiLevelWriter's buffer pool, on real gloo ranks.

Each scenario runs in processes of its own (``_dist.run_ranks``): PROCESS mode
needs a process group, and RSS figures need a process of their own.

* snapshot: mutate every tensor right after ``async_save`` returns, three saves
  in a row (so one is written while the next stages); each checkpoint holds the
  values of its own step, bit for bit (THREAD and PROCESS, 1 and 2 ranks).
* RSS: 20 saves; the pool allocates nothing after the second, RSS after the
  3rd and the 20th agree within 5%.
* budget: a state larger than the budget saves in two waves (the largest
  tensors that fit are staged, the rest written first from the live state) and
  loads bit-exact after every tensor was mutated; the pool stays within the
  budget and the RSS high-water mark grows by less than budget + one chunk.
* failure: a background write fails; the future raises, the next call raises
  AsyncSaveError once, no manifest appears, and the call after that commits.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import resource
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from _gate import GatedPlanner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_multilevel import ConfigError, MultiLevelReader, MultiLevelWriter, StagingConfig
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.errors import AsyncSaveError, SaveInFlightError
from dcp_multilevel.format import MANIFEST_NAME
from dcp_multilevel.format.tensor_bytes import PIECE_BYTES
from dcp_multilevel.staging.buffers import (
    ALIGN,
    HostBufferPool,
    iter_tensors,
    select_wave,
    staged_nbytes,
)
from dcp_multilevel.staging.copies import copy_into
from dcp_multilevel.stores import _direct

pytestmark = pytest.mark.multiprocess

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def _state(seed: int, scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    out: dict = {"step": seed, "opt": {"lr": 0.1 * seed}}
    for i, dt in enumerate(DTYPES):
        raw = torch.randint(
            0, 256, (scale * 4096 * dt.itemsize + i,), generator=g, dtype=torch.uint8
        )
        n = raw.numel() // dt.itemsize
        out[f"w{i}"] = raw[: n * dt.itemsize].view(dt).reshape(n)
    out["opt"]["m"] = torch.randn(64, 33, generator=g)
    out["scalar"] = torch.tensor(float(seed))
    return out


def _tensors(sd: dict):
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from _tensors(v)


def _mutate(sd: dict) -> None:
    """What a training step does: change every tensor in place (and the counters)."""
    for t in _tensors(sd):
        t.view(-1).view(torch.uint8).bitwise_not_()
    sd["step"] = -1
    if "opt" in sd:
        sd["opt"]["lr"] = -1.0


def _clone(sd: dict) -> dict:
    """A byte-exact copy (``clone()`` would normalize bool bytes other than 0 and 1)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _clone(v)
        elif isinstance(v, torch.Tensor):
            raw = v.reshape(-1).view(torch.uint8).clone()
            out[k] = raw.view(v.dtype).reshape(v.shape)
        else:
            out[k] = v
    return out


def _load(path: Path, like: dict) -> dict:
    out = _clone(like)
    for t in _tensors(out):
        t.zero_()
    dcp.load(out, storage_reader=MultiLevelReader(path))
    return out


def _assert_same(actual: dict, expected: dict, what: str) -> None:
    for k, v in expected.items():
        a = actual[k]
        if isinstance(v, dict):
            _assert_same(a, v, f"{what}.{k}")
        elif isinstance(v, torch.Tensor):
            assert a.dtype == v.dtype and a.shape == v.shape, f"{what}.{k}"
            assert torch.equal(a.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), (
                f"{what}.{k}: bytes differ"
            )
        else:
            assert a == v, f"{what}.{k}: {a!r} != {v!r}"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _setup_daemon_env() -> None:
    # DCP's PROCESS executor rendezvous through MASTER_ADDR (no resolvable host name here).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # run_ranks starts ranks as daemonic processes, which may not start children;
    # DCP's PROCESS executor starts one (itself daemonic: it dies with the rank).
    multiprocessing.current_process().daemon = False


# --------------------------------------------------------------------------- snapshot


def _snapshot_job(rank: int, world: int, root: str, mode: str) -> int:
    _setup_daemon_env()
    kind = AsyncCheckpointerType[mode]
    writer = MultiLevelWriter(Path(root) / "unused")
    sd = _state(1000)  # replicated (data parallel): DCP dedups equal FQNs across ranks
    expected, futures = [], []
    for step in range(3):
        for t in _tensors(sd):  # a new step's values, same tensors
            t.view(-1).view(torch.uint8).add_(step + 1)
        sd["step"] = step
        sd["opt"]["lr"] = 0.5 * step
        expected.append(_clone(sd))
        futures.append(
            dcp.async_save(
                sd,
                storage_writer=writer,
                checkpoint_id=Path(root) / f"s{step}",
                async_checkpointer_type=kind,
            )
        )
        _mutate(sd)  # right after async_save returns
    for f in futures:
        f.result()
    pool = writer.staging_pool
    assert len(pool.sets) <= 2 and pool.peak_bytes <= 2 * pool.sets[0].capacity
    dist.barrier()
    for step in range(3):
        got = _load(Path(root) / f"s{step}", expected[step])
        _assert_same(got, expected[step], f"rank {rank} step {step}")
    return rank


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["THREAD", "PROCESS"])
def test_staged_copy_is_the_step_it_was_taken_at(tmp_path, mode, world):
    assert run_ranks(_snapshot_job, world, str(tmp_path), mode, timeout=240) == list(range(world))


# --------------------------------------------------------------------------- RSS


def _rss_job(rank: int, world: int, root: str) -> dict:
    sd = {f"p{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB
    writer = MultiLevelWriter(Path(root) / "c", overwrite=True, sync_files=False)
    rss, allocated, fut = {}, [], None
    for n in range(1, 21):
        fut = dcp.async_save(sd, storage_writer=writer)
        for t in sd.values():
            t.mul_(1.0001)
        if n in (3, 20):
            fut.result()
            rss[n] = _rss()
        allocated.append(writer.staging_pool.allocated_total)
    fut.result()
    return {"rss": rss, "allocated": allocated}


def test_twenty_async_saves_keep_memory_flat(tmp_path):
    (res,) = run_ranks(_rss_job, 1, str(tmp_path), timeout=240)
    allocated = res["allocated"]
    assert allocated[1] == allocated[-1], f"pool allocated after the 2nd save: {allocated}"
    assert allocated[-1] <= 2 * (64 << 20) + 16 * 64
    r3, r20 = res["rss"][3], res["rss"][20]
    assert abs(r20 - r3) <= 0.05 * r3, (
        f"RSS after save 3: {r3 >> 20} MiB, after 20: {r20 >> 20} MiB"
    )


# --------------------------------------------------------------------------- budget


def _budget_job(rank: int, world: int, root: str, budget: int) -> dict:
    sd = {f"p{i}": torch.randn(1 << 20) for i in range(12)}  # 48 MiB, 4 MiB each
    sd["step"] = 12
    expected = _clone(sd)
    writer = MultiLevelWriter(
        Path(root) / "big", sync_files=False, staging=StagingConfig(budget_bytes=budget)
    )
    # Warm up everything a first save pulls in (imports, threads) with a tiny state.
    dcp.async_save(
        {"x": torch.ones(4)}, storage_writer=writer, checkpoint_id=Path(root) / "w"
    ).result()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=Path(root) / "big")
    _mutate(sd)
    fut.result()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    _assert_same(_load(Path(root) / "big", expected), expected, "over budget")
    # PROCESS mode would have to ship the live tensors to DCP's daemon: refused,
    # before they are moved into shared memory.
    _setup_daemon_env()
    fut = dcp.async_save(
        sd,
        storage_writer=writer,
        checkpoint_id=Path(root) / "process",
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    with pytest.raises(ConfigError) as err:
        fut.result()
    assert str(err.value) == (
        "this state does not fit the staging budget and is written through from the live "
        "tensors, which needs AsyncCheckpointerType.THREAD; with PROCESS the whole staged "
        "copy must fit: raise StagingConfig(budget_bytes=...)"
    )
    assert not any(t.is_shared() for t in _tensors(sd))
    assert not (Path(root) / "process" / MANIFEST_NAME).exists()
    return {"grown": grown, "allocated": writer.staging_pool.allocated_total}


def test_state_larger_than_budget_saves_within_budget(tmp_path):
    budget = 8 << 20
    (res,) = run_ranks(_budget_job, 1, str(tmp_path), budget, timeout=180)
    # Two waves: one 4 MiB tensor staged, the other 44 MiB written from the live state.
    assert 4 << 20 < res["allocated"] <= budget
    assert res["grown"] <= budget + PIECE_BYTES, f"peak RSS grew by {res['grown'] >> 20} MiB"


class _Save:
    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


def test_pool_reuses_two_sets_within_its_budget():
    pool = HostBufferPool(3000, pin=False, shared=False)
    a = pool.try_acquire(1000)
    a.owner = first = _Save()
    b = pool.try_acquire(1000)
    b.owner = second = _Save()
    assert b is not a and pool.try_acquire(10) is None  # two sets, both busy
    first.finished = True
    assert pool.try_acquire(900) is a  # reused, not reallocated
    assert pool.allocated_total == 2000
    second.finished = True
    a.owner = None
    # Bigger than both free sets: they are freed first, so the budget holds.
    c = pool.try_acquire(2500)
    assert [s.capacity for s in pool.sets] == [2500] and c.capacity == 2500
    assert pool.peak_bytes <= 3000 and not pool.fits(3001)


def test_over_budget_wave_stages_the_largest_tensors_that_fit():
    sd = {"a": torch.ones(100), "b": {"c": torch.ones(300), "d": [torch.ones(50)]}, "n": 3}
    a, c, d = sd["a"], sd["b"]["c"], sd["b"]["d"][0]
    ids, nbytes = select_wave(iter_tensors(sd), 1200 + 400 + 2 * ALIGN)  # c (1200 B) and a (400 B)
    assert ids == {id(c), id(a)} and nbytes <= 1200 + 400 + 2 * ALIGN
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    staged = copy_into(sd, flat, only=ids)
    assert staged["b"]["d"][0] is d  # left live
    assert staged["a"] is not a and staged["b"]["c"] is not c
    a.add_(1)
    c.add_(1)
    assert staged["a"].eq(1).all() and staged["b"]["c"].eq(1).all()
    assert staged["a"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert select_wave(iter_tensors(sd), ALIGN) == (set(), 0)  # nothing fits: all live


# The buffer alone, or a slice of a bigger allocation, as a pinned set is (buffers.py:
# page-aligned); its neighbours' bytes must stay as they were.
@pytest.mark.parametrize("lead", [0, 4096], ids=["own", "slice"])
def test_every_layout_is_staged_contiguous_in_the_buffer_with_its_bytes(lead):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    raw_bool = torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8)
    sd = {
        "transposed": base.t(),
        "stepped": base[:, ::3],
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "size_one_dims": base[:1, 2:3].unsqueeze(0),  # odd strides on size-1 dims
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "bool_bytes": raw_bool.view(torch.bool).reshape(5, 8),  # bytes other than 0 and 1
        "complex": torch.randn(7, generator=g, dtype=torch.complex64),
        "conj": torch.randn(5, generator=g, dtype=torch.complex128).conj(),
        "half": torch.randn(3, 3, generator=g).half(),
        # Copied as typed values in one batch: the bits must still be the bits.
        "signaling_nan": torch.tensor([0x7FA00001, 0x7F800001], dtype=torch.int32).view(
            torch.float32
        ),
        "bf16_nan": torch.tensor([0x7F81, -1], dtype=torch.int16).view(torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(4, 4, generator=g)),  # needs grad
    }
    n = staged_nbytes(iter_tensors(sd))
    backing = torch.full((lead + n + lead,), 7, dtype=torch.uint8)
    flat = backing[lead : lead + n]
    staged = copy_into(sd, flat)
    assert backing[:lead].eq(7).all() and backing[lead + n :].eq(7).all()
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
    for k, src in sd.items():
        got = staged[k]
        assert got.dtype == src.dtype and got.shape == src.shape and got.is_contiguous(), k
        if got.numel():  # an empty tensor has no address
            assert lo <= got.data_ptr() and got.data_ptr() + got.nbytes <= hi, k
            assert got.data_ptr() % ALIGN == 0, k
        want = src.resolve_conj().contiguous()
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), k


def test_a_buffer_set_lays_out_the_same_state_again_with_the_same_views(tmp_path):
    """The places of a state's tensors in a buffer set are kept from one save to
    the next (making them is torch calls that cost training time through the
    GIL); a tensor of another shape, and those it moves, get new ones."""
    writer = MultiLevelWriter(tmp_path / "unused")
    sd = {"a": torch.randn(100), "b": torch.arange(40), "c": {"d": torch.ones(3, 3)}}

    def save(step: int) -> dict:
        path = tmp_path / f"s{step}"
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=path).result()
        back = {
            "a": torch.zeros(100),
            "b": torch.zeros_like(sd["b"]),
            "c": {"d": torch.zeros(3, 3)},
        }
        dcp.load(back, storage_reader=MultiLevelReader(path))
        assert all(torch.equal(back[k], sd[k]) for k in ("a", "b")), step
        assert torch.equal(back["c"]["d"], sd["c"]["d"]), step
        (buffers,) = writer.staging_pool.sets
        return buffers.views.laid_out()

    first = save(0)
    sd["a"].add_(1.0)
    sd["c"]["d"].mul_(3.0)
    second = save(1)
    assert len(second) == 3 and all(second[k] is first[k] for k in first)
    sd["b"] = torch.arange(10)  # another shape, and "d" after it moves (same buffer set)
    third = save(2)
    kept = [k for k in third if k in first and third[k] is first[k]]
    assert len(third) == 3 and len(kept) == 1  # only "a", before it, is kept


def test_kept_views_are_the_last_saves_and_go_with_their_buffer():
    # The mechanism both the host buffer sets and the device snapshot use.
    from dcp_multilevel.staging.buffers import KeptViews

    buf = torch.zeros(64)
    kept = KeptViews()
    made = []

    def make(i):
        return lambda: made.append(i) or buf[i : i + 4]

    kept.begin()
    first = [kept.get(("cpu", i), make(i)) for i in (0, 8, 16)]
    kept.begin()  # the next save: the same places come back, none is made again
    assert [kept.get(("cpu", i), make(i)) for i in (0, 8)] == first[:2] and made == [0, 8, 16]
    assert kept.get(("cpu", 32), make(32)) is not None and made[-1] == 32
    kept.begin()  # only what the last save laid out is kept: 16 is made again
    kept.get(("cpu", 16), make(16))
    assert made[-1] == 16
    kept.discard(lambda key: key[1] == 16)  # its buffer is being replaced
    kept.begin()
    kept.get(("cpu", 16), make(16))
    assert made.count(16) == 3
    kept.clear()
    assert kept.laid_out() == {}


def test_big_tensors_are_written_from_the_staging_buffer_wherever_they_sit(tmp_path):
    page = _direct.ALIGN
    g = torch.Generator().manual_seed(0)
    sd = {
        "small": torch.ones(3),
        "big": torch.randn(300_001, generator=g),  # 1.2 MB
        "odd": torch.ones(7, dtype=torch.uint8),
        "big2": torch.randint(0, 9, (270_000,), generator=g),  # 2.16 MB of int64
    }
    pool = HostBufferPool(None, pin=False, shared=False)
    flat = pool.try_acquire(staged_nbytes(iter_tensors(sd))).flat
    staged = copy_into(sd, flat)
    assert flat.numel() == staged_nbytes(iter_tensors(sd))
    shared = HostBufferPool(None, pin=False, shared=True).try_acquire(3 << 20).flat
    assert shared.is_shared() and shared.numel() == 3 << 20
    assert all(staged[k].data_ptr() % ALIGN == 0 for k in sd)  # packed, nothing at pages
    assert all(torch.equal(staged[k], sd[k]) for k in sd)

    # A save writes each big tensor as far past a block of its data file as its
    # memory is past a page: the staged copy's in the buffer (async), the live
    # tensor's (synchronous); O_DIRECT then takes its whole pages from there.
    # Small ones are packed.
    def offsets(path):
        locs = StoredCheckpoint.at(str(path)).manifest().locations
        return {i.fqn: (loc.offset, loc.length) for i, loc in locs.items()}

    direct = {"direct_io": True}  # O_DIRECT: asked for (the default writes through the cache)
    writer = MultiLevelWriter(tmp_path / "a", storage_options=direct)
    dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / "a").result()
    (buffers,) = writer.staging_pool.sets
    in_buffer = copy_into(sd, buffers.flat)  # the layout that save used (it is fixed)
    dcp.save(sd, storage_writer=MultiLevelWriter(tmp_path / "s", storage_options=direct))
    staged_at, live_at = offsets(tmp_path / "a"), offsets(tmp_path / "s")
    if _direct.available() and not _direct.memory_backed(tmp_path):
        big = ("big", "big2")
        assert all(staged_at[k][0] % page == in_buffer[k].data_ptr() % page for k in big)
        assert all(live_at[k][0] % page == sd[k].data_ptr() % page for k in big)
    order = sorted(live_at, key=lambda k: live_at[k])
    for before, k in itertools.pairwise(order):
        gap = live_at[k][0] - sum(live_at[before])
        assert gap == 0 or k in ("big", "big2"), (k, gap)
        assert gap < page
    for path in (tmp_path / "a", tmp_path / "s"):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=MultiLevelReader(path))
        assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_budget_and_policy_are_validated():
    with pytest.raises(ValueError, match='in_flight must be "wait" or "raise"'):
        StagingConfig(in_flight="queue")
    with pytest.raises(ValueError, match="budget_bytes must be None or an int >= 0"):
        StagingConfig(budget_bytes=-1)
    with pytest.raises(ValueError, match="background_nice must be an int from 0 to 19, got 20"):
        StagingConfig(background_nice=20)


class _PriorityProbe(DefaultSavePlanner):
    """Records the nice value of the thread resolving (writing) each item."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def resolve_data(self, write_item):
        self.seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().resolve_data(write_item)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is Linux-only")
@pytest.mark.parametrize("nice", [0, 12])
def test_async_write_runs_at_background_priority(tmp_path, nice):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    sd = {"w": torch.randn(1000), "b": torch.arange(10)}
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(background_nice=nice))
    probe = _PriorityProbe()
    dcp.async_save(sd, storage_writer=writer, planner=probe, checkpoint_id=tmp_path / "c").result()
    assert probe.seen == {max(base, nice)}
    # The training thread keeps its priority, and so does a synchronous save.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    probe = _PriorityProbe()
    dcp.save(sd, storage_writer=writer, planner=probe, checkpoint_id=tmp_path / "d")
    assert probe.seen == {base}


# --------------------------------------------------------------------------- in flight


def test_raise_policy_refuses_a_third_save_while_two_are_taken(tmp_path):
    sd = {"w": torch.randn(1 << 18)}
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(in_flight="raise"))
    # A staged save whose background thread never started holds its set.
    first = writer.stage(sd)
    second_blocked = None
    try:
        _pretend_running(writer)
        second_blocked = writer.stage(sd)
        _pretend_running(writer)
        with pytest.raises(SaveInFlightError) as err:
            writer.stage(sd)
        assert str(err.value) == (
            f"async save to {tmp_path / 'c'}: an earlier save with this writer is still being "
            "written (policy in_flight='raise', wait_timeout_s=3600.0); at most one save is "
            "written and one queued per writer. Wait for the returned future before saving "
            'again, or use StagingConfig(in_flight="wait").'
        )
    finally:
        _RELEASE.set()
    del first, second_blocked


_RELEASE = threading.Event()


def _pretend_running(writer: MultiLevelWriter) -> None:
    """The last staged save now runs in a background thread that blocks until released."""
    t = threading.Thread(target=_RELEASE.wait, daemon=True)
    t.start()
    writer._stager._last.thread = t


def test_saves_without_checkpoint_id_queue_one_behind_the_other(tmp_path):
    """No checkpoint_id: DCP skips reset, and storage_meta is where a save is claimed."""
    writer = MultiLevelWriter(
        tmp_path / "c", overwrite=True, staging=StagingConfig(in_flight="raise")
    )
    sd = {"w": torch.zeros(1000)}
    gate = threading.Event()
    try:
        first = dcp.async_save(sd, storage_writer=writer, planner=GatedPlanner(gate))
        sd["w"].fill_(1.0)
        # Queued while the first is still being written: its staging waited only
        # for the first save to be claimed by its background thread.
        second = dcp.async_save(sd, storage_writer=writer)
        assert not first.done() and not second.done()
        with pytest.raises(SaveInFlightError, match="is still being written"):
            writer.stage(sd)  # a third: both buffer sets are taken
    finally:
        gate.set()
    first.result()
    second.result()
    out = {"w": torch.empty(1000)}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert torch.equal(out["w"], torch.ones(1000))  # committed in order


def test_a_synchronous_save_claims_no_queued_async_save(tmp_path):
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(wait_timeout_s=0.2))
    sd = {"w": torch.arange(1000.0)}
    staged = writer.stage(sd)  # queued: DCP's thread for it has not called the writer yet
    # A synchronous save on the thread that staged it waits for it, and does not take it.
    with pytest.raises(SaveInFlightError) as err:
        dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "sync")
    assert str(err.value) == (
        f"async save to {tmp_path / 'sync'}: an earlier save with this writer did not finish "
        "in time (policy in_flight='wait', wait_timeout_s=0.2); at most one save is written "
        "and one queued per writer. Wait for the returned future before saving again, or use "
        'StagingConfig(in_flight="wait").'
    )
    assert writer._stager._last.thread is None
    # The save's own background thread takes it (what DCP's executor thread does).
    kwargs = {"storage_writer": writer, "checkpoint_id": tmp_path / "async"}
    background = threading.Thread(target=dcp.save, args=(staged,), kwargs=kwargs)
    background.start()
    background.join()
    assert writer._stager._last.thread is background
    dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "sync")
    for name in ("async", "sync"):
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=MultiLevelReader(tmp_path / name))
        assert torch.equal(out["w"], sd["w"]), name


def test_a_save_that_never_began_stops_the_next_after_wait_timeout(tmp_path):
    """DCP's thread died before its first writer call (PROCESS: its daemon did not start)."""
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(wait_timeout_s=0.2))
    sd = {"w": torch.arange(1000.0)}
    staged = writer.stage(sd)  # no thread ever claims it
    with pytest.raises(SaveInFlightError) as err:
        writer.stage(sd)
    assert str(err.value) == (
        f"async save to {tmp_path / 'c'}: an earlier async save with this writer did not "
        "begin writing within wait_timeout_s=0.2: DCP's background thread failed before its "
        "first call to the writer (in PROCESS mode: DCP's daemon process did not start). "
        "That save's future holds the error; drop the future to free its buffers, then save "
        "again."
    )
    del staged  # what dropping that save's future does
    assert writer.stage(sd)["w"].equal(sd["w"])


# --------------------------------------------------------------------------- failure


def _failure_job(rank: int, world: int, root: str, mode: str) -> str:
    _setup_daemon_env()
    kind = AsyncCheckpointerType[mode]
    ckpt = Path(root) / "c"
    if rank == 0:
        ckpt.mkdir()
        (ckpt / "data").write_text("a file where the data directory goes")
    dist.barrier()
    writer = MultiLevelWriter(ckpt)
    sd = _state(7)
    fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind)
    with pytest.raises(BaseException) as err:
        fut.result()
    assert "data" in str(err.value)
    assert not (ckpt / MANIFEST_NAME).exists()
    with pytest.raises(AsyncSaveError) as again:
        dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind)
    text = str(again.value)
    assert text.startswith(
        "the previous async save with this writer failed in the background (write_data failed "
        f"on rank {rank}: "
    ), text
    assert text.endswith(
        "); nothing of it was committed. Fix the cause and save again; this error is raised once."
    )
    dist.barrier()
    if rank == 0:
        (ckpt / "data").unlink()
    dist.barrier()
    expected = _clone(sd)
    dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind).result()
    dist.barrier()
    _assert_same(_load(ckpt, expected), expected, "after the failure")
    return "ok"


@pytest.mark.parametrize("mode", ["THREAD", "PROCESS"])
def test_background_failure_surfaces_and_commits_nothing(tmp_path, mode):
    assert run_ranks(_failure_job, 2, str(tmp_path), mode, timeout=240) == ["ok", "ok"]


def test_queued_saves_commit_in_order(tmp_path):
    """Two saves to one location: the later one's data is what stays."""
    writer = MultiLevelWriter(tmp_path / "c", overwrite=True)
    sd = {"w": torch.zeros(1 << 16)}
    futures = []
    for step in range(4):
        sd["w"].fill_(step)
        futures.append(dcp.async_save(sd, storage_writer=writer))
        time.sleep(0)  # let nothing else happen: saves queue behind each other
    for f in futures:
        f.result()
    out = {"w": torch.empty(1 << 16)}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert torch.equal(out["w"], torch.full((1 << 16,), 3.0))


# --------------------------------------------------------------------------- DTensor


def _dtensor_job(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = {f"w{i}": torch.randn(64, 256, generator=g) for i in range(4)}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    writer = MultiLevelWriter(Path(root) / "c", overwrite=True)
    allocated = []
    for _ in range(3):
        fut = dcp.async_save(sd, storage_writer=writer)
        for v in sd.values():
            v.to_local().add_(1.0)  # the next optimizer step, while the save goes on
        fut.result()
        allocated.append(writer.staging_pool.allocated_total)
    back = {k: distribute_tensor(torch.zeros(64, 256), mesh, [Shard(0)]) for k in full}
    dcp.load(back, storage_reader=MultiLevelReader(Path(root) / "c"))
    saved = {k: v + 1.0 + 1.0 for k, v in full.items()}  # the state at the third save
    got = {k: back[k].full_tensor() for k in full}
    exact = all(isinstance(back[k], DTensor) and torch.equal(got[k], saved[k]) for k in full)
    local = sum(v.to_local().numel() * 4 for v in sd.values())
    return {"exact": exact, "allocated": allocated, "local": local}


def test_dtensor_shards_are_staged_in_the_reused_pool(tmp_path):
    # FSDP2's state is DTensors: their local shards go into the writer's buffers
    # (not a fresh host copy per save), and the snapshot is the state of the call.
    out = run_ranks(_dtensor_job, 2, str(tmp_path), timeout=240)
    for res in out:
        assert res["exact"]
        assert res["local"] <= res["allocated"][0] <= res["local"] + 4 * 64  # the shards
        assert res["allocated"] == [res["allocated"][0]] * 3  # reused, not reallocated


# --------------------------------------------------------------------------- close()


def test_close_right_after_the_save_returns_frees_its_buffers(tmp_path):
    # DCP completes the future before its thread ends; the buffers must be free by
    # then (the writer's finish was its last read), not once the thread is gone.
    sd = {f"p{i}": torch.randn(1 << 18) for i in range(8)}
    writer = MultiLevelWriter(tmp_path / "c", sync_files=False)
    for step in range(10):
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / f"s{step}").result()
        writer.close()
        assert writer.staging_pool.held_bytes == 0, f"save {step}: close() kept a buffer set"
