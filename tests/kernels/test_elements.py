"""The Triton device functions against fp4lab.formats.codes, exhaustively."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fp4lab.formats import codes as C  # noqa: E402
from fp4lab.formats.rng import philox4x32, random_bytes  # noqa: E402
from fp4lab.kernels.elements import (_e4m3_rtne_integer, _e4m3_value_integer,  # noqa: E402
                                     _one_plus_rounded_up, _one_plus_rounded_up_fast2sum, e2m1_rtne,
                                     e2m1_rtne_value, e2m1_stochastic, e2m1_stochastic_value, e4m3_rtne,
                                     e4m3_value, finite_key, group_of, key_bits, philox_bytes, to_bf16_rtne)

from ..checkout import subprocess_env  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_BF16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


@triton.jit
def _codes_kernel(x_ptr, r_ptr, rtne_ptr, sr_ptr, e4m3_ptr, back_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    r = tl.load(r_ptr + offs, mask=m, other=0).to(tl.int32)
    v = tl.minimum(tl.abs(x), 6.0)
    tl.store(rtne_ptr + offs, e2m1_rtne(v), mask=m)
    tl.store(sr_ptr + offs, e2m1_stochastic(v, r), mask=m)
    b = e4m3_rtne(tl.minimum(tl.abs(x), 448.0))
    tl.store(e4m3_ptr + offs, b, mask=m)
    tl.store(back_ptr + offs, e4m3_value(b), mask=m)
    tl.store(bf16_ptr + offs, to_bf16_rtne(x * 1.0009765625), mask=m)  # off the bf16 grid


def run_codes(x, r):
    n = x.numel()
    outs = [torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(3)]
    back = torch.empty(n, dtype=torch.float32, device=DEVICE)
    bf16 = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    _codes_kernel[(triton.cdiv(n, 1024),)](x.to(DEVICE), r.to(DEVICE), *outs, back, bf16, n, BLOCK=1024)
    return [o.cpu() for o in outs] + [back.cpu(), bf16.cpu()]


def test_every_bf16_value_and_random_byte_encodes_like_the_reference():
    x = ALL_BF16[~ALL_BF16.isnan()]
    r = random_bytes(5, x.numel())
    rtne, sr, e4m3, back, bf16 = run_codes(x, r)
    v = x.abs().clamp(max=6.0)
    assert torch.equal(rtne, C.encode_e2m1(v).long().int())
    assert torch.equal(sr, C.encode_e2m1(v, r).int())
    ref = C.encode_e4m3(x.abs().clamp(max=448.0))
    assert torch.equal(e4m3, ref.view(torch.uint8).int())
    assert torch.equal(back, C.decode_e4m3(ref))
    assert torch.equal(bf16.view(torch.int16), (x * 1.0009765625).to(torch.bfloat16).view(torch.int16))


def test_stochastic_rounding_over_all_256_bytes():
    mags = ALL_BF16[(ALL_BF16 >= 0) & (ALL_BF16 <= 6)].unique()
    x = mags.repeat_interleave(256)
    r = torch.arange(256, dtype=torch.uint8).repeat(mags.numel())
    _, sr, *_ = run_codes(x, r)
    assert torch.equal(sr, C.encode_e2m1(x, r).int())


@triton.jit
def _philox_kernel(out_ptr, seed, G: tl.constexpr):
    groups = tl.arange(0, G).to(tl.int64)[None, :] + (1 << 33)  # a counter past 32 bits
    b = philox_bytes(seed, groups)  # [1, G, 16]
    tl.store(out_ptr + tl.arange(0, G)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :], b)


@triton.jit
def _grid_values_kernel(v_ptr, r_ptr, rtne_ptr, sr_ptr, code_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    r = tl.load(r_ptr + offs, mask=m, other=0).to(tl.int32)
    tl.store(rtne_ptr + offs, e2m1_rtne_value(v), mask=m)
    tl.store(sr_ptr + offs, e2m1_stochastic_value(v, r), mask=m)
    tl.store(code_ptr + offs, e2m1_rtne(v), mask=m)


def test_grid_values_are_the_decoded_codes():
    """e2m1_*_value(v) = the value of e2m1_*(v)'s code, and e2m1_rtne(v) the reference's code, for
    fp32 magnitudes (a kernel's x * e_b is any fp32, not only bf16): every bf16 in [0, 6] with all
    256 bytes, the grid's midpoints and their fp32 neighbours, and random fp32 bit patterns in [0, 6]."""
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(9.0)),
                      torch.tensor([0.25, 0.75, 1.0, 6.0]).nextafter(torch.tensor(0.0))])
    bf16 = ALL_BF16[(ALL_BF16 >= 0) & (ALL_BF16 <= 6)].unique()
    g = torch.Generator().manual_seed(3)
    rand_bits = torch.randint(0, 0x40C00001, (1 << 16,), generator=g, dtype=torch.int32).view(torch.float32)
    v = torch.cat([bf16.repeat_interleave(256), near.repeat_interleave(256), rand_bits])
    r = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(bf16.numel() + near.numel()),
                   torch.randint(0, 256, (1 << 16,), generator=g, dtype=torch.uint8)])
    n = v.numel()
    rtne, sr = (torch.empty(n, device=DEVICE) for _ in range(2))
    code = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _grid_values_kernel[(triton.cdiv(n, 4096),)](v.to(DEVICE), r.to(DEVICE), rtne, sr, code, n, BLOCK=4096)
    assert torch.equal(rtne.cpu(), C.decode_e2m1(C.encode_e2m1(v)))
    assert torch.equal(sr.cpu(), C.decode_e2m1(C.encode_e2m1(v, r)))
    assert torch.equal(code.cpu(), C.encode_e2m1(v).int())


def test_stochastic_rounding_below_1_at_its_thresholds():
    """Below 1, SR rounds up iff 512 v > r + 256 [v >= .5]; the kernels decide it on 1 + v rounded up,
    whose last bits are where fp32's 1 + v loses v's: every threshold (r + 256 h) / 512 and its fp32
    neighbours one, two and 2^20 steps either side, against every byte, and the smallest values."""
    k = torch.arange(512, dtype=torch.float32) / 512
    steps = [k]
    for n in (1, 2, 1 << 20):
        up, down = k.view(torch.int32) + n, (k.view(torch.int32) - n).clamp(min=0)
        steps += [up.view(torch.float32), down.view(torch.float32)]
    tiny = torch.tensor([1, 2, 3, 0x7FFFFF, 0x800000, 0x800001], dtype=torch.int32).view(torch.float32)
    v = torch.cat(steps + [tiny])
    v = v[v < 1].unique()
    x, r = v.repeat_interleave(256), torch.arange(256, dtype=torch.uint8).repeat(v.numel())
    n = x.numel()
    rtne, sr = (torch.empty(n, device=DEVICE) for _ in range(2))
    code = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _grid_values_kernel[(triton.cdiv(n, 4096),)](x.to(DEVICE), r.to(DEVICE), rtne, sr, code, n, BLOCK=4096)
    assert torch.equal(code, C.encode_e2m1(x).int().to(DEVICE))
    assert torch.equal(sr.cpu(), C.decode_e2m1(C.encode_e2m1(x, r)))
    _, codes, *_ = run_codes(x, r)
    assert torch.equal(codes, C.encode_e2m1(x, r).int())


@triton.jit
def _e2m1_rtne_split(v):
    """The E2M1 code the kernels took before the grid add (an independent derivation): for v >= 1
    the exponent and top mantissa bit after rounding the 22 dropped bits to even, below 1
    [v > .25] + [v >= .75]."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    subnormal = (v > 0.25).to(tl.int32) + (v >= 0.75).to(tl.int32)
    return tl.where(bits >= 0x3F800000, normal, subnormal)


@triton.jit
def _forms_mismatch_kernel(mismatch_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """Counts the fp32 patterns 0 .. n - 1 where a helper's GPU form differs from its portable twin:
    FORM 0 e4m3_rtne (the integer form), 1 the rounded-up 1 + v of stochastic rounding below 1
    (the Fast2Sum form), 2 e2m1_rtne (the grid add) against the split form it replaced, 3 the
    finite-amax key (_key_mismatch) of v and of -v."""
    bits = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = bits.to(tl.float32, bitcast=True)
    if FORM == 3:
        bad = _key_mismatch(bits) | _key_mismatch(bits | -0x80000000)
    elif FORM == 0:
        bad = e4m3_rtne(v) != _e4m3_rtne_integer(v)
    elif FORM == 1:
        bad = _one_plus_rounded_up(v) != _one_plus_rounded_up_fast2sum(v)
    else:
        bad = e2m1_rtne(v) != _e2m1_rtne_split(v)
    tl.atomic_add(mismatch_ptr, tl.sum((bad & (bits < n)).to(tl.int32)))


@triton.jit
def _key_mismatch(bits):
    """Where finite_key and key_bits fail at the fp32 patterns ``bits`` (int32): the bits of |v|
    back where v is finite, else 0 (the masked form the kernels took before); a key above the
    next pattern's where both are finite and non-negative (the order); a non-finite v's key not
    below every finite one's (0x1000000, 0's)."""
    v = bits.to(tl.float32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    finite = mag < 0x7F800000
    key = finite_key(v)
    back = key_bits(key) != tl.where(finite, mag, 0)
    after = finite_key((bits + 1).to(tl.float32, bitcast=True))
    unordered = (bits >= 0) & (bits < 0x7F7FFFFF) & (after <= key)
    return back | unordered | (~finite & (key >= 0x1000000))


def _mismatches(n: int, form: int) -> int:
    mismatch = torch.zeros(1, dtype=torch.int32, device="cuda")
    _forms_mismatch_kernel[(triton.cdiv(n, 1024),)](mismatch, n, FORM=form, BLOCK=1024)
    return int(mismatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the directed-rounding add exists on a GPU only")
def test_the_gpus_rounded_up_add_is_the_integer_form_on_every_fp32_below_1():
    """Compiled for a GPU, SR below 1 takes 1 + v from one add.rp; the Fast2Sum form (what the
    interpreter runs, tested against the reference above) must agree on every v in [0, 1)."""
    assert _mismatches(0x3F800000, form=1) == 0  # (fp32(1)'s bits, exclusive)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="every fp32 in [0, 6] is a GPU's minute, not a CPU's")
def test_the_rtne_code_is_the_grid_value_on_every_fp32_up_to_6():
    """Compiled for a GPU, e2m1_rtne (v + c's grid steps) gives the code of the split form it replaced
    (exponent and mantissa bit rounded to even above 1, two comparisons below) on every fp32 in
    [0, 6]: two derivations, each checked against the reference on the sets above."""
    assert _mismatches(0x40C00001, form=2) == 0  # (fp32(6)'s bits, inclusive)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="every fp32 pattern is a GPU's seconds, not a CPU's")
def test_the_finite_amax_key_on_every_fp32():
    """Compiled for a GPU, finite_key orders every finite |v| and puts every Inf and NaN below them,
    and key_bits gives back |v|'s bits (0 for Inf and NaN), over all 2^32 patterns."""
    assert _mismatches(0x80000000, form=3) == 0  # (each pattern below 2^31 and its negative)


@triton.jit
def _key_kernel(bits_ptr, bad_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offs, mask=offs < n, other=0)
    tl.store(bad_ptr + offs, _key_mismatch(bits).to(tl.int32), mask=offs < n)


def test_the_finite_amax_key_on_every_bf16_and_the_edges():
    """finite_key / key_bits (the amax passes' finite max) on every bf16 (as fp32) and the patterns
    around each place the key's arithmetic turns: 0, the largest finite value, Inf, the NaNs, the
    top of the range (where the doubled bits wrap), each with either sign."""
    edges = torch.cat([torch.arange(a - 4096, a + 4096) for a in (0, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000)]
                      + [torch.arange(0x7FFFF000, 0x80000000), torch.randint(0, 2**31, (8192,))])
    bits = torch.cat([ALL_BF16.view(torch.int32), edges.clamp(0, 2**31 - 1).int()])
    bits = torch.cat([bits, bits | -0x80000000]).to(DEVICE)
    bad = torch.empty_like(bits)
    _key_kernel[(triton.cdiv(bits.numel(), 1024),)](bits, bad, bits.numel(), BLOCK=1024)
    assert int(bad.sum()) == 0, bits[bad.bool()][:8]


def test_philox_bytes_match_rng():
    out = torch.empty(64 * 16, dtype=torch.int32, device=DEVICE)
    _philox_kernel[(1,)](out, 12345, G=64)
    words = torch.stack(philox4x32(12345, torch.arange(2**33, 2**33 + 64)), -1)  # [64, 4]
    ref = (words[:, :, None] >> torch.tensor([0, 8, 16, 24])) & 0xFF  # byte j = word j//4, shift 8(j%4)
    assert torch.equal(out.cpu(), ref.reshape(-1).int())


@triton.jit
def _group_of_kernel(index_ptr, start_ptr, out_ptr, scalar_ptr, n, n_groups, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    index = tl.load(index_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, group_of(index, start_ptr, n_groups), mask=offs < n)
    tl.store(scalar_ptr, group_of(tl.load(index_ptr), start_ptr, n_groups))  # (a scalar index: a column group)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n_groups=st.sampled_from([1, 2, 3, 7, 8, 9, 64, 65, 130]))
def test_a_rows_group_is_the_last_start_at_or_below_it(data, n_groups):
    """group_of's binary search is searchsorted(starts, i, right) - 1 over ascending starts from 0,
    empty groups (equal starts) included, for a vector of indices and for a scalar one."""
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=n_groups, max_size=n_groups))
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    total = max(1, sum(sizes))
    index = torch.tensor(data.draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=64)))
    out, scalar = torch.empty(64, dtype=torch.int32, device=DEVICE), torch.empty(1, dtype=torch.int32, device=DEVICE)
    # a 0 past the G starts (a row table holds G): a search that reads start[G] finds it at or below any index
    table = torch.cat([starts, torch.zeros(1, dtype=starts.dtype)])
    _group_of_kernel[(1,)](index.to(DEVICE), table.to(DEVICE), out, scalar, index.numel(), n_groups, BLOCK=64)
    want = (torch.searchsorted(starts, index, right=True) - 1).int()
    assert torch.equal(out[: index.numel()].cpu(), want) and int(scalar) == int(want[0])


@triton.jit
def _e4m3_value_kernel(b_ptr, out_ptr, int_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    b = tl.load(b_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, e4m3_value(b), mask=offs < n)
    tl.store(int_ptr + offs, _e4m3_value_integer(b), mask=offs < n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hardware conversions exist on a GPU only")
def test_the_gpus_e4m3_conversions_are_the_integer_forms_on_every_fp32_in_range():
    """Compiled, e4m3_rtne and e4m3_value are the GPU's conversion instructions; the integer forms
    (what the interpreter runs, tested against the reference above) must agree on every input a
    kernel can pass: every fp32 bit pattern in 0 .. 448 (subnormals included), every finite byte."""
    assert _mismatches(0x43E00000 + 1, form=0) == 0  # (fp32(448)'s bits, inclusive)
    # every finite byte, negative ones included (a decoder passes the sign bit)
    finite = torch.cat([torch.arange(0x7F), torch.arange(0x80, 0xFF)])
    got, integer = torch.empty(finite.numel(), device="cuda"), torch.empty(finite.numel(), device="cuda")
    _e4m3_value_kernel[(1,)](finite.int().cuda(), got, integer, finite.numel(), BLOCK=256)
    want = C.decode_e4m3(finite.to(torch.uint8))
    assert torch.equal(got.cpu(), want) and torch.equal(integer.cpu(), want)


def test_the_hardware_forms_follow_the_compiles_target_not_the_device():
    """compile_arch reads the target from the compile's options: compiled with no device in the
    process, the helpers take add.rp and the E4M3 conversion for sm_90, sm_89 and sm_100, add.rp
    alone for sm_80 and sm_75 (cvt e4m3x2 needs sm_89); the dy pair's kernel as Inductor's compile
    workers get it (its source and its helpers' copied into a new module, no device) takes both.
    Asking the driver gave those workers the integer forms; 245e1db's builtin, defined in fp4lab,
    was not copied (NameError on the H100). Called from the host (no code generator) it asks the
    driver: one that cannot say is no NVIDIA target, an sm_80 one is 80, none active is sm_90."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its NVIDIA backend")
    script = Path(__file__).with_name("compile_arch_probe.py")
    done = subprocess.run([sys.executable, str(script)], env=subprocess_env(interpret=False, TRITON_ALWAYS_COMPILE="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[:7] == ["90 True True", "89 True True", "100 True True", "80 True False",
                                           "75 True False", "inductor 90 True True", "host 0 80 90"], done.stdout
