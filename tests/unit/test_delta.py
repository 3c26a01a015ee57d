"""Delta checkpoints written with ``MultiLevelWriter(reference=...)``: round trips
along chains, per-chunk choices, broken references, the manifest's fields, and
the delta coding of single chunks (hypothesis).

Every save and load here is real (files on disk, DCP's own save and load).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _damage import flip_byte
from conftest import assert_bit_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel import (
    Compression,
    ConfigError,
    CorruptCheckpointError,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.checkpoint.verify import verify_checkpoint
from dcp_multilevel.codecs import codec_for
from dcp_multilevel.codecs.pipeline import decode_frames, encode_chunk
from dcp_multilevel.errors import BrokenChainError, ManifestError
from dcp_multilevel.format import decode_manifest, frames, seal_manifest
from dcp_multilevel.stores.remote import RemoteStore

if TYPE_CHECKING:
    from _s3 import S3Server

pytest_plugins = ["_s3"]

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def train(state: dict[str, Any], step: int) -> dict[str, Any]:
    """The next state: small updates to the floats, a new counter, optimizer-like noise."""
    g = torch.Generator().manual_seed(1000 + step)
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            noise = torch.randn(v.shape, generator=g) * 1e-3
            out[k] = (v.float() + noise * v.float().abs()).to(v.dtype)
        elif isinstance(v, torch.Tensor):
            out[k] = v + 1
        else:
            out[k] = {**v, "step": step}
    return out


def first_state(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        # Three 1 MiB chunks and a tail: chunks are delta-coded one by one.
        "big": torch.randn(700_000, generator=g).to(dtype),
        "mid": torch.randn(64, 256, generator=g).to(dtype),
        "tiny": torch.randn(10, generator=g).to(dtype),  # stored raw: never a delta
        "count": torch.arange(5000, dtype=torch.int64),
        "meta": {"step": 0, "name": "run"},
    }


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "name": ""}
        for k, v in state.items()
    }


def save(path: Path, state: dict[str, Any], reference: Path | None = None, **kw) -> Any:
    kw.setdefault("codec", "bytegroup")
    writer = MultiLevelWriter(path, reference=reference, **kw)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def load(path: Path, like: dict[str, Any], **kw) -> dict[str, Any]:
    out = empty_like(like)
    dcp.load(out, storage_reader=MultiLevelReader(path, **kw), no_dist=True)
    return out


def assert_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert_bit_equal(actual[k], v, k)
        else:
            assert actual[k] == v, k


def stored_bytes(path: Path) -> int:
    return sum(json.loads((path / "manifest.json").read_text())["files"].values())


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", ["bytegroup", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("chain", ["keyframe", "previous"])
def test_every_step_of_a_chain_loads_bit_exact(tmp_path, codec, dtype, chain) -> None:
    states = [first_state(dtype)]
    save(tmp_path / "step-0", states[0], codec=codec)
    for step in range(1, 5):
        states.append(train(states[-1], step))
        ref = tmp_path / ("step-0" if chain == "keyframe" else f"step-{step - 1}")
        writer = save(tmp_path / f"step-{step}", states[-1], ref, codec=codec)
        assert writer.delta_items >= 2  # "big" and "mid"; "tiny" is too small to code
        doc = manifest(tmp_path / f"step-{step}")
        assert doc["format_version"] == 2
        assert doc["reference"]["checkpoint"] == ref.name
        assert {i["fqn"] for i in doc["items"] if "ref" in i} >= {"big", "mid"}
        assert not any("ref" in i for i in doc["items"] if i["fqn"] in ("tiny", "meta.step"))
    for step, state in enumerate(states):
        assert_state_equal(load(tmp_path / f"step-{step}", state), state)


def test_deltas_of_nearby_states_are_smaller_than_full_saves(tmp_path) -> None:
    base = first_state(torch.bfloat16)
    nxt = train(base, 1)
    save(tmp_path / "step-0", base)
    save(tmp_path / "step-1", nxt, tmp_path / "step-0")
    save(tmp_path / "full-1", nxt)
    assert stored_bytes(tmp_path / "step-1") < 0.5 * stored_bytes(tmp_path / "full-1")


def test_changed_shapes_dtypes_and_values_are_stored_whole(tmp_path) -> None:
    a = first_state()
    save(tmp_path / "step-0", a)
    b = train(a, 1)
    b["big"] = torch.randn(800_000)  # new shape
    b["mid"] = b["mid"].to(torch.float64)  # new dtype
    b["new"] = torch.randn(300_000)  # not in the reference
    writer = save(tmp_path / "step-1", b, tmp_path / "step-0")
    refs = {i["fqn"] for i in manifest(tmp_path / "step-1")["items"] if "ref" in i}
    assert refs == {"count"}  # only the unchanged-layout tensor is a delta
    assert writer.delta_items == 1
    assert_state_equal(load(tmp_path / "step-1", b), b)


def test_writer_and_drain_code_the_same_items_as_deltas(tmp_path) -> None:
    # One rule (checkpoint/reference.py delta_base): a tensor reshaped to the same
    # number of bytes is stored whole by the writer and by a drain alike; only
    # chunks of the same dtype, place and shape are coded against the reference.
    from dcp_multilevel.checkpoint.copy import DeltaTarget

    a = first_state()
    save(tmp_path / "step-0", a)
    b = train(a, 1)
    b["mid"] = b["mid"].reshape(128, 128)  # the same 64 KiB, another shape
    save(tmp_path / "step-1", b, tmp_path / "step-0")
    ref = StoredCheckpoint.at(tmp_path / "step-0")
    new = StoredCheckpoint.at(tmp_path / "step-1")
    target = DeltaTarget(ref.manifest(), ref)
    by_drain = {
        index.fqn
        for index, loc in new.manifest().locations.items()
        if target.item(new.manifest(), index, loc) is not None
    }
    by_writer = {i["fqn"] for i in manifest(tmp_path / "step-1")["items"] if "ref" in i}
    assert by_drain == by_writer == {"big", "count"}


def test_unrelated_values_choose_whole_coding_per_chunk(tmp_path) -> None:
    """Re-initialised values XOR to noise: each chunk is coded whole, not as a delta."""
    a = first_state()
    save(tmp_path / "step-0", a)
    b = {**a, "big": torch.randn(700_000) * 3, "mid": a["mid"] + 0}
    save(tmp_path / "step-1", b, tmp_path / "step-0")
    save(tmp_path / "full", b)
    refs = {i["fqn"] for i in manifest(tmp_path / "step-1")["items"] if "ref" in i}
    assert "big" not in refs and "mid" in refs
    full = {i["fqn"]: i["length"] for i in manifest(tmp_path / "full")["items"]}
    delta = {i["fqn"]: i["length"] for i in manifest(tmp_path / "step-1")["items"]}
    assert delta["big"] == full["big"]
    assert_state_equal(load(tmp_path / "step-1", b), b)


@pytest.mark.parametrize(
    "ref_codec",
    [None, Compression(chunk_size=2 * MiB), Compression(codec="zstd", chunk_size=3 * MiB)],
    ids=["uncoded", "2MiB-chunks", "zstd-3MiB"],
)
def test_reference_stored_another_way(tmp_path, ref_codec) -> None:
    """The reference's framing need not match: its bytes are streamed in raw order."""
    a = first_state()
    save(tmp_path / "step-0", a, codec=ref_codec)
    b = train(a, 1)
    writer = save(tmp_path / "step-1", b, tmp_path / "step-0", codec=Compression(threads=1))
    assert writer.delta_items >= 2
    assert_state_equal(load(tmp_path / "step-1", b, thread_count=2), b)


def test_delta_checkpoint_loads_with_reader_threads_and_verifies(tmp_path) -> None:
    a = first_state()
    save(tmp_path / "step-0", a)
    b = train(a, 1)
    save(tmp_path / "step-1", b, tmp_path / "step-0", codec=Compression(threads=2))
    assert_state_equal(load(tmp_path / "step-1", b, thread_count=3), b)
    result = verify_checkpoint(StoredCheckpoint.at(tmp_path / "step-1"))
    assert result.ok and result.items == 6


def test_a_delta_loads_from_an_object_store_reading_each_byte_once(
    s3_server: S3Server, s3_bucket: str, monkeypatch
) -> None:
    """On an object store the references' items are fetched exactly, not in
    the 32 MiB blocks that serve a whole file (each item's reference once read
    the rest of the file: 7x the bytes of a restore), and each reference file
    (down a chain of two) in one request, not one per item."""
    opts = s3_server.storage_options
    g = torch.Generator().manual_seed(3)
    a = {f"layer{i}": torch.randn(64, 1024, generator=g) for i in range(16)}  # 256 KiB each
    b = train(a, 1)
    c = train(b, 2)
    url = f"s3://{s3_bucket}/run"
    chain = (("step-0", a, None), ("step-1", b, "step-0"), ("step-2", c, "step-1"))
    for name, state, ref in chain:
        ref_url = ref and f"{url}/{ref}"
        writer = MultiLevelWriter(
            f"{url}/{name}", codec="bytegroup", reference=ref_url, storage_options=opts
        )
        dcp.save(state, storage_writer=writer, no_dist=True)
    # The very filesystem the reader's store uses (fsspec caches one per options).
    fs = RemoteStore(url, **opts).fs
    stored = sum(fs.size(k) for k in fs.find(url) if k.endswith(".bin"))
    fetched = []
    cat_file = fs.cat_file

    def counted(path, start=None, end=None, **kw):
        data = cat_file(path, start=start, end=end, **kw)
        if str(path).endswith(".bin"):
            fetched.append(len(data))
        return data

    monkeypatch.setattr(fs, "cat_file", counted)
    out = empty_like(c)
    dcp.load(
        out, storage_reader=MultiLevelReader(f"{url}/step-2", storage_options=opts), no_dist=True
    )
    assert_state_equal(out, c)
    assert manifest_of(fs, f"{url}/step-2")["reference"]["checkpoint"] == "step-1"
    assert manifest_of(fs, f"{url}/step-1")["reference"]["checkpoint"] == "step-0"
    assert stored <= sum(fetched) <= stored * 1.01, (sum(fetched), stored)
    assert len(fetched) == 3, fetched  # one file per checkpoint, one request each


def manifest_of(fs: Any, url: str) -> dict[str, Any]:
    return json.loads(fs.cat_file(f"{url}/manifest.json"))


# --------------------------------------------------------------------------- broken chains


def chain_of_three(tmp_path: Path) -> list[dict[str, Any]]:
    states = [first_state()]
    save(tmp_path / "step-0", states[0])
    for step in (1, 2):
        states.append(train(states[-1], step))
        save(tmp_path / f"step-{step}", states[-1], tmp_path / f"step-{step - 1}")
    return states


def flip(path: Path, at: int = 5000) -> None:
    (data,) = sorted((path / "data").glob("*.bin"))
    flip_byte(data, at, 0x40)


def load_error(path: Path, like: dict[str, Any]) -> BaseException:
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        load(path, like)
    return info.value


def chain_errors(err: BaseException) -> list[BrokenChainError]:
    found = []
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, BrokenChainError):
            found.append(seen)
        for failure in getattr(seen, "failures", {}).values():
            found += chain_errors(failure[0] if isinstance(failure, tuple) else failure)
        seen = seen.__cause__ or seen.__context__
    return found


@pytest.mark.parametrize("broken", ["step-0", "step-1"])
def test_a_corrupt_link_anywhere_in_the_chain_is_named(tmp_path, broken) -> None:
    states = chain_of_three(tmp_path)
    for name in ("step-0", "step-1"):
        shutil.copytree(tmp_path / name, tmp_path / f"pristine-{name}")
    flip(tmp_path / broken)
    err = load_error(tmp_path / "step-2", states[2])
    found = chain_errors(err)
    assert found, err
    assert found[0].chain[-1].endswith(broken)
    assert found[0].chain[0].endswith("step-2")
    assert "step-2" in str(found[0]) and broken in str(found[0])
    # The flipped byte is in a chunk's payload: the message names the chunk.
    assert re.search(r"chunk \d+: its checksum does not match its bytes", str(found[0])), found[0]
    # A whole copy of the same save on another level serves the step instead.
    shutil.copytree(tmp_path / "step-2", tmp_path / "other" / "step-2")
    for name in ("step-0", "step-1"):  # the copy's own chain, intact
        shutil.copytree(tmp_path / f"pristine-{name}", tmp_path / "other" / name)
    out = load(tmp_path / "step-2", states[2], fallbacks=[str(tmp_path / "other" / "step-2")])
    assert_state_equal(out, states[2])


def test_a_deleted_reference_is_named_and_items_without_deltas_still_load(tmp_path) -> None:
    states = chain_of_three(tmp_path)
    shutil.rmtree(tmp_path / "step-1")
    err = chain_errors(load_error(tmp_path / "step-2", states[2]))[0]
    assert "step-1" in str(err) and "no committed checkpoint" in str(err)
    # verify names every delta item, and only those
    result = verify_checkpoint(StoredCheckpoint.at(tmp_path / "step-2"))
    bad = {p.fqn for p in result.problems}
    refs = {i["fqn"] for i in manifest(tmp_path / "step-2")["items"] if "ref" in i}
    assert bad == refs and bad
    assert {p.error for p in result.problems} == {"BrokenChainError"}


def test_a_reference_replaced_by_another_save_is_refused(tmp_path) -> None:
    states = chain_of_three(tmp_path)
    # Step 1 saved again (same bytes even): another save_id, so another checkpoint.
    save(tmp_path / "step-1", states[1], tmp_path / "step-0", overwrite=True)
    err = chain_errors(load_error(tmp_path / "step-2", states[2]))[0]
    assert "the reference was replaced" in str(err)


# --------------------------------------------------------------------------- writer options


def test_reference_needs_a_codec_and_a_sibling(tmp_path) -> None:
    a = first_state()
    save(tmp_path / "run" / "step-0", a)
    with pytest.raises(ConfigError, match="pass a codec"):
        MultiLevelWriter(tmp_path / "run" / "step-1", reference=tmp_path / "run" / "step-0")
    with pytest.raises(ConfigError, match="not a sibling directory"):
        save(tmp_path / "other" / "step-1", a, tmp_path / "run" / "step-0")
    # checkpoint_id moves the path per save: checked again before anything is written
    writer = MultiLevelWriter(
        tmp_path / "run" / "step-1", codec="bytegroup", reference=tmp_path / "run" / "step-0"
    )
    with pytest.raises(BaseException, match="not a sibling directory"):
        dcp.save(a, storage_writer=writer, checkpoint_id=tmp_path / "other" / "s-1", no_dist=True)
    assert not (tmp_path / "other" / "step-1" / "manifest.json").exists()
    assert not (tmp_path / "other" / "s-1" / "manifest.json").exists()


def test_an_unreadable_reference_saves_whole(tmp_path) -> None:
    a = first_state()
    writer = save(tmp_path / "step-1", a, tmp_path / "step-0")  # step-0 never saved
    assert writer.delta_items == 0
    assert manifest(tmp_path / "step-1")["format_version"] == 1
    assert_state_equal(load(tmp_path / "step-1", a), a)


# --------------------------------------------------------------------------- manifest


def test_manifest_delta_fields_are_validated(tmp_path) -> None:
    a = first_state()
    save(tmp_path / "step-0", a)
    save(tmp_path / "step-1", train(a, 1), tmp_path / "step-0")
    doc = manifest(tmp_path / "step-1")
    decoded = decode_manifest(seal_manifest(doc))
    assert decoded.reference is not None and decoded.reference.checkpoint == "step-0"
    assert decoded.reference.save_id == manifest(tmp_path / "step-0")["save_id"]

    def bad(change, match: str) -> None:
        d = json.loads(json.dumps(doc))
        change(d)
        with pytest.raises(ManifestError, match=match):
            decode_manifest(seal_manifest(d))

    bad(lambda d: d.pop("reference"), "needs a 'reference'")
    bad(lambda d: d["reference"].update(checkpoint="../elsewhere"), "not a safe relative path")
    bad(lambda d: d["reference"].update(checkpoint="a/b"), "not a sibling")
    bad(lambda d: d.update(format_version=1), "has no 'reference'")
    bad(lambda d: d["items"][0].update(ref="crc:1"), "is not of the form")
    item = next(i for i in doc["items"] if "ref" not in i and not i["transforms"])

    def unframed_delta(d):
        next(i for i in d["items"] if i["fqn"] == item["fqn"])["ref"] = "xxh3_64:" + "0" * 16

    bad(unframed_delta, "not framed by one codec")

    def no_reference(d):
        d.pop("reference")
        d["format_version"] = 1

    bad(no_reference, "names no reference")


# --------------------------------------------------------------------------- chunks


class _Ref:
    """A reference held in memory, for coding single chunks."""

    ratio = None  # as if the reference were itself a delta

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.used, self.finished = memoryview(data), 0, False, False

    def take_into(self, n: int):
        self.pos += n
        piece = self.data[self.pos - n : self.pos]

        def fill(out: memoryview) -> None:
            out[:] = piece

        return fill

    def skip(self, n: int) -> None:
        self.pos += n

    def finish(self) -> None:
        assert self.pos == len(self.data)
        self.finished = True


def _one_chunk(record: bytes, payload, width: int, rotate: int, raw_len: int, chunk: int = MiB):
    """The frames of one item of one chunk: ``(read, stored_length)`` for decode_frames."""
    stream = (
        frames.pack_header(width, rotate, chunk, raw_len)
        + record
        + bytes(payload)
        + frames.pack_chunk(frames.METHOD_RAW, 0, 0, 0)
    )
    pos = 0

    def read(k: int) -> memoryview:
        nonlocal pos
        pos += k
        return memoryview(stream)[pos - k : pos]

    return read, len(stream)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(4096 // 4, 40_000 // 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32]),
    flips=st.floats(0, 1),
    codec_name=st.sampled_from(["bytegroup", "zstd"]),
    seed=st.integers(0, 2**16),
    threaded=st.booleans(),
)
def test_delta_chunks_decode_to_their_bytes(n, dtype, flips, codec_name, seed, threaded) -> None:
    """encode_chunk with a reference, then decode_frames with the same reference:
    the chunk's bytes, whichever method the chunk chose (``threaded``: the
    reference decodes on a pool while the delta decodes, then is XORed in)."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 256, n * 4, dtype=np.uint8)
    new = ref.copy()
    mask = rng.random(len(new)) < flips  # from identical to unrelated
    new[mask] = rng.integers(0, 256, int(mask.sum()), dtype=np.uint8)
    codec = codec_for(Compression(codec=codec_name))
    width, rotate = codec.layout(dtype)
    record, payload, _ = encode_chunk(
        codec, memoryview(new), width, rotate, ref=memoryview(ref.tobytes())
    )
    assert len(payload) <= len(new)
    read, stored = _one_chunk(record, payload, width, rotate, len(new), 64 * MiB)
    out = bytearray(len(new))
    source = _Ref(ref.tobytes())
    decode_frames(
        read,
        memoryview(out),
        codec,
        stored_length=stored,
        pool=_POOL if threaded else None,
        window=1,
        on_chunk_error=lambda i, why: ValueError(why),
        reference=source,
    )
    assert bytes(out) == new.tobytes()
    assert source.finished
    if flips == 0 and record[0] != frames.METHOD_RAW:
        assert record[0] == frames.METHOD_DELTA  # identical bytes: the delta is all zeros


_POOL = ThreadPoolExecutor(1, thread_name_prefix="test-delta-ref")


class _FailingRef(_Ref):
    """A reference whose bytes cannot be produced (a chain broken further down)."""

    def take_into(self, n: int):
        super().take_into(n)

        def fail(out: memoryview) -> None:
            time.sleep(0.05)  # still writing when the delta's planes are decoded
            out[:] = bytes(len(out))
            raise CorruptCheckpointError("the reference's chunk is corrupt", checkpoint="ref")

        return fail


@pytest.mark.parametrize("threaded", [False, True])
def test_a_reference_that_fails_while_decoding_fails_the_item(threaded) -> None:
    """The reference's error comes out of decode_frames, whichever thread decoded it,
    and only once the reference is no longer being written."""
    codec = codec_for(Compression())
    ref = np.arange(10_000, dtype=np.float32)
    new = ref * np.float32(1.001)
    record, payload, _ = encode_chunk(
        codec, memoryview(new.view(np.uint8)), 4, 1, ref=memoryview(ref.tobytes())
    )
    assert record[0] == frames.METHOD_DELTA
    read, stored = _one_chunk(record, payload, 4, 1, new.nbytes)
    with pytest.raises(CorruptCheckpointError, match="reference's chunk is corrupt"):
        decode_frames(
            read,
            memoryview(bytearray(new.nbytes)),
            codec,
            stored_length=stored,
            pool=_POOL if threaded else None,
            window=1,
            on_chunk_error=lambda i, why: ValueError(why),
            reference=_FailingRef(ref.tobytes()),
        )
    assert _POOL.submit(lambda: True).result(timeout=5)  # nothing left running on the pool


def test_a_delta_chunk_without_a_reference_is_corrupt_framing() -> None:
    codec = codec_for(Compression())
    data = np.arange(10_000, dtype=np.float32).view(np.uint8)
    record, payload, _ = encode_chunk(codec, memoryview(data), 4, 1, ref=memoryview(data.tobytes()))
    assert record[0] == frames.METHOD_DELTA
    read, stored = _one_chunk(record, payload, 4, 1, len(data))
    with pytest.raises(ValueError, match="delta chunk"):
        decode_frames(
            read,
            memoryview(bytearray(len(data))),
            codec,
            stored_length=stored,
            pool=None,
            window=1,
            on_chunk_error=lambda i, why: ValueError(why),
        )


# --------------------------------------------------------------------------- the command line


def test_command_line_verifies_copies_and_converts_delta_checkpoints(tmp_path) -> None:
    from click.testing import CliRunner

    from dcp_multilevel.cli import main
    from dcp_multilevel.convert import convert

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    states = chain_of_three(tmp_path / "run")
    assert run("verify", tmp_path / "run" / "step-2").exit_code == 0
    doc = json.loads(run("inspect", "--json", tmp_path / "run" / "step-2").output)
    assert doc["reference"]["checkpoint"] == "step-1"
    assert doc["format_version"] == 2
    listing = json.loads(run("ls", "--json", tmp_path / "run").output)
    (level,) = listing["roots"]
    assert [c["delta_of"] for c in level["checkpoints"]] == [None, "step-0", "step-1"]
    assert "delta of step-1" in run("ls", tmp_path / "run").output
    # A delta copied without its reference could not be loaded: refused, nothing written.
    result = run("copy", tmp_path / "run" / "step-2", tmp_path / "dest" / "step-2")
    assert result.exit_code == 1 and "is a delta against step-1" in result.output
    assert not (tmp_path / "dest" / "step-2" / "manifest.json").exists()
    for step in (0, 1, 2):  # the chain, oldest first: every copy loads
        result = run("copy", tmp_path / "run" / f"step-{step}", tmp_path / "dest" / f"step-{step}")
        assert result.exit_code == 0, result.output
    assert_state_equal(load(tmp_path / "dest" / "step-2", states[2]), states[2])
    # Converted to a whole checkpoint elsewhere: no reference needed any more.
    convert(tmp_path / "run" / "step-2", tmp_path / "whole" / "step-2", to="ours")
    assert "reference" not in manifest(tmp_path / "whole" / "step-2")
    assert_state_equal(load(tmp_path / "whole" / "step-2", states[2]), states[2])


def test_gc_keeps_what_kept_deltas_need(tmp_path) -> None:
    from click.testing import CliRunner

    from dcp_multilevel.cli import main

    def gc(*args):
        result = CliRunner().invoke(main, ["gc", str(tmp_path / "run"), *map(str, args)])
        assert result.exit_code == 0, result.output
        return result

    # step-2 is a delta against step-1, itself one against step-0: --keep 1 keeps
    # all three (deleting 0 or 1 would leave the kept step-2 unrestorable).
    states = chain_of_three(tmp_path / "run")
    plan = json.loads(gc("--keep", 1, "--json").output)
    assert plan["kept"] == [0, 1, 2] and plan["expired"] == []
    assert plan["kept_as_reference"] == [0, 1]
    assert "(0, 1: references of kept deltas)" in gc("--keep", 1, "--dry-run").output
    assert_state_equal(load(tmp_path / "run" / "step-2", states[2]), states[2])
    # A whole step-3: the chain is needed by no kept step any more.
    states.append(train(states[-1], 3))
    save(tmp_path / "run" / "step-3", states[-1])
    plan = json.loads(gc("--keep", 1, "--json").output)
    assert plan["kept"] == [3] and plan["expired"] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-3"]
    assert_state_equal(load(tmp_path / "run" / "step-3", states[3]), states[3])


def test_a_reference_replaced_during_the_save_is_not_committed(tmp_path) -> None:
    """The commit checks every delta item against the reference as it is then."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    a = first_state()
    save(tmp_path / "step-0", a)

    class ReplaceReference(DefaultSavePlanner):
        calls = 0

        def resolve_data(self, write_item):
            ReplaceReference.calls += 1
            if ReplaceReference.calls == 2:  # the first item is already coded against it
                save(tmp_path / "step-0", train(a, 7), overwrite=True)
            return super().resolve_data(write_item)

    writer = MultiLevelWriter(tmp_path / "step-1", codec="bytegroup", reference=tmp_path / "step-0")
    with pytest.raises(BaseException, match="the reference changed during the save"):
        dcp.save(train(a, 1), storage_writer=writer, planner=ReplaceReference(), no_dist=True)
    assert not (tmp_path / "step-1" / "manifest.json").exists()
