"""A second, deliberately naive implementation of the docs/numerics.md formulas, for testing the
reference: scalar numpy float32 arithmetic (IEEE single, one rounding per operation) and
brute-force nearest-value searches instead of bit manipulation. Slow; small inputs only."""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E4M3_VALUES = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
               for e in range(16) for m in range(8)][:127]  # codes 0x00..0x7E


def nearest_code(a: float, values: list[float]) -> int:
    """Index of the value nearest to a >= 0, ties to the even index."""
    return min(range(len(values)), key=lambda c: (abs(values[c] - a), c & 1))


def e2m1(v: float) -> int:
    if math.isnan(v):
        return 7
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    return sign | (7 if a >= 6 else nearest_code(a, E2M1_VALUES))


def e4m3(v: float) -> int:
    a = abs(v)
    code = 0x7E if a > 448 else nearest_code(a, E4M3_VALUES)
    return code | (0x80 if math.copysign(1.0, v) < 0 else 0)


def e4m3_value(code: int) -> F32:
    return F32(E4M3_VALUES[code & 0x7F] * (-1 if code & 0x80 else 1))


def nvfp4_te(x: np.ndarray) -> tuple[list[int], list[int], F32]:
    """x: [R, L] float32, L % 16 == 0 -> (codes row-major, scale bytes, S_dec)."""
    with np.errstate(divide="ignore", over="ignore"):
        amax = F32(np.abs(x).max()) if x.size else F32(0)
        s_enc = F32(min(F32(2688) / amax, FLT_MAX)) if amax > 0 else F32(1)
        s_enc = F32(1) if s_enc == 0 else s_enc
        s_dec = F32(1) / s_enc
        codes, scales = [], []
        for block in x.reshape(-1, 16):
            sb = e4m3(min(F32(np.abs(block).max()) * (s_enc * F32(1 / 6)), F32(448)))
            eb = F32(min(F32(1) / (e4m3_value(sb) * s_dec), FLT_MAX))
            scales.append(sb)
            codes += [e2m1(float(np.clip(v * eb, -6, 6))) for v in block]
    return codes, scales, s_dec


def nvfp4_torchao(x: np.ndarray) -> tuple[list[int], list[int], F32]:
    amax = F32(np.abs(x).max())
    s_dec = (amax if amax > 0 else F32(1)) / F32(2688)
    codes, scales = [], []
    for block in x.reshape(-1, 16):
        sb = e4m3(float(np.clip((F32(np.abs(block).max()) / F32(6)) / s_dec, 2.0**-6, 448)))
        eb = (F32(1) / s_dec) / e4m3_value(sb)
        scales.append(sb)
        codes += [e2m1(float(np.clip(v * eb, -6, 6))) for v in block]
    return codes, scales, s_dec


def mx_exponent(amax: float, mode: str) -> int:
    if amax == 0:
        return -127
    if mode == "rceil":
        q = float(F32(amax) * F32(1 / 6))
        e = math.ceil(math.log2(q)) if q > 0 else -127
    else:
        mantissa, exp = math.frexp(amax)  # amax = mantissa * 2^exp, mantissa in [0.5, 1)
        floor_log2 = exp - 1
        if mode == "floor":
            e = floor_log2 - 2
        elif mode == "ceil":
            e = floor_log2 + (mantissa != 0.5) - 2
        else:  # even: mantissa (1.m form) >= 1.75 goes to the next binade
            e = floor_log2 + (2 * mantissa >= 1.75) - 2
    return max(-127, min(127, e))


def mxfp4(x: np.ndarray, mode: str) -> tuple[list[int], list[int]]:
    codes, scales = [], []
    for block in x.reshape(-1, 32):
        e = mx_exponent(float(np.abs(block).max()), mode)
        scales.append(e + 127)
        codes += [e2m1(math.ldexp(float(v), -e)) for v in block]
    return codes, scales


def _pairwise(values: list) -> F32:
    """Neighbours added pairwise, level by level (the four_over_six block error order)."""
    while len(values) > 1:
        values = [F32(values[i] + values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def _quads(grid: list[list]) -> F32:
    """A 2^k x 2^k grid summed by 2x2 quads [[a, b], [c, d]] as (a + d) + (b + c), level by level."""
    while len(grid) > 1:
        n = len(grid) // 2
        grid = [[F32(F32(grid[2 * i][2 * j] + grid[2 * i + 1][2 * j + 1])
                     + F32(grid[2 * i][2 * j + 1] + grid[2 * i + 1][2 * j])) for j in range(n)] for i in range(n)]
    return grid[0][0]


def nvfp4_four_over_six(x: np.ndarray, tile: bool = False) -> tuple[list[int], list[int], F32]:
    """x: [R, L] float32 (R % 16 == 0 for tiles) -> (codes row-major, scale bytes, S_dec): each
    block (or 16x16 tile) tries block amax -> 6 and -> 4 and keeps the smaller squared error."""
    with np.errstate(divide="ignore", over="ignore"):
        amax = F32(np.abs(x).max()) if x.size else F32(0)
        s_enc = F32(min(F32(1536) / amax, FLT_MAX)) if amax > 0 else F32(1)
        s_enc = F32(1) if s_enc == 0 else s_enc
        s_dec = F32(1) / s_enc
        rows, length = x.shape
        codes = np.zeros((rows, length), dtype=np.int64)
        scales = np.zeros((rows, length // 16), dtype=np.int64)
        units = ([(slice(r, r + 16), slice(c, c + 16)) for r in range(0, rows, 16) for c in range(0, length, 16)]
                 if tile else [(slice(r, r + 1), slice(c, c + 16)) for r in range(rows) for c in range(0, length, 16)])
        for rs, cs in units:
            unit = x[rs, cs]
            b_amax = F32(np.abs(unit).max())
            best = None
            for target in (6, 4):
                sb = e4m3(min(b_amax * (s_enc * F32(1 / target)), F32(448)))
                eb = F32(min(F32(1) / (e4m3_value(sb) * s_dec), FLT_MAX))
                unit_codes = [[e2m1(float(np.clip(v * eb, -6, 6))) for v in row] for row in unit]
                sq = [[F32(d * d) for d in (F32(F32(E2M1_VALUES[c & 7]) * e4m3_value(sb)) * s_dec - F32(abs(v))
                                            for c, v in zip(crow, row))] for crow, row in zip(unit_codes, unit)]
                error = _quads(sq) if tile else _pairwise(sq[0])
                if best is None or error < best[0]:  # ties keep the first candidate, 6
                    best = (error, sb, unit_codes)
            codes[rs, cs] = np.array(best[2])
            scales[rs, cs.start // 16] = best[1]
    return codes.reshape(-1).tolist(), scales.reshape(-1).tolist(), s_dec
