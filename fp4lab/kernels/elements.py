"""Triton device functions for FP4 element and scale codes, mirroring fp4lab.formats.codes.

Each helper computes exactly what its reference twin computes, so the kernels built from them
are byte-identical to fp4lab.formats (tested exhaustively under TRITON_INTERPRET=1):

    e2m1_rtne(v)          0 <= v <= 6 fp32 -> magnitude code, ties to even: the grid steps v + c
                          rounds to above c (c as in e2m1_rtne_value below), two codes on per
                          binade above [0, 2)
    e2m1_stochastic(v, r) the same split, rounding up iff r / 256 < dropped fraction: for v >= 1,
                          (r << 14) < the 22 dropped bits; below 1, r < (2v - floor(2v)) * 256 --
                          codes._shift_round's rule, up-probability ceil(256 frac) / 256
    e2m1_rtne_value(v), e2m1_stochastic_value(v, r)
                          e2m1_value of those codes (unsigned), made without the code (what a
                          kernel writing block values needs: fewer instructions). Nearest even:
                          (v + c) - c with c the power of two whose fp32 step is the grid's step
                          at v (2^22 below 2, 2^23, 2^24). Stochastic: for v >= 1 the bits plus
                          0x3FFFFF - (r << 14), the dropped 22 cleared (the carry is the round up);
                          below 1 the same on 1 + v rounded up (its dropped bits are ceil(frac(2v)
                          2^22)), less 1; e2m1_stochastic reads the code off the same bits. The
                          rounded-up add is one add.rp on an NVIDIA GPU, elsewhere an exact twin
                          in round-to-nearest arithmetic (Fast2Sum)
    e4m3_rtne(y)          0 <= y <= 448 fp32 -> E4M3 byte, codes._encode_magnitude in int32
    e4m3_value(b)         E4M3 byte -> fp32 (exact, from the bit fields); both by the GPU's
                          conversion instructions when compiled for sm_89+ (compile_arch), the
                          integer forms elsewhere and interpreted
    e2m1_value(c)         E2M1 nibble -> fp32;  scale_value(b, NVFP4): E4M3 / UE8M0 byte -> fp32
    philox_bytes(seed, g) Philox4x32-10 of counter g -> the 16 bytes of group g (rng.py's layout)
    widen(x, BF16_BITS)   loaded input (bf16 as int16 bits) -> fp32, exactly
    finite_key(x)         fp32 -> uint32 that orders like |x| over finite x, every Inf and NaN
                          below every finite value: a max over keys is a finite amax (key_bits
                          turns it back into the amax's bits, 0 where nothing was finite)
    to_bf16_rtne(x)       fp32 -> bf16 round to nearest even, in integers (same on every backend)
    round_to_bf16(x)      fp32 -> fp32 rounded to bf16
    pack_nibble_pairs(c)  [.., 2n] codes -> [.., n] bytes, element 2i in the low nibble
    group_of(i, starts, G) row or column index (a tensor or a scalar) -> the group it falls in,
                          groups starting at starts[0..G-1] ascending (MoE experts back to back)
    compile_arch()        the NVIDIA compute capability the compile targets (0: another backend,
                          or interpreted), a constexpr: which inline-PTX forms the helpers take

Public: the functions above (``@triton.jit``, callable from kernels only).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

# compiled for a GPU (not run by Triton's interpreter): hardware conversions round as the spec does
# (bf16 and E4M3, nearest even); the interpreter runs the integer forms (its bf16 cast truncates)
HARDWARE_CONVERT = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@constexpr_function
def compile_arch() -> int:
    """The NVIDIA compute capability this compile is for (90 for sm_90), 0 for other backends and
    interpreted. Read from the compile's own options (the code generator's, up the stack: a
    constexpr function is called while it runs), not first from the active driver: the driver is
    the current device's, and Inductor's compile workers, which compile the traced ops' kernels
    (nn.ops), have no device to ask. Where no code generator is found it asks the driver: none
    active counts as sm_90, one that cannot say as no NVIDIA target (the integer forms: the same
    bytes, more instructions); every compile Triton 3.6 and 3.9 make finds the code generator, so
    this is a guard against a later Triton. Inductor copies a constexpr function's source (not a
    builtin's) into the kernel module its workers compile; ``sys`` is imported inside, as Triton
    refuses a kernel dependency that reaches ``sys._getframe`` through a module global."""
    import sys

    from triton.language.target_info import current_target
    if not HARDWARE_CONVERT.value:
        return 0
    frame = sys._getframe(1)
    while frame is not None:
        arch = getattr(getattr(getattr(frame.f_locals.get("self"), "builder", None), "options", None), "arch", None)
        if isinstance(arch, str):
            return int("".join(c for c in arch[2:] if c.isdigit())) if arch.startswith("sm") else 0
        frame = frame.f_back
    try:
        target = current_target()
    except RuntimeError:
        return 0
    if target is None:
        return 90
    return target.arch if target.backend == "cuda" else 0


@triton.jit
def e2m1_rtne(v):
    """v: fp32 magnitudes in [0, 6] -> int32 codes 0..7."""
    # v + c is v rounded to the grid (e2m1_rtne_value's c = 2^22, 2^23 or 2^24: v's binade, at
    # least 1's, moved up 22 binades), its low significand bits the grid steps above c (0-4 in
    # [0, 2), 2-4 in [2, 4), 2-3 in [4, 6]); each binade above [0, 2) starts two codes on, and
    # binade >> 22 is 254, 256 or 258
    binade = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    steps = (v + (binade + (22 << 23)).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) & 7
    return steps + (binade >> 22) - 254


@triton.jit
def e2m1_stochastic(v, r):
    """v: fp32 magnitudes in [0, 6]; r: int32 random bytes -> int32 codes 0..7."""
    # the code read off _stochastic_sum's bits: 1, 1.5, 2 (0 .. 1 shifted by 1) are 254 .. 256 in
    # bits >> 22, and 1 .. 6 are codes 2 .. 7
    small, s = _stochastic_sum(v, r)
    return (s >> 22) - tl.where(small, 254, 252)


@triton.jit
def e2m1_rtne_value(v):
    """v: fp32 magnitudes in [0, 6] -> fp32 e2m1_value(e2m1_rtne(v)): 0, .5, 1, 1.5, 2, 3, 4 or 6."""
    # the grid's step is 0.5 below 2 (subnormals included), 1 in [2, 4) and 2 in [4, 6]: the step
    # of fp32 at 2^22, 2^23 and 2^24, so adding that power of two rounds v to the grid, ties to
    # even (an even fp32 significand there is an even code), and subtracting it is exact
    c = (tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + (22 << 23)).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def e2m1_stochastic_value(v, r):
    """v: fp32 magnitudes in [0, 6]; r: int32 random bytes -> fp32 e2m1_value(e2m1_stochastic(v, r))."""
    small, s = _stochastic_sum(v, r)
    q = (s & -0x400000).to(tl.float32, bitcast=True)  # the dropped 22 bits cleared
    return tl.where(small, q - 1.0, q)


@triton.jit
def _stochastic_sum(v, r):
    """v: fp32 magnitudes in [0, 6]; r: int32 random bytes -> (v < 1, the int32 sum whose bits from
    22 up are v's stochastic rounding: shifted by 1 where v < 1)."""
    # below 1 the grid (0, .5, 1) is that of 1 + v on [1, 2] less 1: with 1 + v rounded up, its
    # dropped 22 bits are ceil(f), f = frac(2v) 2^22, and ceil(f) > n iff f > n for the integer
    # n = r << 14 (a carry into the kept bit comes only where f > 2^22 - 1, an up anyway)
    small = v < 1.0
    w = tl.where(small, _one_plus_rounded_up(v), v.to(tl.int32, bitcast=True))
    # up iff (r << 14) < the dropped 22 bits, i.e. iff adding 0x3FFFFF - (r << 14) carries into
    # bit 22 (a carry out of the significand makes the next power of 2)
    return small, w + (0x3FFFFF - (r << 14))


@triton.jit
def _one_plus_rounded_up(v):
    """v: fp32 in [0, 1) -> the int32 bits of 1 + v rounded toward +infinity: one add.rp on an
    NVIDIA GPU, _one_plus_rounded_up_fast2sum elsewhere (the same bits)."""
    if compile_arch() > 0:
        return tl.inline_asm_elementwise("add.rp.f32 $0, $1, 0f3F800000;", "=r,r", [v], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return _one_plus_rounded_up_fast2sum(v)


@triton.jit
def _one_plus_rounded_up_fast2sum(v):
    """_one_plus_rounded_up in round-to-nearest arithmetic: the nearest sum, plus one ulp where its
    error (exact by Fast2Sum) is positive."""
    y = v + 1.0
    below = (v - (y - 1.0)) > 0
    return y.to(tl.int32, bitcast=True) + below.to(tl.int32)


@triton.jit
def e4m3_rtne(y):
    """y: fp32 in [0, 448], finite -> int32 E4M3 bytes 0..0x7E (round to nearest even). On a GPU
    its conversion instruction (cvt.rn.satfinite.e4m3x2.f32, inline); interpreted, the integer form."""
    if compile_arch() >= 89:  # PTX 7.8's cvt e4m3x2 (Ada, Hopper, Blackwell), one value a conversion,
        # in the low byte: Triton's own fp8 cast (which converts values in pairs) gave wrong bytes for
        # a transposed bf16 tile's block scales on an H100 (git d60a7ac, benchmarks/results/e4m3_forms_h100.log)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, 0f00000000, $1; cvt.u32.u16 $0, t; }",
            "=r,r", [y], dtype=tl.int32, is_pure=True, pack=1)
    return _e4m3_rtne_integer(y)


@triton.jit
def _e4m3_rtne_integer(y):
    """e4m3_rtne in integers: the exponent, the significand shifted to 3 bits, ties to even."""
    bits = y.to(tl.int32, bitcast=True)
    exp = bits >> 23
    sig = (bits & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
    te = tl.maximum(exp, 1) - 120  # target biased exponent: - 127 + 7
    s = tl.minimum(20 + tl.maximum(1 - te, 0), 25)
    one = tl.full(s.shape, 1, tl.int32)
    q = sig >> s
    rem = sig & ((one << s) - 1)
    half = one << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    code = (tl.maximum(te - 1, 0) << 3) + q + up.to(tl.int32)
    return tl.minimum(code, 0x7E)


@triton.jit
def e4m3_value(b):
    """b: int32 E4M3 bytes (NaN excluded) -> fp32 values (exact: on a GPU by its conversion)."""
    if compile_arch() >= 89:  # the byte's value through f16 (exact), one value a conversion (as above)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, c; .reg .b32 h; cvt.u16.u32 c, $1; cvt.rn.f16x2.e4m3x2 h, c; "
            "mov.b32 {lo, hi}, h; cvt.f32.f16 $0, lo; }",
            "=r,r", [b & 0xFF], dtype=tl.float32, is_pure=True, pack=1)
    return _e4m3_value_integer(b)


@triton.jit
def _e4m3_value_integer(b):
    """e4m3_value from the bit fields."""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((b & 0x80) != 0, -value, value)


@triton.jit
def e2m1_value(c):
    """c: int32 nibbles -> fp32 values (0, .5, 1, 1.5, 2, 3, 4, 6 and negatives), exact."""
    e, m = (c >> 1) & 3, c & 1
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def scale_value(sbyte, NVFP4: tl.constexpr):
    """int32 scale bytes -> fp32: E4M3 (NVFP4) or UE8M0 (MXFP4), NaN bytes to NaN."""
    if NVFP4:
        return tl.where((sbyte & 0x7F) == 0x7F, float("nan"), e4m3_value(sbyte))
    value = tl.where(sbyte == 0, 0x400000, sbyte << 23).to(tl.float32, bitcast=True)  # 2^-127 is subnormal
    return tl.where(sbyte == 0xFF, float("nan"), value)


@triton.jit
def widen(x, BF16_BITS: tl.constexpr):
    """Loaded input -> fp32. bf16 arrives as its int16 bits and is widened by a shift, exact on
    every backend (Triton's interpreter mis-converts bf16 subnormals)."""
    if BF16_BITS:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def finite_key(x):
    """fp32 -> uint32 key for a max over finite |x|: the bits doubled (the sign shifts out) plus
    2^24. Finite |x| (bits below 0x7F800000) map in order onto [2^24, 2^32 - 1); Inf and NaN
    (0x7F800000 and up) wrap around onto [0, 2^24), under every finite value. One shift-add an
    element (LEA on sm_90) where masking the non-finite values took three (and, compare, select)."""
    return x.to(tl.uint32, bitcast=True) * 2 + 0x1000000


@triton.jit
def key_bits(k):
    """A max of finite_key values (uint32) -> int32 bits of the largest finite |x| (0 where none
    of them was finite, and for the key 0 a max starts from)."""
    return tl.where(k >= 0x1000000, (k - 0x1000000) >> 1, 0).to(tl.int32)


@triton.jit
def to_bf16_rtne(x):
    """x: fp32 -> bf16, round to nearest even done in integers (the interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, rounded).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """x: fp32 -> fp32 holding x rounded to bf16 (nearest even), exactly on every backend: on a GPU
    its conversion instruction (cvt.rn.bf16.f32, two values an instruction, a quarter of the
    integer form's), interpreted the integer form (the interpreter's conversion truncates). They
    differ in a NaN's payload alone, which no caller keeps (a NaN poisons its block)."""
    if HARDWARE_CONVERT:
        return x.to(tl.bfloat16).to(tl.float32)
    return (to_bf16_rtne(x).to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def philox_bytes(seed, group):
    """group: [R, G] int64 group indices -> [R, G, 16] int32 random bytes (rng.random_bytes)."""
    c0 = (group & 0xFFFFFFFF).to(tl.uint32)
    c1 = (group >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)
    j = tl.arange(0, 16)
    word = tl.where(j < 4, w0[:, :, None], tl.where(j < 8, w1[:, :, None],
                    tl.where(j < 12, w2[:, :, None], w3[:, :, None])))
    return ((word >> (8 * (j % 4)).to(tl.uint32)) & 0xFF).to(tl.int32)


@triton.jit
def pack_nibble_pairs(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """codes: [ROWS, COLS] int32 nibbles -> [ROWS, COLS // 2] uint8, element 2i low."""
    lo, hi = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def group_of(index, start_ptr, n_groups):
    """index: int tensor or scalar -> int32 of its shape: the g with start_ptr[g] <= index <
    start_ptr[g + 1] (starts ascending from start_ptr[0] <= index; of equal starts, the last: the
    empty groups before it hold nothing). A binary search, ceil(log2 G) loads: the linear scan it
    replaces ran G - 1 iterations of every thread of every grouped launch, a sixth to a third of
    a 64-expert grouped copy's instructions a thread (benchmarks/grouped_instructions.py). Starts
    out of order (counts never checked on the host) still give a group in range."""
    group = (index * 0).to(tl.int32)
    if n_groups > 1:  # (G = 1 arrives as a constexpr: Triton 3.6 fails compiling the search for it)
        span = 1
        while span < n_groups:
            span *= 2
        span = span // 2
        while span > 0:  # (the largest g whose start is at or below index, a bit at a time)
            probe = group + span
            inside = probe < n_groups
            start = tl.load(start_ptr + tl.where(inside, probe, 0))
            group = tl.where(inside & (index >= start), probe, group)
            span = span // 2
    return group
