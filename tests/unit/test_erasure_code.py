"""Reed-Solomon over members of different sizes: round trips, erasure patterns, damage."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel import ConfigError, CorruptCheckpointError
from dcp_multilevel.levels.erasure_code import ErasureCode, ParityChunk, stripe_length


def _members(sizes: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def _code_all(code: ErasureCode, members: list[bytes]) -> dict[int, list[ParityChunk]]:
    parity: dict[int, list[ParityChunk]] = {code.data + j: [] for j in range(code.parity)}
    for chunks in code.encode(members):
        for j, piece in enumerate(chunks):
            parity[code.data + j].append(piece)
    return parity


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 3),
    st.lists(st.integers(0, 700), min_size=5, max_size=5),
    st.integers(1, 256),
    st.randoms(use_true_random=False),
)
def test_any_data_of_the_blocks_rebuild_the_lost_members_exactly(data, parity, sizes, chunk, rnd):
    code = ErasureCode(data, parity, chunk=chunk)
    sizes = sizes[:data]
    members = _members(sizes, rnd.randrange(1 << 30))
    coded = _code_all(code, members)
    assert all(len(p) == stripe_length(sizes, chunk) // chunk for p in coded.values())
    lost = set(rnd.sample(range(data + parity), rnd.randint(0, parity)))
    alive = {i: members[i] for i in range(data) if i not in lost}
    alive_parity = {b: p for b, p in coded.items() if b not in lost}
    rebuilt = code.rebuild(sizes, alive, alive_parity)
    assert rebuilt == {i: members[i] for i in range(data) if i in lost}


@pytest.mark.parametrize(("data", "parity"), [(2, 1), (4, 2), (3, 3)])
def test_every_pattern_of_parity_losses_rebuilds_and_one_more_is_a_clear_error(data, parity):
    code = ErasureCode(data, parity, chunk=64)
    sizes = [100 + 37 * i for i in range(data)]  # different sizes: padded, tails kept
    members = _members(sizes, 1)
    coded = _code_all(code, members)
    blocks = range(data + parity)
    for lost in itertools.combinations(blocks, parity):
        alive = {i: members[i] for i in range(data) if i not in lost}
        rebuilt = code.rebuild(sizes, alive, {b: p for b, p in coded.items() if b not in lost})
        assert rebuilt == {i: members[i] for i in lost if i < data}
    lost = tuple(range(parity + 1))
    alive = {i: members[i] for i in range(data) if i not in lost}
    with pytest.raises(CorruptCheckpointError) as info:
        code.rebuild(sizes, alive, {b: p for b, p in coded.items() if b not in lost})
    assert str(info.value) == (
        f"RS({data}+{parity}) cannot rebuild members {[i for i in lost if i < data]}: blocks "
        f"{list(lost)} are lost or damaged and at most {parity} may be"
    )


def test_a_damaged_parity_chunk_is_never_decoded_from():
    code = ErasureCode(2, 2, chunk=64)
    members = _members([200, 130], 2)
    coded = _code_all(code, members)
    good = coded[2][1]
    coded[2][1] = ParityChunk(good.index, bytes([good.data[0] ^ 1]) + good.data[1:], good.checksum)
    # Block 3 is intact: it stands in for the damaged block 2.
    assert code.rebuild([200, 130], {0: members[0]}, coded) == {1: members[1]}
    with pytest.raises(CorruptCheckpointError) as info:
        code.rebuild([200, 130], {0: members[0]}, {2: coded[2]})
    assert str(info.value) == (
        "RS(2+2) cannot rebuild members [1]: blocks [1, 2, 3] are lost or damaged and at "
        "most 2 may be; parity block 2: chunk 1 does not match its checksum"
    )


def test_storage_overhead_and_padding():
    code = ErasureCode(4, 2)
    assert code.overhead == 1.5
    assert stripe_length([10, 4 << 20, 3], 4 << 20) == 4 << 20
    assert stripe_length([(4 << 20) + 1], 4 << 20) == 8 << 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1), "erasure data must be an integer >= 1, got 0"),
        ((2, 0), "erasure parity must be an integer >= 1, got 0"),
        ((250, 7), "erasure data + parity must be at most 256 (GF(2^8)), got 250 + 7"),
    ],
)
def test_bad_shapes_are_config_errors(args, message):
    with pytest.raises(ConfigError) as info:
        ErasureCode(*args)
    assert str(info.value) == message
