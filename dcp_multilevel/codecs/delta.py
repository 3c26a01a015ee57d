"""Delta chunks: a chunk's bytes XOR the reference's bytes at the same place.

A delta checkpoint stores, per chunk, whichever is smallest: the raw bytes,
their coding, or the coding of ``chunk XOR reference`` (frame method
:data:`~dcp_multilevel.format.frames.METHOD_DELTA`). XOR, not subtraction:
XOR deltas code smaller than integer subtraction of the bit patterns
(``benchmarks/bench_delta.py`` compares them on weights trained with AdamW):
between nearby checkpoints the sign, exponent and top mantissa bits mostly
agree, so the XOR's top byte planes are nearly all zeros, which the
byte-plane coder shrinks to almost nothing. XOR is its own inverse, so
decoding is the same operation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DELTA_SURE", "xor_into"]

#: A delta chunk coded to at most this share of its raw size is kept without
#: also coding the chunk whole: float weights and optimizer states coded whole
#: stay well above half their size (their mantissas are near-random), so coding
#: it too would only cost time. Above it, both are coded and the smaller is kept.
#: When the reference's item was coded whole, its ratio raises this bound
#: (the same tensor a few steps earlier codes about as well): Adam's moments
#: change too much between saves for their deltas to code under half, and coding
#: them both ways would double their coding time (``benchmarks/bench_codecs.py``
#: and ``benchmarks/bench_delta.py`` measure the ratios).
DELTA_SURE = 0.5


def xor_into(a: memoryview, b: memoryview, out: memoryview) -> None:
    """``out[:] = a ^ b`` byte for byte (all three the same length; ``out`` may be ``a``).

    numpy works on 8-byte words where the lengths allow, with the GIL released.
    """
    n = len(out)
    if len(a) != n or len(b) != n:
        raise ValueError(f"xor of {len(a)} and {len(b)} bytes into {n}")
    x, y, z = (np.frombuffer(v, np.uint8) for v in (a, b, out))
    words = n - n % 8
    if words:
        np.bitwise_xor(
            x[:words].view(np.uint64), y[:words].view(np.uint64), out=z[:words].view(np.uint64)
        )
    if words < n:
        np.bitwise_xor(x[words:], y[words:], out=z[words:])
