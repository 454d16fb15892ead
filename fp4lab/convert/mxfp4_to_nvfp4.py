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
from ..formats.codes import UE8M0_NAN, encode_e4m3
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


def _mx_exponents(q: FP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (MXFP4, plain) -> (k: [*lead, nb] int64 block exponents, live: blocks not all zero)."""
    k = q.scales.to(torch.int64) - 127
    codes = q.codes.reshape(*q.lead_shape, -1, 16)  # 16 packed bytes = one 32-element block
    if codes.is_contiguous():  # the same test 8 bytes at a time: the pass over all codes is most of the cost
        return k, ((codes.view(torch.int64) & _MAGNITUDE_BITS_8) != 0).any(-1)
    return k, ((codes & 0x77) != 0).any(-1)  # magnitude bits of either nibble


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32))


def _verbatim(q: FP4Tensor, k: torch.Tensor, live: torch.Tensor, m: int) -> FP4Tensor:
    """Codes kept; NVFP4 block scales 2^(k_j - m) snapped into [2^-9, 2^8]; S_dec = 2^m."""
    e = (k - m).clamp(E4M3_EXP_MIN, E4M3_EXP_MAX)
    # the 18 E4M3 bytes of 2^-9 .. 2^8, encoded once and looked up
    pow2_bytes = encode_e4m3(_pow2(torch.arange(E4M3_EXP_MIN, E4M3_EXP_MAX + 1))).view(torch.uint8).to(k.device)
    scale = torch.where(live, pow2_bytes[e - E4M3_EXP_MIN], 0)
    scales = scale.repeat_interleave(2, dim=-1).view(torch.float8_e4m3fn)  # two NVFP4 halves
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
    nv = _verbatim(q, k, live, m)
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
    if bool((q.scales == UE8M0_NAN).any()):
        raise ValueError(f"{int((q.scales == UE8M0_NAN).sum())} MXFP4 block scales are NaN (0xFF): "
                         "there is no NVFP4 value to convert them to")
    k, live = _mx_exponents(q)
    any_live = bool(live.any())  # masked reductions: k[live] would copy every live exponent, twice
    k_max = int(torch.where(live, k, -(2**62)).max()) if any_live else 0
    k_min = int(torch.where(live, k, 2**62).min()) if any_live else 0
    if method in (ConvertMethod.HYBRID, ConvertMethod.BEST) and k_max - k_min <= 17:
        # every block in range at the closed-form m: verbatim is exact, so nothing can beat it
        nv = _verbatim(q, k, live, k_max - 8)
        return nv, ConversionReport(method=method.value, chosen="hybrid", spread=k_max - k_min, m=k_max - 8,
                                    blocks=int(k.numel()), blocks_out_of_range=0, mse=0.0, rel_mse=0.0)
    reference = block_values(q).double()  # exact MXFP4 values in the stored layout
    count = q.shape.numel()
    lo, hi = sorted((k_max - 8, k_min + 9))  # the in-range interval of m, or its reversal (spread > 17)
    window = range(lo - SEARCH_WINDOW, hi + SEARCH_WINDOW + 1)
    window = [m for m in window if M_RANGE[0] <= m <= M_RANGE[1]]

    candidates: list[tuple[str, FP4Tensor, int | None, int]] = []  # earlier wins ties
    if method in (ConvertMethod.HYBRID, ConvertMethod.BEST):
        ms = [k_max - 8] if method is ConvertMethod.HYBRID else sorted(window, key=lambda m: m != k_max - 8)
        for m in ms:  # the closed form first
            nv, out = _hybrid(q, k, live, m)
            candidates.append(("hybrid", nv, m, out))
    if method in (ConvertMethod.VERBATIM_MID, ConvertMethod.VERBATIM_SEARCH):
        ms = [-(-(k_max + k_min + 1) // 2)] if method is ConvertMethod.VERBATIM_MID else window
        for m in ms:
            candidates.append((method.value, _verbatim(q, k, live, m), m, int(_out_of_range(k, live, m).sum())))
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
