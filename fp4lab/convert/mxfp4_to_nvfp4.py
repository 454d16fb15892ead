"""MXFP4 -> NVFP4 conversion: when the E2M1 codes can be kept verbatim, and what to do when not.

An MXFP4 block j (32 elements) holds codes c with a power-of-two scale 2^k_j, so its values are
c * 2^k_j. NVFP4 splits it into two 16-element blocks with an E4M3 scale s_b and one FP32 tensor
scale S_dec. Keeping the codes verbatim needs s_b * S_dec = 2^k_j. With S_dec = 2^m, s_b must be
the power of two 2^(k_j - m), and E4M3 holds exactly 2^-9 .. 2^8: verbatim is exact iff
k_j - m is in [-9, 8] for every block, i.e. iff the tensor's block-exponent spread
k_max - k_min <= 17 (blocks that are all zero take any scale and are left out of the spread).

Methods (docs/numerics.md "MXFP4 -> NVFP4 conversion", after the Model-Optimizer draft study):
    requant          Algo 1: dequantize, requantize with quantize_nvfp4 (profile te).
    verbatim-mid     Algo 2: codes verbatim, m centred on the exponent range, out-of-range
                     block scales snapped to 2^-9 or 2^8 (those blocks change by a power of two).
    verbatim-search  Algo 2 with m chosen by exact MSE over a window of candidates.
    hybrid           Algo 3: m = k_max - 8 (closed form), codes verbatim wherever k_j - m is in
                     range, blocks below the range requantized with the fixed S_dec = 2^m.
                     Lossless whenever spread <= 17; a lower m would overflow 448 on top blocks.
    best             ours: the smallest exact MSE among hybrid at every m of the search window and
                     requant. It is never worse than requant (a candidate) and is lossless
                     wherever hybrid is. Beyond hybrid it wins when one dominant outlier makes
                     the power-of-two S_dec costly: requant's continuous S_dec then fits better.

MSE is measured against the MXFP4 values, in float64, over the real (unpadded) elements.

Public: ``ConvertMethod``, ``ConversionReport``, ``mxfp4_to_nvfp4``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..formats import block_values, quantize_nvfp4, with_scale_layout
from ..formats.codes import UE8M0_NAN
from ..formats.types import Format, FP4Tensor, NVFP4Profile, Rounding, ScaleLayout, Choice

E4M3_EXP_MIN, E4M3_EXP_MAX = -9, 8  # the powers of two E4M3 holds
SEARCH_WINDOW = 8  # candidate m: k_max - 8 and k_min + 9, widened by W on either side
_MAGNITUDE_BITS_8 = 0x7777777777777777  # the magnitude bits of 16 E2M1 codes in 8 bytes
M_RANGE = (-126, 116)  # S_dec = 2^m and the requant amax 2688 * 2^m stay normal fp32


class ConvertMethod(Choice):
    REQUANT = "requant"
    VERBATIM_MID = "verbatim-mid"
    VERBATIM_SEARCH = "verbatim-search"
    HYBRID = "hybrid"
    BEST = "best"


@dataclass(frozen=True, kw_only=True)
class ConversionReport:
    """What a conversion did and what it cost."""

    method: str
    """The method asked for; ``chosen`` says which candidate ``best`` took."""
    chosen: str
    spread: int
    """k_max - k_min over the blocks that are not all zero (0 when none are)."""
    m: int | None
    """log2 of the tensor scale S_dec when it is a power of two (verbatim / hybrid), else None."""
    blocks: int
    blocks_out_of_range: int
    """MXFP4 blocks whose scale needs k_j - m outside [-9, 8] (snapped or requantized)."""
    mse: float
    rel_mse: float
    """mse / mean(x^2) of the MXFP4 values (0 for an all-zero tensor)."""

    @property
    def lossless(self) -> bool:
        return self.mse == 0.0


def _exponents(q: FP4Tensor) -> torch.Tensor:
    """q (MXFP4, plain) -> k: [*lead, nb] int64 block exponents."""
    return q.scales.to(torch.int64) - 127


def _live_blocks(q: FP4Tensor) -> torch.Tensor:
    """q (MXFP4, plain) -> [*lead, nb] bool: blocks with a nonzero code (-0 counts as zero)."""
    codes = q.codes.reshape(*q.lead_shape, -1, 16)  # 16 packed bytes = one 32-element block
    if codes.is_contiguous():
        # the pass over all codes is most of the cost: OR a block's two 8-byte words, then test the
        # magnitude bits of its 32 codes at once (a reduction over the pair would be 5x slower)
        words = codes.view(torch.int64)
        return (words[..., 0] | words[..., 1]).bitwise_and_(_MAGNITUDE_BITS_8) != 0
    return ((codes & 0x77) != 0).any(-1)  # magnitude bits of either nibble


def _live_exponent_range(q: FP4Tensor, live: torch.Tensor) -> tuple[int, int]:
    """(k_min, k_max) over the live blocks, (0, 0) when none is; on the UE8M0 bytes, which vectorize."""
    live8 = live.view(torch.uint8)
    if not live8.numel() or not int(live8.max()):  # max, not any(): the byte reduction vectorizes
        return 0, 0
    s_max = int((q.scales * live8).max())  # dead blocks read 0, below any live byte or equal to it
    s_min = int((q.scales | (live8 - 1)).min())  # dead blocks read 0xFF (NaN), above any live byte
    return s_min - 127, s_max - 127


def _e4m3_pow2(scales: torch.Tensor, m: int) -> torch.Tensor:
    """UE8M0 bytes 2^k -> the E4M3 bytes of 2^(k - m) snapped into [2^-9, 2^8]. In uint8 throughout:
    byte ops vectorize, and this runs on every block scale of a checkpoint."""
    lo = 127 + m + E4M3_EXP_MIN  # the UE8M0 byte of the smallest power E4M3 holds
    clamped = scales.clamp(max(lo, 0), min(lo + E4M3_EXP_MAX - E4M3_EXP_MIN, 255))  # out of uint8: no-op
    d = clamped.sub_(lo) if lo >= 0 else clamped.add_(-lo)  # k - m + 9, in [0, 17]
    normal = (d.clamp(min=2) - 2) << 3  # 2^(d - 9) for d >= 3: exponent field d - 2, mantissa 0
    subnormal = torch.ones_like(d) << d.clamp(max=2)  # 2^-9, 2^-8, 2^-7: mantissa 1, 2, 4
    return torch.maximum(normal, subnormal)  # normal is 0 where d <= 2, subnormal <= 4 < 8 elsewhere


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32))


def _verbatim(q: FP4Tensor, live: torch.Tensor, m: int) -> FP4Tensor:
    """Codes kept; NVFP4 block scales 2^(k_j - m) snapped into [2^-9, 2^8]; S_dec = 2^m."""
    scale = _e4m3_pow2(q.scales, m).mul_(live)  # all-zero blocks get scale 0
    # one byte to both NVFP4 halves: widened to 16 bits, (b << 8) | b is b * 0x0101
    scales = (scale.to(torch.int16) * 0x0101).view(torch.uint8).view(torch.float8_e4m3fn)
    return FP4Tensor(codes=q.codes, scales=scales, tensor_scale=_pow2(torch.tensor(m)).to(q.codes.device),
                     shape=q.shape, axis=q.axis, block=(1, 16), format=Format.NVFP4, rounding=Rounding.RTNE,
                     profile=NVFP4Profile.TE)


def _requant(q: FP4Tensor, global_amax: float | None = None) -> FP4Tensor:
    """Dequantize (exact) and requantize in the stored layout, so codes line up with q's."""
    nv = quantize_nvfp4(block_values(q), global_amax=global_amax)
    return dataclasses.replace(nv, shape=q.shape, axis=q.axis)


def _out_of_range(k: torch.Tensor, live: torch.Tensor, m: int) -> torch.Tensor:
    """Blocks (not all zero) whose scale 2^(k_j - m) E4M3 cannot hold exactly."""
    return live & (((k - m) < E4M3_EXP_MIN) | ((k - m) > E4M3_EXP_MAX))


def _hybrid(q: FP4Tensor, k: torch.Tensor, live: torch.Tensor, m: int) -> tuple[FP4Tensor, int]:
    """Verbatim where k_j - m is in range, requantized with S_dec = 2^m elsewhere."""
    nv = _verbatim(q, live, m)
    out = _out_of_range(k, live, m)
    if not out.any():
        return nv, 0
    rq = _requant(q, global_amax=2688.0 * 2.0**m)  # S_enc = 2^-m exactly, so S_dec = 2^m
    codes = torch.where(out[..., None], rq.codes.reshape(*out.shape, 16), nv.codes.reshape(*out.shape, 16))
    scales = torch.where(out[..., None], rq.scales.view(torch.uint8).reshape(*out.shape, 2),
                         nv.scales.view(torch.uint8).reshape(*out.shape, 2))
    return dataclasses.replace(nv, codes=codes.reshape(nv.codes.shape),
                               scales=scales.reshape(nv.scales.shape).view(torch.float8_e4m3fn)), int(out.sum())


def _mse(nv: FP4Tensor, reference: torch.Tensor, count: int) -> float:
    got = block_values(nv).double() * float(nv.tensor_scale)
    return float((got - reference).square().sum()) / max(count, 1)


def mxfp4_to_nvfp4(q_mx: FP4Tensor, method: str | ConvertMethod = ConvertMethod.BEST
                   ) -> tuple[FP4Tensor, ConversionReport]:
    """q_mx: an MXFP4 FP4Tensor -> (the NVFP4 FP4Tensor with the same shape and axis, a report)."""
    method = ConvertMethod.parse(method)
    if not isinstance(q_mx, FP4Tensor) or q_mx.format is not Format.MXFP4:
        raise TypeError(f"mxfp4_to_nvfp4 takes an MXFP4 FP4Tensor, got {getattr(q_mx, 'format', type(q_mx))}")
    q = with_scale_layout(q_mx, ScaleLayout.PLAIN)
    if q.scales.numel() and int(q.scales.max()) == UE8M0_NAN:  # NaN is the largest byte: max vectorizes
        raise ValueError(f"{int((q.scales == UE8M0_NAN).sum())} MXFP4 block scales are NaN (0xFF): "
                         "there is no NVFP4 value to convert them to")
    live = _live_blocks(q)
    k_min, k_max = _live_exponent_range(q, live)
    if method in (ConvertMethod.HYBRID, ConvertMethod.BEST) and k_max - k_min <= 17:
        # every block in range at the closed-form m: verbatim is exact, so nothing can beat it
        nv = _verbatim(q, live, k_max - 8)
        return nv, ConversionReport(method=method.value, chosen="hybrid", spread=k_max - k_min, m=k_max - 8,
                                    blocks=int(live.numel()), blocks_out_of_range=0, mse=0.0, rel_mse=0.0)
    k = _exponents(q)
    reference = block_values(q).double()  # exact MXFP4 values in the stored layout
    count = q.shape.numel()
    lo, hi = sorted((k_max - 8, k_min + 9))  # the in-range interval of m, or its reversal (spread > 17)
    window = range(lo - SEARCH_WINDOW, hi + SEARCH_WINDOW + 1)
    window = [m for m in window if M_RANGE[0] <= m <= M_RANGE[1]]

    candidates: list[tuple[str, FP4Tensor, int | None, int]] = []  # earlier wins ties
    if method in (ConvertMethod.HYBRID, ConvertMethod.BEST):
        closed = min(max(k_max - 8, M_RANGE[0]), M_RANGE[1])  # near the exponent limits: the nearest m that works
        ms = [closed] if method is ConvertMethod.HYBRID else sorted(window, key=lambda m: m != closed)
        for m in ms:  # the closed form first
            nv, out = _hybrid(q, k, live, m)
            candidates.append(("hybrid", nv, m, out))
    if method in (ConvertMethod.VERBATIM_MID, ConvertMethod.VERBATIM_SEARCH):
        ms = [-(-(k_max + k_min + 1) // 2)] if method is ConvertMethod.VERBATIM_MID else window
        for m in ms:
            candidates.append((method.value, _verbatim(q, live, m), m, int(_out_of_range(k, live, m).sum())))
    if method in (ConvertMethod.REQUANT, ConvertMethod.BEST):
        candidates.append(("requant", _requant(q), None, 0))

    scored = [(_mse(nv, reference, count), i) for i, (_, nv, _, _) in enumerate(candidates)]
    mse, index = min(scored)
    chosen, nv, m, out = candidates[index]
    power = float(reference.square().sum()) / max(count, 1)
    report = ConversionReport(method=method.value, chosen=chosen, spread=k_max - k_min, m=m,
                              blocks=int(k.numel()), blocks_out_of_range=out, mse=mse,
                              rel_mse=mse / power if power > 0 else 0.0)
    return nv, report
