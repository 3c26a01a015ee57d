"""CUDA state through the writer, the reader and the staging.

They skip without a GPU (``make gpu-check`` runs them where one is lent);
``benchmarks/gpu_check.py`` covers the rest (FSDP2, the manager, the CLI).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _damage import flip_byte
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import MultiLevelReader, MultiLevelWriter, StagingConfig
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.checkpoint.destinations import BOUNCE_BYTES
from dcp_multilevel.checkpoint.pinned import release_pinned

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(1024, 1024, generator=g).to(device) for i in range(8)}


def _pinned_held(which: str) -> tuple[int, dict]:
    """Bytes of page-locked memory torch's caching host allocator holds, in use or
    cached (``which``: "current" or "peak"), and its stats for messages. The keys
    changed across torch versions: "reserved_bytes" where "allocated_bytes"
    counted only blocks in use, "allocated_bytes" for both since."""
    stats = torch.cuda.host_memory_stats()
    return max(stats.get(f"{k}.{which}", 0) for k in ("allocated_bytes", "reserved_bytes")), stats


def test_release_pinned_is_a_no_op_without_cuda_destinations():
    assert release_pinned() == 0  # nothing pinned: nothing given back, no error


@cuda
def test_a_load_into_cuda_hands_its_pinned_scratch_back(tmp_path):
    state = _state("cuda")
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    # Destinations of another dtype than stored: every item goes through pinned scratch.
    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
    torch.cuda.synchronize()
    torch.accelerator.empty_host_cache()  # the save's cached blocks: the load would reuse them
    before, _ = _pinned_held("current")
    torch.cuda.reset_peak_host_memory_stats()
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    torch.cuda.synchronize()
    assert all(torch.equal(out[k], v.double()) for k, v in state.items())
    peak, stats = _pinned_held("peak")
    after, _ = _pinned_held("current")
    assert peak >= before + (4 << 20), stats  # 32 MB went through pinned blocks...
    assert after <= before, stats  # ...and none of them is kept


@cuda
def test_a_synchronous_save_from_cuda_hands_its_pinned_blocks_back_on_close(tmp_path):
    state = _state("cuda")
    torch.cuda.synchronize()
    torch.accelerator.empty_host_cache()
    before, _ = _pinned_held("current")
    writer = MultiLevelWriter(tmp_path / "c")
    dcp.save(state, storage_writer=writer)
    cached, stats = _pinned_held("current")
    assert cached >= before + (4 << 20), stats  # kept for the next save...
    writer.close()
    after, stats = _pinned_held("current")
    assert after <= before, stats  # ...until the writer is closed
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in state.items())


@cuda
@pytest.mark.parametrize("threads", [1, 4])
def test_a_load_into_cuda_streams_items_through_two_pinned_blocks_per_thread(tmp_path, threads):
    state = _state("cuda")  # 8 items of 4 MiB: each passes through the blocks
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    torch.cuda.synchronize()
    release_pinned()  # the save's own pinned blocks are cached: not this load's
    torch.accelerator.empty_host_cache()
    torch.cuda.reset_peak_host_memory_stats()
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c", thread_count=threads))
    # No synchronize: the load ends once its copies are done.
    assert all(torch.equal(out[k], v) for k, v in state.items())
    peak, stats = _pinned_held("peak")
    assert 0 < peak <= threads * 2 * BOUNCE_BYTES, stats  # not an item's size per item
    # A flipped byte: the item fails closed, naming it.
    copy = StoredCheckpoint.at(tmp_path / "c")
    loc = next(v for k, v in copy.manifest().locations.items() if k.fqn == "w3")
    flip_byte(tmp_path / "c" / loc.file, loc.offset + loc.length // 2)
    with pytest.raises(CheckpointException, match="checksum mismatch for item 'w3'"):
        dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c", thread_count=threads))


@cuda
# The whole state on the device, or half of it (the rest copied to the host before
# the fence); the fence check hashes the device tensors at return and the host copy.
@pytest.mark.parametrize("snapshot", [64 << 20, 16 << 20], ids=["whole", "half"])
def test_a_device_snapshot_lets_the_state_change_before_its_host_copy_is_done(tmp_path, snapshot):
    state = _state("cuda")  # 32 MiB
    staging = StagingConfig(overlap=True, device_snapshot_bytes=snapshot, check_fence=True)
    writer = MultiLevelWriter(tmp_path / "unused", staging=staging)
    buffers = []
    for step in range(3):
        expected = {k: v.cpu() for k, v in state.items()}
        response = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / f"{step}")
        response.staging_completion.result()  # the fence: read on the device
        for v in state.values():
            v.add_(1)  # the next optimizer step, while the copy to the host runs
        response.upload_completion.result()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=MultiLevelReader(tmp_path / f"{step}"))
        assert all(torch.equal(out[k].cpu(), expected[k]) for k in expected), step
        device = writer._stager._staging.device
        assert device.held_bytes == min(snapshot, 32 << 20)
        buffers.append(next(iter(device.buffers.values())).data_ptr())
    assert len(set(buffers)) == 1  # one buffer, reused save after save
    writer.close()
    assert writer._stager._staging.device.held_bytes == 0


@cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_an_async_save_of_cuda_and_cpu_tensors_through_pinned_buffers_is_bit_exact(
    tmp_path, overlap
):
    # AdamW's step counters stay on the CPU next to CUDA moments: both kinds share the
    # pinned buffer set (a page-aligned slice of its allocation). A view placed from
    # the allocation's start stored other tensors' bytes (seen on an H100).
    state = {**_state("cuda"), **{f"step{i}": torch.tensor(float(i + 2)) for i in range(5)}}
    state["odd"] = torch.arange(7, dtype=torch.int16)
    expected = {k: v.cpu().clone() for k, v in state.items()}
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=overlap))
    response = dcp.async_save(state, storage_writer=writer)
    (response.upload_completion if overlap else response).result()
    (buffers,) = writer.staging_pool.sets
    assert buffers.flat.is_pinned()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert all(torch.equal(out[k].cpu(), expected[k]) for k in expected)
    writer.close()


@cuda
# All staged, half staged (the rest written from the live tensors behind the fence),
# none staged; the fence check hashes the device tensors at return and again after.
@pytest.mark.parametrize("budget", [None, 12 << 20, 0])
def test_an_async_save_from_cuda_holds_the_state_at_staging_completion(tmp_path, budget):
    state = _state("cuda")
    expected = {k: v.cpu() for k, v in state.items()}
    staging = StagingConfig(overlap=True, budget_bytes=budget, check_fence=True)
    writer = MultiLevelWriter(tmp_path / "c", staging=staging)
    response = dcp.async_save(state, storage_writer=writer)
    response.staging_completion.result()  # the fence: copies done on the side stream
    for v in state.values():
        v.add_(1)  # the next optimizer step
    response.upload_completion.result()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert all(torch.equal(out[k].cpu(), expected[k]) for k in expected)


@cuda
@pytest.mark.parametrize("snapshot", [0, 64 << 20], ids=["host", "device"])
def test_a_state_dropped_right_after_async_save_is_still_saved(tmp_path, snapshot):
    # A state made for the save (a full state dict gathered from shards) may be
    # dropped as soon as async_save returns: the stager's hold is then all that
    # keeps its tensors, whose blocks the caching allocator would otherwise hand
    # to the next allocations on the stream. test_staging_holds.py: the CPU run.
    from test_staging_holds import held_until_copied

    held_until_copied(tmp_path, "cuda", snapshot)


@cuda
@pytest.mark.parametrize("how", ["save", "async", "overlap", "snapshot"])
def test_cuda_tensors_of_every_layout_store_their_values(tmp_path, how):
    # Strided, conjugate, negative, bool bytes other than 0 and 1, empty: the
    # batched copies within a device (the snapshot) move memory, not values.
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=g).cuda()
    raw = torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8).cuda()
    state = {
        "transposed": base.t(),
        "stepped": base[:, ::3],
        "conj": torch.randn(5, generator=g, dtype=torch.complex64).cuda().conj(),
        "neg": torch._neg_view(torch.randn(7, generator=g, dtype=torch.float64).cuda()),
        "bool_bytes": raw.view(torch.bool).reshape(5, 8),
        "bool_strided": raw.view(torch.bool).reshape(5, 8).t(),
        "bool_stepped": raw.view(torch.bool)[1::3],
        "half": torch.randn(3, 3, generator=g).half().cuda(),
        "empty": torch.empty(0, 4, device="cuda"),
        "scalar": torch.tensor(2.5, dtype=torch.float64, device="cuda"),
    }
    # A bool's values are its bytes (a bool copy would make them 0 and 1).
    want = {
        k: (v.view(torch.uint8) if v.dtype == torch.bool else v.resolve_conj().resolve_neg())
        .contiguous()
        .cpu()
        for k, v in state.items()
    }
    assert any(b not in (0, 1) for b in want["bool_strided"].reshape(-1).tolist())
    if how == "save":
        dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    else:
        staging = StagingConfig(
            overlap=how != "async", device_snapshot_bytes=(1 << 20) if how == "snapshot" else 0
        )
        writer = MultiLevelWriter(tmp_path / "c", staging=staging)
        r = dcp.async_save(state, storage_writer=writer)
        (r if how == "async" else r.upload_completion).result()
        writer.close()
    out = {k: torch.zeros(v.shape, dtype=state[k].dtype, device="cuda") for k, v in want.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    for k, v in want.items():
        got = out[k].cpu().reshape(-1).view(torch.uint8)
        assert torch.equal(got, v.reshape(-1).view(torch.uint8)), k


@cuda
def test_overlapped_copies_wait_for_the_stream_that_wrote_the_state(tmp_path):
    # Training on a stream of its own: the copies, made on another thread, must
    # wait for that stream's work (queued behind a 50 ms spin), not that thread's
    # default stream, or they read the state before it was written.
    state = _state("cuda")
    writer = MultiLevelWriter(tmp_path / "c", staging=StagingConfig(overlap=True))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        for i, v in enumerate(state.values()):
            v.fill_(i + 1)
        response = dcp.async_save(state, storage_writer=writer)
        response.staging_completion.result()
        for v in state.values():
            v.zero_()  # the next optimizer step
    response.upload_completion.result()
    torch.cuda.synchronize()
    out = {k: torch.zeros(1024, 1024) for k in state}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert [out[k].unique().tolist() for k in state] == [[i + 1.0] for i in range(len(state))]
    writer.close()


@cuda
def test_the_staging_pool_pins_exactly_its_size_and_unpins_on_close(tmp_path):
    import gc

    from dcp_multilevel.staging import registered_bytes

    # 33 MiB: CUDA's caching host allocator would pin 64 MiB for it.
    state = {"w": torch.randn((33 << 20) // 4, device="cuda")}
    torch.cuda.synchronize()
    gc.collect()  # the sets of earlier tests' writers
    cached, _ = _pinned_held("current")
    before = registered_bytes()
    writer = MultiLevelWriter(tmp_path / "c")
    dcp.async_save(state, storage_writer=writer).result()
    (buffers,) = writer.staging_pool.sets
    assert buffers.flat.is_pinned()
    assert buffers.capacity < 34 << 20 and registered_bytes() - before == buffers.capacity
    held, stats = _pinned_held("current")
    assert held == cached, stats  # none of it from torch's caching host allocator
    out = {"w": torch.zeros_like(state["w"])}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert torch.equal(out["w"], state["w"])
    del buffers
    writer.close()
    gc.collect()
    assert registered_bytes() == before


@cuda
def test_replica_digests_of_cuda_state_are_computed_on_the_device(tmp_path):
    from dcp_multilevel import BalancedSavePlanner
    from dcp_multilevel.planning.fingerprint import fingerprint

    state = _state("cuda")
    # The same bytes give the same fingerprint on the device and on the host.
    assert all(fingerprint(v) == fingerprint(v.cpu()) for v in state.values())
    planner = BalancedSavePlanner(verify_replicas=True)
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"), planner=planner)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in state.items())


@cuda
def test_replica_digests_of_cuda_views_at_odd_byte_offsets(tmp_path):
    from dcp_multilevel import BalancedSavePlanner
    from dcp_multilevel.planning.fingerprint import fingerprint

    # torch refuses to view their bytes as words: 2 and 1 bytes into their storage.
    base = torch.arange(20, dtype=torch.bfloat16, device="cuda")
    flags = torch.tensor([True, False, True, True, False], device="cuda")
    state = {"bf16": base[1:9], "bool": flags[1:]}
    assert all(fingerprint(v) == fingerprint(v.clone().cpu()) for v in state.values())
    planner = BalancedSavePlanner(verify_replicas=True)
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"), planner=planner)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=MultiLevelReader(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in state.items())


@cuda
@pytest.mark.parametrize("how", ["save", "async"])
def test_non_finite_values_of_cuda_state_quarantine_the_save(tmp_path, how):
    state = _state("cuda")
    state["w3"][5, 7] = float("nan")
    state["w6"] = state["w6"].bfloat16()
    state["w6"][0, 0] = float("inf")
    writer = MultiLevelWriter(tmp_path / "c")
    if how == "save":  # counted on the device, before the copy to the host
        dcp.save(state, storage_writer=writer)
    else:  # counted in the staged copy, as it is written
        dcp.async_save(state, storage_writer=writer).result()
    health = StoredCheckpoint.at(tmp_path / "c").manifest().health
    (finding,) = health.findings
    assert finding.check == "nonfinite"
    assert finding.items == ("w3", "w6")
    assert finding.message == "2 non-finite values in 2 tensors"
