"""NVFP4: E2M1 elements in 16-element blocks, an E4M3 scale per block, an FP32 scale per tensor.

Two-level scaling lets the E4M3 block scales use their whole range whatever the tensor's
magnitude: the tensor scale maps the tensor's amax onto 448 * 6, the largest value a block scale
times an element can express. The profiles (types.NVFP4Profile) compute in fp32, one rounding
per operation, in exactly this order::

    profile te (default: TransformerEngine, torchao training; docs/numerics.md "NVFP4")
      amax  = max |x| over the tensor (finite values; or the caller's all-reduced global_amax)
      S_enc = min(2688 / amax, FLT_MAX);  S_enc = 1 if amax == 0 or S_enc == 0;  S_dec = 1 / S_enc
      s_b   = e4m3(min(block_amax * (S_enc * fp32(1/6)), 448))     no lower clamp: tiny -> 0
      e_b   = min(1 / (fp32(s_b) * S_dec), FLT_MAX)
      code  = e2m1(clamp(x * e_b, -6, 6))
    profile torchao (torchao 0.18 nvfp4_quantize, the PTQ path)
      S_dec = amax / 2688   (amax == 0: S_dec = 1 / 2688, i.e. as if amax were 1)
      s_b   = e4m3(clamp((block_amax / 6) / S_dec, 2^-6, 448))    an all-zero block gets 0x08
      code  = e2m1(clamp(x * (min(1 / S_dec, FLT_MAX) / fp32(s_b)), -6, 6))
      (torchao divides by zero for an all-zero tensor and overflows 1 / S_dec for amax below
      2688 / FLT_MAX; both clamps are ours)
    profile four_over_six (Four Over Six, arXiv 2512.02010; te's arithmetic, two candidates)
      S_enc = min(1536 / amax, FLT_MAX) (1 if amax == 0 or S_enc == 0);  S_dec = 1 / S_enc
      for M in 6, 4:
        s_M   = e4m3(min(block_amax * (S_enc * fp32(1/M)), 448))     (<= 256 * 6 / M <= 384)
        e_M   = min(1 / (fp32(s_M) * S_dec), FLT_MAX)
        c_M   = e2m1_rtne(clamp(|x| * e_M, 0, 6))
        err_M = tree_sum(((e2m1_value(c_M) * fp32(s_M)) * S_dec - |x|)^2)
      tree_sum adds neighbours pairwise, (0+1), (2+3), ..., then the pair sums the same way, over
      the block's 16 elements; a 16x16 tile sums its 256 by 2x2 quads [[a, b], [c, d]] as
      (a + d) + (b + c), level by level (the same sum for the tile and its transpose, so a weight
      and its transpose still quantize alike). Every implementation rounds the same sums in the
      same order: block_error. The block takes M = 4 when
      err_4 < err_6 (ties keep 6), then quantizes with s_M, e_M and the asked rounding; the choice
      is made on round-to-nearest errors even under stochastic rounding, so it does not hang on the
      random bits.
    dequantize: x ~= e2m1_value * fp32(s_b) * S_dec   (the first product is exact)

In the te profile a block whose scale underflows to 0 dequantizes to 0 whatever its codes (its
elements saturate to +-6 because e_b = FLT_MAX): "flushed", reported by stats.py. Measured on
Gaussian data (tests/formats/test_nvfp4.py): the profiles' scale bytes agree except where te's
is below 2^-6 (torchao's floor) or the exact block scale is an E4M3 tie, which te's folded
fp32(1/6) breaks upward; on bf16 input about 0.1% of code bytes differ, on fp32 input almost none.

2D blocks (16x16, for weights): one amax and one scale per 16x16 tile, replicated into each of
the tile's 16 row blocks, so a weight and its transpose quantize to the same values.

Rounding: RTNE, or stochastic with rng.py's Philox bytes indexed in the stored [*lead, Lp] order.

Hadamard (``hadamard=`` "none" | "te" | "random", the Wgrad operands of NVIDIA's recipe): x is
first rotated by hadamard.py's 16-point transform along the quantized axis and rounded to x's
dtype, then quantized; the tensor amax is that of the rotated tensor.

Public: ``quantize_nvfp4``, ``nvfp4_tensor_terms``, ``nvfp4_block_scales``.
"""

from __future__ import annotations


import torch

from .blocks import block_amax, blocks_of, check_input, finite_amax, prepare, stochastic_bytes
from .codes import E4M3_NAN, FLT_MAX, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, pack_nibbles
from .hadamard import hadamard_transform
from .types import Format, FP4Tensor, NVFP4Profile, Rounding

_f32 = lambda v, device: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731


def quantize_nvfp4(x: torch.Tensor, *, axis: int = -1, block: int | tuple[int, int] = 16,
                   rounding: str | Rounding = Rounding.RTNE,
                   seed: int | torch.Generator | None = None,
                   profile: str | NVFP4Profile = NVFP4Profile.TE,
                   global_amax: float | torch.Tensor | None = None,
                   pad: bool = False, hadamard: str | None = None,
                   hadamard_seed: int | torch.Generator | None = None,
                   global_encode: torch.Tensor | None = None) -> FP4Tensor:
    """x: [...] float32/bf16/fp16 -> FP4Tensor with codes [*lead, L/2] and scales [*lead, L/16].

    axis: the contraction axis the 16-element blocks run along; it is stored last.
    block: 16 (1x16) or (16, 16) (2D tiles; x must be 2D).
    rounding: "rtne" or "stochastic" (8 random bits per element from ``seed``).
    seed: int, torch.Generator, or None (drawn from torch's default generator) for stochastic.
    global_amax: use this amax instead of x's own (e.g. all-reduced across ranks); must be finite.
    pad: zero-pad the quantized axis (and the other one for 16x16) to the block size.
    hadamard / hadamard_seed: rotate x first (signs "none", "te" or "random" from the seed).
    global_encode: the encode multiplier S_enc itself (te profile), as a checkpoint's static
      activation scale gives it, instead of 2688 / amax: S_dec is then fp32(1 / S_enc).
    """
    block2 = _nvfp4_block(block)
    rounding = Rounding.parse(rounding)
    profile = NVFP4Profile.parse(profile)
    if hadamard is not None:
        check_input(x, axis, block2, pad)  # report the caller's shape before the transform's
        x = hadamard_transform(x, axis=axis, size=16, signs=hadamard, seed=hadamard_seed)
    xm, axis = prepare(x, axis, block2, pad)
    xb = blocks_of(xm, 16)  # [*lead, nb, 16]
    b_amax, bad = block_amax(xb, block2[0])  # [*lead, nb]
    if global_encode is not None:
        s_dec, block_mult = _encode_terms(global_encode, global_amax, profile, xm.device)
    else:
        amax = finite_amax(xm) if global_amax is None else _check_amax(global_amax, xm.device)
        s_dec, block_mult = nvfp4_tensor_terms(amax, profile)
    scales, e_b = nvfp4_block_scales(b_amax, s_dec, block_mult, profile, xb=xb, tile_rows=block2[0])
    scaled = torch.clamp(xb * e_b[..., None], -6.0, 6.0).reshape(xm.shape)
    codes = encode_e2m1(scaled, stochastic_bytes(rounding, seed, xm))
    codes = torch.where(bad[..., None], 0, blocks_of(codes, 16)).reshape(xm.shape)
    scales = torch.where(bad, E4M3_NAN, scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    return FP4Tensor(codes=pack_nibbles(codes), scales=scales, tensor_scale=s_dec,
                     shape=x.shape, axis=axis, block=block2, format=Format.NVFP4,
                     rounding=rounding, profile=profile)


def nvfp4_tensor_terms(amax: torch.Tensor, profile: NVFP4Profile) -> tuple[torch.Tensor, torch.Tensor]:
    """amax: [] float32 -> (S_dec, block multiplier), both [] float32.

    te: the multiplier is S_enc * fp32(1/6), applied to block amax; four_over_six: S_enc itself
    (each candidate folds its own 1/M); torchao: 1 / S_dec, the numerator of the element scale.
    Fast paths call this too, so the scalars are shared.
    """
    dev = amax.device
    if profile is not NVFP4Profile.TORCHAO:
        s_enc = torch.clamp(_f32(_TARGET[profile], dev) / amax, max=FLT_MAX)
        s_enc = torch.where((amax == 0) | (s_enc == 0), _f32(1.0, dev), s_enc)
        return _f32(1.0, dev) / s_enc, (s_enc * _f32(1 / 6, dev) if profile is NVFP4Profile.TE else s_enc)
    s_dec = torch.where(amax == 0, _f32(1.0, dev), amax) / _f32(2688.0, dev)
    # amax < 2688 / FLT_MAX would make 1 / S_dec infinite (and 0 * inf NaN): clamp like te does
    return s_dec, torch.clamp(_f32(1.0, dev) / s_dec, max=FLT_MAX)


_TARGET = {NVFP4Profile.TE: 2688.0, NVFP4Profile.FOUR_OVER_SIX: 1536.0}  # 6 * 448, 6 * 256


def nvfp4_block_scales(b_amax: torch.Tensor, s_dec: torch.Tensor, block_mult: torch.Tensor,
                       profile: NVFP4Profile, *, xb: torch.Tensor | None = None,
                       tile_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """b_amax: [...] float32 -> (block scales [...] float8_e4m3fn, element scales e_b [...] float32).
    four_over_six also needs the blocks xb [..., 16] (and tile_rows 16 for 16x16 tiles)."""
    if profile is NVFP4Profile.TE:
        return _te_scales(b_amax, s_dec, block_mult)
    if profile is NVFP4Profile.FOUR_OVER_SIX:
        if xb is None:
            raise ValueError("four_over_six chooses each block's scale from its values: pass xb")
        return _four_over_six_scales(xb, b_amax, s_dec, block_mult, tile_rows)
    scales = encode_e4m3(torch.clamp((b_amax / 6.0) / s_dec, 2.0**-6, 448.0))
    return scales, block_mult / decode_e4m3(scales)


def _te_scales(b_amax: torch.Tensor, s_dec: torch.Tensor, mult: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = encode_e4m3(torch.clamp(b_amax * mult, max=448.0))
    return scales, torch.clamp(1.0 / (decode_e4m3(scales) * s_dec), max=FLT_MAX)


def _four_over_six_scales(xb: torch.Tensor, b_amax: torch.Tensor, s_dec: torch.Tensor, s_enc: torch.Tensor,
                          tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    mag = torch.where(torch.isfinite(xb), xb.abs(), 0.0)  # a non-finite block is poisoned later anyway
    candidates = []
    for target in (6, 4):
        scales, e_b = _te_scales(b_amax, s_dec, s_enc * _f32(1 / target, xb.device))
        codes = encode_e2m1(torch.clamp(mag * e_b[..., None], max=6.0))
        error = (decode_e2m1(codes) * decode_e4m3(scales)[..., None]) * s_dec - mag
        candidates.append((scales, e_b, block_error(error * error, tile_rows)))
    (s6, e6, err6), (s4, e4, err4) = candidates
    four = err4 < err6
    return torch.where(four, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn), \
        torch.where(four, e4, e6)


def block_error(sq: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    """sq: [*lead, nb, 16] float32 squared errors -> [*lead, nb] their sum per block, in a fixed
    order: neighbours pairwise, level by level. 16x16 tiles ([R, nb, 16], tile_rows 16): one sum
    per tile, replicated to its 16 rows, over 2x2 quads [[a, b], [c, d]] as (a + d) + (b + c),
    level by level, which gives the same fp32 sum for a tile and its transpose."""
    if tile_rows == 1:
        while sq.shape[-1] > 1:
            pairs = sq.unflatten(-1, (sq.shape[-1] // 2, 2))
            sq = pairs[..., 0] + pairs[..., 1]
        return sq[..., 0]
    r, nb, n = sq.shape
    t = sq.reshape(r // tile_rows, tile_rows, nb, n).permute(0, 2, 1, 3)  # [tiles, nb, 16 rows, 16 cols]
    while t.shape[-1] > 1:
        q = t.unflatten(-1, (t.shape[-1] // 2, 2)).unflatten(-3, (t.shape[-2] // 2, 2))  # [.., i, 2, j, 2]
        t = (q[..., 0, :, 0] + q[..., 1, :, 1]) + (q[..., 0, :, 1] + q[..., 1, :, 0])
    return t[..., 0, 0].repeat_interleave(tile_rows, 0)


def _nvfp4_block(block: int | tuple[int, int]) -> tuple[int, int]:
    if block in (16, (1, 16)):
        return (1, 16)
    if block == (16, 16):
        return (16, 16)
    raise ValueError(f"NVFP4 blocks are 16 (1x16) or (16, 16), got {block!r}")


def _encode_terms(s_enc: torch.Tensor, global_amax, profile: NVFP4Profile,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_dec, block multiplier) of the te profile from a given S_enc (nvfp4_tensor_terms' te branch)."""
    if global_amax is not None or profile is not NVFP4Profile.TE:
        raise ValueError("global_encode goes with the te profile and no global_amax")
    s_enc = s_enc.to(device=device, dtype=torch.float32).reshape(())
    if not bool(torch.isfinite(s_enc)) or not bool(s_enc > 0):
        raise ValueError(f"global_encode must be finite and > 0, got {float(s_enc)}")
    return _f32(1.0, device) / s_enc, s_enc * _f32(1 / 6, device)


def _check_amax(global_amax: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(global_amax, torch.Tensor):  # check on the host, then fill: no copy, no sync
        if not (0 <= global_amax <= FLT_MAX):  # NaN fails too
            raise ValueError(f"global_amax must be a finite float32 value >= 0, got {global_amax}")
        return torch.full((), global_amax, dtype=torch.float32, device=device)
    amax = global_amax.to(device=device, dtype=torch.float32).reshape(())
    if not bool(torch.isfinite(amax)) or bool(amax < 0):
        raise ValueError(f"global_amax must be finite and >= 0, got {float(amax)}")
    return amax
