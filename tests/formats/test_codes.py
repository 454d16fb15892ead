"""E2M1 / E4M3 / UE8M0 codecs: every code, every byte, every bf16 input, and the named ties."""

import math

import pytest
import torch

from fp4lab.formats import codes as C
from tests.formats import oracle

ALL_BF16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_e2m1_every_code_decodes_to_the_table():
    values = C.decode_e2m1(torch.arange(16, dtype=torch.uint8))
    expected = oracle.E2M1_VALUES + [-v for v in oracle.E2M1_VALUES]
    assert values.tolist() == expected
    assert math.copysign(1.0, values[8].item()) == -1.0  # code 8 is -0.0


def test_e2m1_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(C.encode_e2m1(C.decode_e2m1(codes)), codes)


# docs/numerics.md "Element and scale codes": ties to even code, saturation, signed zero
E2M1_CASES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
              (0.2500001, 1), (0.7499999, 1), (4.9999995, 6), (5.0000005, 7),
              (6.0, 7), (7.0, 7), (1e30, 7), (math.inf, 7), (-0.0, 8), (-0.25, 8), (-5.0, 14),
              (-math.inf, 15), (math.nan, 7), (1e-45, 0)]


@pytest.mark.parametrize("value,code", E2M1_CASES, ids=[str(v) for v, _ in E2M1_CASES])
def test_e2m1_named_cases(value, code):
    assert C.encode_e2m1(torch.tensor([value])).item() == code


def test_e2m1_every_bf16_input_matches_the_oracle():
    got = C.encode_e2m1(ALL_BF16).tolist()
    expected = [oracle.e2m1(v) for v in ALL_BF16.float().tolist()]
    assert got == expected


def test_e2m1_random_fp32_matches_the_oracle():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32) % 8, torch.randn(20000, generator=g) * 3])
    assert C.encode_e2m1(x).tolist() == [oracle.e2m1(v) for v in x.tolist()]


def test_e2m1_comparison_rtne_equals_the_integer_rounding():
    # the RTNE path counts midpoints in fp32; the integer path is the generic minifloat rounding
    # that stochastic rounding and E4M3 share: the same codes at and beside every midpoint
    mids = torch.tensor([m for m, _ in C._E2M1_MIDPOINTS] + [6.0, 0.0, 2.0**-126, 2.0**-149, 1e38])
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(0.0))])
    all_fp16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for x in (torch.cat([near, -near, torch.tensor([math.inf, -math.inf, math.nan, -0.0])]), all_fp16, ALL_BF16):
        bits = C._fp32_bits(x)
        mag = bits & 0x7FFFFFFF
        integer = torch.where(mag > 0x7F800000, 0x7, C._encode_magnitude(mag, C._E2M1, None) | ((bits >> 31) << 3))
        assert torch.equal(C.encode_e2m1(x), integer.to(torch.uint8))


def test_e2m1_stochastic_probability_is_exact_over_all_256_random_bytes():
    # every bf16 magnitude in [0, 6]: count of r in 0..255 that round up must be ceil(256 * frac)
    mags = ALL_BF16.float()
    mags = mags[(mags >= 0) & (mags <= 6) & ~mags.isnan()].unique()
    r = torch.arange(256, dtype=torch.uint8)
    x = mags[:, None].expand(-1, 256).contiguous()
    up_codes = C.encode_e2m1(x, r.expand_as(x).contiguous())
    values = C.decode_e2m1(up_codes)
    grid = torch.tensor(oracle.E2M1_VALUES)
    lo = grid[torch.searchsorted(grid, mags, right=True) - 1]
    hi = grid[torch.clamp(torch.searchsorted(grid, mags, right=True), max=7)]
    step = torch.where(hi > lo, hi - lo, 1.0)
    frac = (mags - lo) / step
    assert bool(((values == lo[:, None]) | (values == hi[:, None])).all())
    n_up = (values > lo[:, None]).sum(1)
    assert torch.equal(n_up, torch.ceil(256 * frac).long())


def test_e2m1_stochastic_keeps_sign_and_saturates():
    x = torch.tensor([-2.5, 7.0, -math.inf])
    for r in (0, 255):
        codes = C.encode_e2m1(x, torch.full((3,), r, dtype=torch.uint8))
        assert codes[0].item() in (12, 13) and codes[1].item() == 7 and codes[2].item() == 15


def test_e4m3_every_byte_decodes_like_torch():
    b = torch.arange(256, dtype=torch.uint8)
    ours, theirs = C.decode_e4m3(b), b.view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours.isnan().sum() == 2
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_e4m3_every_finite_byte_round_trips():
    b = torch.tensor([i for i in range(256) if i & 0x7F != 0x7F], dtype=torch.uint8)
    assert torch.equal(C.encode_e4m3(C.decode_e4m3(b)).view(torch.uint8), b)


def test_e4m3_every_bf16_input_matches_oracle_and_torch_in_range():
    x = ALL_BF16.float()
    got = C.encode_e4m3(x).view(torch.uint8)
    finite = ~x.isnan()
    expected = torch.tensor([oracle.e4m3(v) for v in x[finite].tolist()], dtype=torch.uint8)
    assert torch.equal(got[finite], expected)
    assert bool((got[~finite] == 0x7F).all())
    in_range = finite & (x.abs() <= 448)
    assert torch.equal(got[in_range], x[in_range].to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("value,byte", [(448.0, 0x7E), (463.9, 0x7E), (464.0, 0x7E), (1e9, 0x7E),
                                        (math.inf, 0x7E), (-math.inf, 0xFE), (2.0**-9, 0x01),
                                        (2.0**-10, 0x00), (1.5 * 2.0**-10, 0x01), (-0.0, 0x80)])
def test_e4m3_saturation_and_subnormal_ties(value, byte):
    assert C.encode_e4m3(torch.tensor([value])).view(torch.uint8).item() == byte


def test_e4m3_has_exactly_18_powers_of_two():
    v = C.decode_e4m3(torch.arange(1, 0x7F, dtype=torch.uint8))
    powers = sorted(x for x in v.tolist() if math.frexp(x)[0] == 0.5)
    assert powers == [2.0**k for k in range(-9, 9)]


def test_ue8m0_every_byte():
    b = torch.arange(256, dtype=torch.uint8)
    v = C.decode_ue8m0(b)
    assert math.isnan(v[255].item())
    assert v[:255].tolist() == [2.0 ** (i - 127) for i in range(255)]


def test_ue8m0_encode_range():
    assert C.encode_ue8m0(torch.tensor([-127, 0, 127])).tolist() == [0, 127, 254]
    with pytest.raises(ValueError, match="128"):
        C.encode_ue8m0(torch.tensor([128]))
    with pytest.raises(TypeError):
        C.encode_ue8m0(torch.tensor([1.0]))


def test_floor_and_ceil_log2_exact_on_every_positive_bf16_and_subnormals():
    x = ALL_BF16.float()
    x = x[(x > 0) & x.isfinite()]
    x = torch.cat([x, torch.tensor([1e-45, 2e-45, 3e-45, 2.0**-149, 2.0**-126, 3.4e38])])
    floors, ceils = C.floor_log2(x).tolist(), C.ceil_log2(x).tolist()
    for v, f, c in zip(x.tolist(), floors, ceils):
        m, e = math.frexp(v)
        assert f == e - 1 and c == (e - 1 if m == 0.5 else e)


def test_codecs_refuse_float64_rather_than_round_twice():
    with pytest.raises(TypeError, match="float64"):
        C.encode_e2m1(torch.tensor([0.25 + 2**-40], dtype=torch.float64))
    with pytest.raises(TypeError, match="float64"):
        C.encode_e4m3(torch.tensor([1.0], dtype=torch.float64))


def test_nibble_packing_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = C.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(C.unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="odd"):
        C.pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError):
        C.unpack_nibbles(torch.zeros(2, dtype=torch.int32))


def test_decoding_on_a_device_copies_its_table_there_once():
    # A CUDA graph cannot capture a host-to-device copy: a dithered weight decodes its block scales
    # inside the captured step, so the tables must already live on the codes' device. The meta
    # device stands in for CUDA here; a dispatch mode records every copy that crosses devices.
    from torch.utils._python_dispatch import TorchDispatchMode

    class CrossDeviceCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            src = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if isinstance(out, torch.Tensor) and src is not None and src.device != out.device:
                self.seen.append(func)
            return out

    e2m1 = torch.zeros(4, dtype=torch.uint8, device="meta")
    e4m3 = torch.zeros(4, dtype=torch.uint8, device="meta")
    C.decode_e2m1(e2m1), C.decode_e4m3(e4m3)  # the first decode on a device may copy
    with CrossDeviceCopies() as mode:
        assert C.decode_e2m1(e2m1).device.type == "meta"
        assert C.decode_e4m3(e4m3).device.type == "meta"
    assert mode.seen == []


def test_a_decoded_scalar_is_a_copy_not_a_view_of_the_table():
    # indexing with a 0-dim tensor selects, which would return a view into the cached table
    for decode, code, value in ((C.decode_e2m1, 3, 1.5), (C.decode_e4m3, 0x38, 1.0)):
        decode(torch.tensor(code, dtype=torch.uint8)).mul_(100)
        assert decode(torch.tensor(code, dtype=torch.uint8)).item() == value


def test_a_fake_decode_leaves_no_fake_table_in_the_cache():
    # a decode traced under a fake mode (torch.compile, export) must not cache its fake copy,
    # or every later real decode on that device would fail
    from torch._subclasses.fake_tensor import FakeTensorMode

    C._table_on.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        C.decode_e4m3(torch.zeros(4, dtype=torch.uint8, device="meta"))
    real = C.decode_e4m3(torch.zeros(4, dtype=torch.uint8, device="meta"))
    assert type(real) is torch.Tensor and real.device.type == "meta"
