"""A tensor's fingerprint computed where the tensor lives: replica checks of device state.

``BalancedSavePlanner(verify_replicas=True)`` compares a digest of every
replicated item across ranks. For a CPU tensor that is xxh3 of its bytes; a
device tensor would first have to be copied whole to the host. Instead its
bytes are read as 32-bit words ``x_i`` and reduced on the device to two sums
modulo 2^64, ``sum x_i * a_i`` and ``sum x_i * b_i``, with odd weights ``a_i =
2i + 1`` and ``b_i = (i * 0x9E3779B1 + 0x7F4A7C15) | 1``: only 16 bytes come
back. Any change of one word changes both sums (an odd weight times a nonzero
difference under 2^32 is not 0 modulo 2^64); it detects replicas that
diverged by accident, which is what the check is for, not a forged collision.
Integer sums are exact, so every rank and every chunking gets the same value.
"""

from __future__ import annotations

import torch

__all__ = ["fingerprint"]

#: Words reduced at once (the int64 temporaries are 8x this many bytes each).
CHUNK_WORDS = 4 << 20


def fingerprint(t: torch.Tensor, chunk_words: int = CHUNK_WORDS) -> str:
    """``"fp64x2:<bytes>:<32 hex digits>"`` of ``t``'s bytes, computed on its device."""
    t = t.detach()
    if t.dtype == torch.bool:  # its bytes: a bool copy (contiguous) rewrites any but 0 and 1
        t = t.view(torch.uint8)
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, -(-n // 4), chunk_words):
        x = _words(flat[4 * start : 4 * (start + chunk_words)]).to(torch.int64)
        i = torch.arange(start, start + x.numel(), dtype=torch.int64, device=flat.device)
        sums[0] += (x * (2 * i + 1)).sum()
        sums[1] += (x * ((i * 0x9E3779B1 + 0x7F4A7C15) | 1)).sum()
    a, b = (int(v) & (2**64 - 1) for v in sums.tolist())  # one transfer: 16 bytes
    return f"fp64x2:{n}:{a:016x}{b:016x}"


def _words(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (bytes) as 32-bit words, its end padded with zero bytes.

    torch views bytes as words only from a storage offset divisible by 4: a
    view into a tensor (a bf16 ``t[1:9]``, a bool ``t[1:]``) may start
    anywhere. Such a piece is copied, one chunk at a time (never the whole
    tensor), so its words are those of the same values stored contiguously.
    """
    if piece.numel() % 4 or piece.storage_offset() % 4:
        piece = torch.cat([piece, piece.new_zeros(-piece.numel() % 4)])  # a new tensor
    return piece.view(torch.int32)
