"""The codec conformance suite: what every :class:`~dcp_multilevel.codecs.Codec` must do.

A third-party codec (registered in the ``dcp_multilevel.codecs`` entry-point
group) runs the very tests the built-in codecs run::

    from dcp_multilevel.testing import CodecTests

    class TestMyCodec(CodecTests):
        @pytest.fixture
        def codec(self):
            return MyCodec(level=1)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ..codecs import CODECS, Codec
from ..codecs.options import Compression
from ..plugin import MultiLevelReader, MultiLevelWriter

__all__ = ["CodecTests"]

#: dtypes every codec must round-trip (floats, ints, bool, complex).
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Weight-like values of ``dtype`` (small normals; random bits for ints and bool)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class CodecTests:
    """The :class:`~dcp_multilevel.codecs.Codec` contract, as tests.

    Subclass it in a test module and give it a ``codec`` fixture returning an
    instance of the codec under test; pytest collects the inherited tests.
    """

    @pytest.fixture
    def codec(self) -> Codec:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("n", [0, 1, 4097, 65_536])
    def test_a_chunk_round_trips_bit_exact(self, codec, dtype, n):
        data = _bytes(_values(dtype, n, seed=n))
        width, rotate = codec.layout(dtype)
        payload = codec.encode(data, width, rotate)
        if payload is None:  # coding did not pay: the pipeline stores the chunk raw
            return
        out = bytearray(len(data))
        codec.decode(memoryview(payload), memoryview(out), width, rotate)
        assert bytes(out) == bytes(data)

    def test_encode_into_agrees_with_encode(self, codec):
        data = _bytes(_values(torch.float32, 50_000, seed=1))
        width, rotate = codec.layout(torch.float32)
        out = bytearray(codec.payload_bound(len(data), width))
        n = codec.encode_into(data, width, rotate, memoryview(out))
        if n is None:
            assert codec.encode(data, width, rotate) is None
            return
        back = bytearray(len(data))
        codec.decode(memoryview(out)[:n], memoryview(back), width, rotate)
        assert bytes(back) == bytes(data)

    def test_a_damaged_payload_is_a_value_error_or_decodes_to_other_bytes(self, codec):
        # Frames carry checksums (format/frames.py); a codec itself must never crash
        # or hang on bytes it did not write.
        data = _bytes(_values(torch.float32, 20_000, seed=2))
        width, rotate = codec.layout(torch.float32)
        payload = codec.encode(data, width, rotate)
        if payload is None:
            pytest.skip("this codec stores these values raw")
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 0xFF
        out = bytearray(len(data))
        try:
            codec.decode(memoryview(bytes(damaged)), memoryview(out), width, rotate)
        except ValueError:
            return

    def test_the_codec_is_registered_and_decodes_its_own_descriptor(self, codec):
        cls = CODECS.get(codec.name)
        name, _, version = codec.descriptor.rpartition("/")
        assert name == codec.name and isinstance(codec, cls) and cls.reads(version)

    def test_a_dcp_checkpoint_round_trips_through_it(self, codec, tmp_path):
        state = {
            "w": _values(torch.float32, 300_000, seed=3).reshape(600, 500),
            "b": _values(torch.bfloat16, 70_000, seed=4),
            "i": _values(torch.int64, 10_000, seed=5),
        }
        writer = MultiLevelWriter(str(tmp_path / "ckpt"), codec=Compression(codec.name))
        dcp.save(state, storage_writer=writer)
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(loaded, storage_reader=MultiLevelReader(str(tmp_path / "ckpt")))
        for key, value in state.items():
            assert torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8)), key
