"""kernels.launch: a repeated call signature launches the compiled kernel Triton's first launch
gave; anything Triton would compile differently for goes through Triton again. A stub kernel and
driver stand in for Triton's (the GPU tests run every real kernel through the cache)."""

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime import driver  # noqa: E402

from fp4lab.kernels import launch  # noqa: E402


class _Param:
    def __init__(self, name, is_constexpr, default=None):
        self.name, self.is_constexpr = name, is_constexpr
        self.has_default, self.default = default is not None, default


class _Compiled:
    """A CompiledKernel's launch surface: its loaded handles and the launcher ``run``."""

    packed_metadata, function = b"", "cu_function"

    def __init__(self, log):
        self.log, self.loaded = log, False

    def _init_handles(self):
        self.loaded = True

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid, "stream": stream}

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_hook, *args):
        assert self.loaded and function == self.function and packed == self.packed_metadata
        self.log.append(("direct", (g0, g1, g2), args, stream))
        self.hooks = (metadata, enter, exit_hook)


class _Kernel:
    """kernel(x_ptr, n, BLOCK: constexpr, EVEN: constexpr = True) as Triton's JITFunction takes it."""

    params = [_Param("x_ptr", False), _Param("n", False), _Param("BLOCK", True), _Param("EVEN", True, True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log)
        return run


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(driver, "_active", _Driver())
    return _Kernel()


def test_a_repeated_signature_launches_the_compiled_kernel_directly(kernel):
    fast = launch.cached(kernel)
    x, y = torch.zeros(64), torch.ones(64)  # (both 16-byte aligned)
    fast[(4,)](x, 64, BLOCK=16)
    fast[(8, 2)](y, 96, BLOCK=16)  # another tensor, another size: the same signature
    assert [entry[0] for entry in kernel.log] == ["triton", "direct"]
    # positional arguments, then the constexprs in parameter order (a default filled in), grid in 3-D
    assert kernel.log[1] == ("direct", (8, 2, 1), (y, 96, 16, True), 1234)


def test_a_cached_launch_skips_empty_hook_chains_and_calls_registered_hooks(kernel, monkeypatch):
    from triton import knobs
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):  # (a Triton whose hooks are plain callables)
        pytest.skip("this Triton keeps no hook chains")
    for chain in (hook, knobs.runtime.launch_exit_hook):  # (empty, whatever the process registered)
        monkeypatch.setattr(chain, "calls", [])
    fast = launch.cached(kernel)
    x = torch.zeros(64)
    compiled = fast[(4,)](x, 64, BLOCK=16)
    assert fast[(4,)](x, 64, BLOCK=16) is compiled and compiled.hooks == (None, None, None)
    seen = lambda metadata: None  # noqa: E731
    hook.add(seen)
    try:
        fast[(4,)](x, 64, BLOCK=16)
        metadata, enter, leave = compiled.hooks
        assert metadata == {"grid": (4, 1, 1), "stream": 1234} and enter is hook
        assert leave is knobs.runtime.launch_exit_hook
    finally:
        hook.remove(seen)


@pytest.mark.parametrize("change", ["alignment", "dtype", "int_one", "int_16", "int_64_bit", "int_u64", "constexpr",
                                    "option", "debug"])
def test_what_triton_specializes_on_goes_through_triton_again(kernel, change, monkeypatch):
    fast = launch.cached(kernel)
    x = torch.zeros(64)
    fast[(1,)](x, 17, BLOCK=16)
    args, kwargs = [x, 17], {"BLOCK": 16}
    if change == "alignment":
        args[0] = x[1:]  # 4 bytes in
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "int_one":
        args[1] = 1
    elif change == "int_16":
        args[1] = 32
    elif change == "int_64_bit":
        args[1] = 2**40 + 1
    elif change == "int_u64":
        fast[(1,)](x, 2**40 + 1, BLOCK=16)
        kernel.log.pop()
        args[1] = 2**63 + 1
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        from triton import knobs
        monkeypatch.setattr(knobs.runtime, "debug", True)  # (Triton compiles a debug kernel)
    fast[(1,)](*args, **kwargs)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]
    fast[(1,)](*args, **kwargs)  # ... and is cached in turn
    assert [entry[0] for entry in kernel.log] == ["triton", "triton", "direct"]


def test_a_bound_kernel_launches_as_the_keyword_call_and_shares_its_cache(kernel):
    fast = launch.cached(kernel)
    x, y = torch.zeros(64), torch.ones(64)
    bound = fast.bind(BLOCK=16)
    bound[(4,)](x, 64)
    assert kernel.log[-1] == ("triton", (4,), (x, 64), {"BLOCK": 16})
    fast[(2,)](y, 96, BLOCK=16)  # the keyword call finds what the bound one learnt
    bound[(3,)](y, 32)
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "direct"]
    assert kernel.log[-1] == ("direct", (3, 1, 1), (y, 32, 16, True), 1234)
    fast.bind(BLOCK=32)[(1,)](x, 64)  # another constexpr: Triton again
    assert kernel.log[-1][0] == "triton"
    unhashable = fast.bind(BLOCK=16, extra=[1])  # (keyed at no call: Triton's path each time)
    unhashable[(1,)](x, 64)
    unhashable[(1,)](x, 64)
    assert [entry[0] for entry in kernel.log[-2:]] == ["triton", "triton"]


def test_a_constexpr_passed_by_position_is_keyed_by_its_value(kernel):
    fast = launch.cached(kernel)
    x = torch.zeros(64)
    fast[(1,)](x, 17, 16)
    fast[(1,)](x, 17, 32)  # (16 and 32 are alike as run-time ints, not as constexprs)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]


VALUES = [0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**40, 2**40 + 1,
          2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1, True, False, None, 0.5, 3.0]


def test_no_two_arguments_the_signature_calls_alike_does_triton_compile_differently():
    """The signature refines Triton's own specializer: any two run-time arguments with the same key
    (what launch._signature makes of each, as the cached launch keys it) get the same
    specialization from triton.runtime.jit's native_specialize_impl (the installed Triton's; 3.6
    on the GPU follows the same rules: kernels/launch.py)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.int16)[1:]]
    args = VALUES + tensors + [torch.nn.Parameter(base)]  # (a subclass: keyed by _arg_key)
    by_key = {}
    for arg in args:
        key = launch._signature((arg,), (False,))
        spec = native_specialize_impl(BaseBackend, arg, False, True, True)
        by_key.setdefault(repr(key), set()).add(repr(spec))
    assert all(len(specs) == 1 for specs in by_key.values()), by_key


def test_the_kernel_object_copies_and_reads_through(kernel):
    import copy
    fast = launch.cached(kernel)
    assert copy.copy(fast).kernel is kernel and fast.params is kernel.params


class InterpretedFunction(_Kernel):
    """What triton.jit gives under TRITON_INTERPRET=1 (by name)."""


def test_interpreted_kernels_and_unknown_arguments_take_tritons_path(kernel):
    fast = launch.cached(kernel)
    for _ in range(2):
        fast[(1,)](object(), 17, BLOCK=16)  # nothing the cache can classify
    assert [entry[0] for entry in kernel.log] == ["triton"] * 2
    interpreted = InterpretedFunction()
    fast = launch.cached(interpreted)
    for _ in range(2):
        fast[(1,)](torch.zeros(64), 17, BLOCK=16)
    assert [entry[0] for entry in interpreted.log] == ["triton"] * 2


def test_a_run_time_argument_passed_by_keyword_is_never_cached(kernel):
    fast = launch.cached(kernel)
    for n in (17, 33):
        fast[(1,)](torch.zeros(64), n=n, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels: a GPU")
def test_cached_launches_give_the_references_bits_on_the_gpu():
    """The quantize, the pair and the GEMM, each called at several sizes of one signature: the
    calls after the first launch directly, and every result is the reference's."""
    from fp4lab import formats, kernels
    from fp4lab.kernels import amax, matmul, quantize
    launched = (amax._finite_amax_kernel, quantize._fp4_quantize_kernel, quantize._fp4_pair_kernel,
                matmul._scaled_mm_persistent_kernel, matmul._scaled_mm_tma_kernel, matmul._scaled_mm_kernel)
    for kernel in launched:
        kernel._compiled.clear()
    g = torch.Generator().manual_seed(0)
    # rows in two signature classes (multiples of 16, and not), each class met more than once
    for m in (64, 96, 72, 160, 104):
        x = torch.randn(m, 128, generator=g)
        fast, ref = kernels.quantize_nvfp4(x.cuda()), formats.quantize_nvfp4(x)
        assert torch.equal(fast.codes.cpu(), ref.codes) and torch.equal(fast.scales.cpu().view(torch.uint8),
                                                                        ref.scales.view(torch.uint8))
        kw = dict(rows=dict(rounding="rtne"), columns=dict(rounding="stochastic", seed=m, hadamard="te"),
                  columns_len=m + (-m % 32))
        for got, want in zip(kernels.quantize_values_pair(x.cuda(), "nvfp4", **kw),
                             kernels.quantize_values_pair(x, "nvfp4", **kw)):
            assert torch.equal(got.values.cpu(), want.values) and got.tensor_scale.item() == want.tensor_scale.item()
        for _ in range(2):  # (the second call of a shape is a repeated signature)
            # small integers: every product and partial sum exact, so any summation order gives these bits
            a, b = (torch.randint(-8, 9, (rows, 128), generator=g).to(torch.bfloat16) for rows in (m, 48))
            want = ((a.float() @ b.float().T) * 0.5).to(torch.bfloat16)
            assert torch.equal(matmul.scaled_mm(a.cuda(), b.cuda(), torch.tensor(0.5, device="cuda")).cpu(), want)
    # fewer signatures remembered than launches made: the later calls of each went direct
    assert 0 < len(quantize._fp4_pair_kernel._compiled) < 10 and 0 < len(amax._finite_amax_kernel._compiled) < 5
