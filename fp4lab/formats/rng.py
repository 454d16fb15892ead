"""Counter-based random bits (Philox4x32-10) in plain integer PyTorch: same seed, same bits on
every device.

``torch.Generator`` streams differ between CPU and CUDA, so stochastic rounding driven by them
could never be replayed across devices or matched by a kernel. Philox is a pure function of a
64-bit key and a 128-bit counter: this file computes it with int64 tensor arithmetic, and a
Triton kernel computes the same function with ``tl.philox`` / 32-bit integer ops.

Bit assignment (the contract every fast path must follow)::

    key     = (seed & 0xFFFFFFFF, seed >> 32)                 k0, k1
    counter = (i & 0xFFFFFFFF, i >> 32, 0, 0)                  c0..c3, i = 16-byte group index
    output  = Philox4x32-10(key, counter) -> 4 words w0..w3 -> 16 bytes, little endian:
              byte j of group i is (w[j // 4] >> (8 * (j % 4))) & 0xFF
    random byte of element n = byte (n % 16) of group n // 16

So one Philox evaluation feeds 16 elements (one NVFP4 block, half an MXFP4 block), which keeps
the kernels memory-bound. The round function and constants are those of Salmon et al. (SC'11),
as used by Triton's ``tl.randint``/``tl.philox`` and cuRAND.

Public: ``philox4x32``, ``philox_rounds``, ``random_bytes``, ``check_seed_tensor``.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10


def _mul_hi_lo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a * x for a 32-bit constant and x: int64 tensor in [0, 2^32) -> (high word, low word).

    The 64-bit product does not fit a signed int64, so x is split into 16-bit halves.
    """
    x_hi, x_lo = x >> 16, x & 0xFFFF
    p_hi, p_lo = a * x_hi, a * x_lo  # each < 2^48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return high, low


def check_seed_tensor(seed: torch.Tensor) -> torch.Tensor:
    """A device seed as given: one int64 element (nn.seeds keeps seeds in [0, 2**63); any int64's
    bits are a valid key). Its value is not read here: that would be a host sync."""
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"a seed tensor holds one int64 element, got {seed.dtype} of shape {tuple(seed.shape)}")
    return seed


def philox4x32(seed: int | torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """seed: int in [0, 2^64), or a one-element int64 tensor on counter's device holding its bits
    (a seed a CUDA graph reads at replay, nn.seeds); counter: [...] int64 >= 0 -> four [...] int64
    words in [0, 2^32)."""
    if isinstance(seed, torch.Tensor):
        seed = check_seed_tensor(seed).reshape(())  # int64's two's complement bits: >> then & recovers the high word
    elif not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    zero = torch.zeros_like(counter)
    return philox_rounds((counter & _M32, (counter >> 32) & _M32, zero, zero),
                         (seed & _M32, (seed >> 32) & _M32))


def philox_rounds(counter: tuple[torch.Tensor, ...], key: tuple[int, int] | tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, ...]:
    """The full Philox4x32-10 bijection: four int64 word tensors in [0, 2^32), a two-word key
    (ints, or int64 tensors that broadcast against the counter)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def random_bytes(seed: int | torch.Tensor, numel: int, device: torch.device | str | None = None) -> torch.Tensor:
    """seed, numel -> [numel] uint8 on ``device`` (default: a tensor seed's, else the CPU): byte n
    is byte n % 16 of Philox(seed, n // 16) (a tensor seed as philox4x32 takes it)."""
    if device is None:
        device = seed.device if isinstance(seed, torch.Tensor) else "cpu"
    groups = -(-numel // 16)
    counter = torch.arange(groups, dtype=torch.int64, device=device)
    words = torch.stack(philox4x32(seed, counter), dim=-1)  # [groups, 4]
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=device)
    bytes_ = (words[..., None] >> shifts) & 0xFF  # [groups, 4 words, 4 bytes]
    return bytes_.reshape(-1)[:numel].to(torch.uint8)
