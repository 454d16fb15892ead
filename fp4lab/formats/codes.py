"""Element and scale codes: E2M1 (FP4), E4M3 (FP8, "fn") and UE8M0, bit-exact.

Every encoder here works on the IEEE-754 binary32 bit pattern with integer operations, so the
rounding is exactly the one the format defines, independent of the platform's float tricks.

Minifloat encoding (E2M1 and E4M3 share one routine, ``_encode_magnitude``)::

    |x| = sig * 2^(E - 150)          sig = 1.mantissa (24 bits) for fp32 normals, E = biased exp
    target biased exponent  te = max(E, 1) - 127 + bias
    shift  s = (23 - mbits) + max(1 - te, 0)      (extra shift: target subnormal range)
    code   = (max(te - 1, 0) << mbits) + round(sig >> s)

The ``+`` lets a mantissa carry roll into the exponent field, which is exactly how a rounding
up to the next binade is encoded. ``round`` is round-to-nearest-even on the dropped bits, or
stochastic: with 8 random bits ``r`` per element, round up iff ``r / 256 < dropped / 2^s``
(the software form of Blackwell's ``cvt.rs``, docs/numerics.md "Stochastic rounding"). The result
is then clamped to the largest finite code ("satfinite"): +Inf and anything above the maximum
saturate, which is also what the hardware conversions with ``.satfinite`` do.

Formats (docs/numerics.md "Element and scale codes")::

    E2M1   1-2-1, bias 1, values 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign; no NaN, no Inf
    E4M3fn 1-4-3, bias 7, max 448 (0x7E); S.1111.111 is NaN; no Inf
    UE8M0  8 exponent bits, value 2^(e - 127) for e in 0..254; 0xFF is NaN; no zero, no sign

NaN has no E2M1 code: ``encode_e2m1`` maps it to +6 (code 7), as PTX's ``cvt...satfinite.e2m1``
does ("NaN results are converted to positive MAX_NORM"); the block quantizers go further and
mark a non-finite block NaN through its scale (see blocks.py).

Packing: two E2M1 codes per byte, element 2i in the low nibble, element 2i+1 in the high one.

Public: ``encode_e2m1``, ``decode_e2m1``, ``encode_e4m3``, ``decode_e4m3``, ``encode_ue8m0``,
``decode_ue8m0``, ``pack_nibbles``, ``unpack_nibbles``, ``floor_log2``, ``ceil_log2``,
``E2M1_MAX``, ``E4M3_MAX``, ``E4M3_NAN``, ``UE8M0_NAN``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch._guards import detect_fake_mode

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
UE8M0_NAN = 0xFF
FLT_MAX = torch.finfo(torch.float32).max

_E2M1 = (2, 1, 1, 0x7)  # ebits, mbits, bias, largest finite magnitude code
_E4M3 = (4, 3, 7, 0x7E)


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        # a float64 value would be rounded to fp32 first: a double rounding, never the spec's
        raise TypeError(f"codecs take float32, bfloat16 or float16, got {x.dtype}")


def _fp32_bits(x: torch.Tensor) -> torch.Tensor:
    """x: float32/bf16/fp16 -> int64 tensor of its binary32 bit patterns (sign included)."""
    _check_dtype(x)
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _shift_round(sig: torch.Tensor, s: torch.Tensor, rand: torch.Tensor | None) -> torch.Tensor:
    """sig >> s rounded: to nearest even when rand is None, else stochastically with 8 bits.

    sig, s: int64; rand: uint8 random bytes or None. s >= 1 everywhere.
    """
    q = sig >> s
    rem = sig & ((1 << s) - 1)
    if rand is None:
        half = 1 << (s - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    else:
        # up iff r/256 < rem/2^s, i.e. r * 2^s < rem * 256 (exact in int64: both < 2^48)
        up = (rand.to(torch.int64) << s) < (rem << 8)
    return q + up.to(torch.int64)


def _encode_magnitude(bits: torch.Tensor, fmt: tuple[int, int, int, int],
                      rand: torch.Tensor | None) -> torch.Tensor:
    """bits: int64 binary32 patterns with the sign cleared, not NaN -> magnitude codes (int64)."""
    _, mbits, bias, max_code = fmt
    exp = bits >> 23
    sig = (bits & 0x7FFFFF) | ((exp > 0).to(torch.int64) << 23)
    te = exp.clamp(min=1) - 127 + bias
    s = (23 - mbits) + (1 - te).clamp(min=0)
    s = s.clamp(max=40)  # beyond 25 everything rounds to 0 anyway; keeps shifts in range
    code = ((te - 1).clamp(min=0) << mbits) + _shift_round(sig, s, rand)
    # codes past the format's range (and +Inf, whose te is huge) saturate
    return code.clamp(max=max_code)


def encode_e2m1(x: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    """x: [...] float -> codes: [...] uint8 in 0..15 (bit 3 = sign), one code per element.

    Round-to-nearest-even when ``rand`` is None; stochastic rounding with the 8-bit random bytes
    ``rand`` ([...] uint8, same shape) otherwise. Saturates to +-6 (Inf too); NaN -> 7 (+6, as PTX); -0.0 -> 8.
    """
    if rand is not None and (rand.shape != x.shape or rand.dtype != torch.uint8):
        raise ValueError(f"rand must be uint8 of shape {tuple(x.shape)}, "
                         f"got {rand.dtype} {tuple(rand.shape)}")
    if rand is None:
        return _encode_e2m1_rtne(x)
    bits = _fp32_bits(x)
    sign = (bits >> 31) & 1
    mag_bits = bits & 0x7FFFFFFF
    nan = mag_bits > 0x7F800000
    code = _encode_magnitude(mag_bits, _E2M1, rand)
    code = torch.where(nan, 0x7, code | (sign << 3))
    return code.to(torch.uint8)


# E2M1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7) and the midpoints between neighbours;
# a midpoint rounds to the even code, so it counts as "past" (>=) when the code above is even
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                   (5.0, False))


def _encode_e2m1_rtne(x: torch.Tensor) -> torch.Tensor:
    """encode_e2m1 without random bits: the code is the number of midpoints |x| lies past, exact
    comparisons in fp32 (the same codes as _encode_magnitude's integer rounding, several times
    faster on a CPU; tests compare the two over every bf16 and fp16 value and around each midpoint)."""
    _check_dtype(x)
    xf = x.to(torch.float32)
    mag = xf.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _E2M1_MIDPOINTS:  # +Inf passes all seven: saturates to 6, like the rest above it
        code += (mag >= mid) if tie_up else (mag > mid)
    code |= torch.signbit(xf).to(torch.uint8) << 3
    return torch.where(torch.isnan(xf), 0x7, code)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x: [...] float -> [...] float8_e4m3fn, RTNE with saturation to +-448; NaN -> 0x7F."""
    bits = _fp32_bits(x)
    sign = (bits >> 31) & 1
    mag_bits = bits & 0x7FFFFFFF
    nan = mag_bits > 0x7F800000
    code = _encode_magnitude(mag_bits, _E4M3, None) | (sign << 7)
    code = torch.where(nan, E4M3_NAN, code)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


@lru_cache(maxsize=None)
def _minifloat_table(ebits: int, mbits: int, bias: int, signed: bool) -> torch.Tensor:
    """All 2^(1+ebits+mbits) codes -> fp32 values, built from the bit fields (CPU tensor)."""
    n = 1 << (ebits + mbits)
    code = torch.arange(n, dtype=torch.int64)
    e = code >> mbits
    m = code & ((1 << mbits) - 1)
    # normal: 2^(e-bias) * (1 + m/2^mbits); subnormal (e == 0): 2^(1-bias) * m/2^mbits
    normal_bits = ((e - bias + 127) << 23) | (m << (23 - mbits))
    normal = normal_bits.to(torch.int32).view(torch.float32)
    subnormal = torch.ldexp(m.to(torch.float32), torch.tensor(1 - bias - mbits, dtype=torch.float32))
    mag = torch.where(e == 0, subnormal, normal)
    return torch.cat([mag, -mag]) if signed else mag


def _host_table(name: str) -> torch.Tensor:
    return {"e2m1": _minifloat_table(2, 1, 1, True), "e4m3": _E4M3_TABLE}[name]


@lru_cache(maxsize=None)
def _table_on(name: str, device: torch.device) -> torch.Tensor:
    """A decode table copied to ``device`` once: a copy per decode would be a host-to-device transfer
    inside the step, which a CUDA graph cannot capture (a dithered weight decodes its block scales).
    A step's eager warm-up fills it; a first decode on the device under capture is refused here."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the {name.upper()} decode table is not on {device} yet, and a CUDA graph cannot "
                           "capture its copy: decode once on that device before capturing (an eager warm-up step)")
    return _host_table(name).to(device)


def _lookup(name: str, codes: torch.Tensor) -> torch.Tensor:
    # a fake tensor (tracing, export) gets its own copy, made from the values (a constant of the
    # graph: a tracer takes no real tensor in): the cache must hold only real tensors
    table = (torch.tensor(_host_table(name).tolist(), dtype=torch.float32, device=codes.device)
             if detect_fake_mode((codes,)) else _table_on(name, codes.device))
    return torch.take(table, codes.to(torch.int64))  # a copy always: a 0-dim index would alias the table


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes: [...] uint8 in 0..15 -> [...] float32 values (code 8 decodes to -0.0)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes must be uint8, got {codes.dtype}")
    return _lookup("e2m1", codes & 0xF)


def _e4m3_table() -> torch.Tensor:
    table = _minifloat_table(4, 3, 7, True).clone()
    table[E4M3_NAN] = table[E4M3_NAN | 0x80] = float("nan")
    return table


_E4M3_TABLE = _e4m3_table()


def decode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x: [...] float8_e4m3fn (or its uint8 bytes) -> [...] float32 (0x7F, 0xFF -> NaN)."""
    if x.dtype == torch.float8_e4m3fn:
        x = x.view(torch.uint8)
    if x.dtype != torch.uint8:
        raise TypeError(f"E4M3 scales must be float8_e4m3fn or uint8, got {x.dtype}")
    return _lookup("e4m3", x)


def encode_ue8m0(exponent: torch.Tensor) -> torch.Tensor:
    """exponent: [...] int unbiased, already clamped to [-127, 127] -> [...] uint8 (e + 127)."""
    if exponent.is_floating_point():
        raise TypeError(f"UE8M0 takes integer exponents, got {exponent.dtype}")
    if exponent.numel() and (exponent.min() < -127 or exponent.max() > 127):
        raise ValueError(f"UE8M0 exponent out of [-127, 127]: "
                         f"[{int(exponent.min())}, {int(exponent.max())}]")
    return (exponent.to(torch.int64) + 127).to(torch.uint8)


def decode_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """x: [...] uint8 -> [...] float32 2^(x - 127); 0x00 -> 2^-127 (an fp32 subnormal); 0xFF -> NaN."""
    if x.dtype != torch.uint8:
        raise TypeError(f"UE8M0 scales must be uint8, got {x.dtype}")
    e = x.to(torch.int64)
    bits = torch.where(e == 0, 1 << 22, e << 23)  # 2^-127 = fp32 bits 0x00400000
    bits = torch.where(e == UE8M0_NAN, 0x7FC00000, bits)
    return bits.to(torch.int32).view(torch.float32)


def _fp64_exponent_mantissa(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: positive finite float -> (unbiased exponent, mantissa bits) of its exact fp64 value.

    fp32 subnormals are fp64 normals, so one code path serves every fp32 input.
    """
    bits = x.to(torch.float64).contiguous().view(torch.int64)
    return ((bits >> 52) & 0x7FF) - 1023, bits & ((1 << 52) - 1)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """x: [...] positive finite float -> [...] int64 floor(log2(x)), exact (bit extraction)."""
    exponent, _ = _fp64_exponent_mantissa(x)
    return exponent


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """x: [...] positive finite float -> [...] int64 ceil(log2(x)), exact (bit extraction)."""
    exponent, mantissa = _fp64_exponent_mantissa(x)
    return exponent + (mantissa != 0).to(torch.int64)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., 2n] uint8 in 0..15 -> [..., n] uint8; element 2i low nibble, 2i+1 high."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension: shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., n] uint8 -> [..., 2n] uint8 codes (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
