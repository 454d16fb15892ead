"""kernels.traced_accesses: torch's analysis of what a recorded launch writes, kept per
specialization, gives torch's own answers."""
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fp4lab.kernels import traced_accesses

from ..checkout import subprocess_env


class _Kernel:
    """Stands in for a JITFunction (the analysis below never looks inside it)."""


def _counting():
    calls = []

    def original(kernel, kwargs, tma):
        calls.append(dict(kwargs))
        return {"written": sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), "n": len(calls)}
    return original, calls


@pytest.fixture
def hopper(monkeypatch):
    """A driver's target for the key (none on this machine), switchable by the test."""
    target = {"now": "GPUTarget(backend='cuda', arch=90, warp_size=32)"}
    monkeypatch.setattr(traced_accesses, "_target", lambda: target["now"])
    return target


@pytest.fixture
def ours():
    """Kernels registered as remember registers them, without touching torch's module."""
    kernels = [_Kernel(), _Kernel()]
    for k in kernels:
        traced_accesses._KERNELS[id(k)] = k
    yield kernels
    for k in kernels:
        traced_accesses._KERNELS.pop(id(k))


def test_kept_per_kernel_and_specialization(hopper, ours):
    original, calls = _counting()
    analysis = traced_accesses.kept_analysis(original)
    kernel, other = ours
    with FakeTensorMode():
        a, b = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)
        c = torch.empty(4096, 32, dtype=torch.bfloat16)  # another shape, the same dtype
    base = dict(x=a, out=b, M=64, BLOCK=16, SR=True)
    first = analysis(kernel, base, {})
    again = analysis(kernel, dict(out=b, x=c, M=64, BLOCK=16, SR=True), {})  # keyword order, shape: the same key
    assert again == first and again is not first and len(calls) == 1
    for changed in (dict(M=65), dict(BLOCK=32), dict(SR=False), dict(x=b), dict(M=64.0)):
        analysis(kernel, {**base, **changed}, {})
    assert len(calls) == 6  # each a specialization of its own
    # each of these differs from a kept call in one thing alone, and is asked afresh every time
    for _ in range(2):
        analysis(other, base, {})  # another kernel
        analysis(_Kernel(), base, {})  # a kernel never remembered
        analysis(kernel, base, {"x": ("stable", ([64, 32],))})  # TMA metadata
        analysis(kernel, {**base, "x": torch.empty(64, 32, dtype=torch.bfloat16)}, {})  # a real tensor
        analysis(kernel, {**base, "grid": object()}, {})  # an unknown kind
    assert len(calls) == 6 + 1 + 2 * 4  # (the other kernel's first answer is kept, like any)
    hopper["now"] = "GPUTarget(backend='cuda', arch=100, warp_size=32)"  # another device's target
    analysis(kernel, base, {})
    assert len(calls) == 16
    hopper["now"] = None  # no driver: never kept
    analysis(kernel, base, {})
    analysis(kernel, base, {})
    assert len(calls) == 18


def test_a_symbolic_size_is_one_specialization(hopper, ours):
    original, calls = _counting()
    analysis = traced_accesses.kept_analysis(original)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    analysis(ours[0], dict(M=env.create_unbacked_symint()), {})
    analysis(ours[0], dict(M=env.create_unbacked_symint()), {})  # (torch compiles 2 for either)
    analysis(ours[0], dict(M=2), {})  # a plain 2 is a value, not a symbol
    assert len(calls) == 2


def test_an_autotuned_kernel_is_remembered_with_its_function(monkeypatch):
    """Inductor's lowering asks about the function inside an autotuner, its tracing about the autotuner."""
    monkeypatch.setattr(traced_accesses, "_installed", True)  # (torch's module left alone)
    tuned = _Kernel()
    tuned.fn, tuned.configs = _Kernel(), []
    traced_accesses.remember(tuned)
    try:
        assert traced_accesses._KERNELS[id(tuned)] is tuned and traced_accesses._KERNELS[id(tuned.fn)] is tuned.fn
    finally:
        traced_accesses._KERNELS.pop(id(tuned))
        traced_accesses._KERNELS.pop(id(tuned.fn))


_REAL = """
import sys, time, torch
import triton, triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from torch._subclasses.fake_tensor import FakeTensorMode

class Hopper:  # what torch's analysis asks the driver: the target it compiles the IR for
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self):
        return torch.device("cpu")
triton.runtime.driver.set_active(Hopper())
launches = []
jit.JITFunction.run = lambda fn, *args, grid, warmup, **kwargs: launches.append((fn, args, kwargs))

from fp4lab.formats.types import Format
from fp4lab.kernels import amax, quantize, traced_accesses
from torch._higher_order_ops import triton_kernel_wrap as wrap

# kernels.launch registers a kernel as it records a launch under a tracer (a fake tensor here)
assert not traced_accesses._KERNELS
with FakeTensorMode():
    amax.finite_amax(torch.empty(128, 64, dtype=torch.bfloat16))
assert [k.__name__ for k in traced_accesses._KERNELS.values()] == ["_finite_amax_kernel"], traced_accesses._KERNELS
assert not launches  # (recorded, not launched)
name = next(n for n in traced_accesses._ANALYSES if hasattr(wrap, n))
assert getattr(wrap, name).keeps_fp4lab_kernels

x = torch.randn(128, 64).to(torch.bfloat16)
nv = dict(block=(1, 16))
for rows, columns in ((nv, dict(hadamard="random", hadamard_seed=2, **nv)),
                      (dict(rounding="stochastic", seed=2**40 + 1, **nv), dict(rounding="stochastic", seed=3, **nv))):
    quantize.block_values_pair(x, Format.NVFP4, rows=rows, columns=columns, columns_len=128)
quantize.nvfp4_block_values(x, rounding="stochastic", seed=5)
amax.finite_amax(x)
original = getattr(wrap, name).__wrapped__  # (torch's own, under the kept one: functools.wraps)
mode = FakeTensorMode()
seen = set()
for fn, args, kwargs in launches:
    kw = {**dict(zip(fn.arg_names, args)), **{k: v for k, v in kwargs.items() if k in fn.arg_names}}
    kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    expected = original(fn, dict(kw), {})
    traced_accesses.remember(fn)
    kept = getattr(wrap, name)
    first = kept(fn, dict(kw), {})
    begin = time.perf_counter()
    again = kept(fn, dict(kw), {})
    took = time.perf_counter() - begin
    assert first == expected and again == expected, (fn.__name__, first, expected)
    written = sorted(getattr(d, "name", d) for d in getattr(getattr(expected, "read_writes", None), "writes", expected))
    seen.add((fn.__name__, tuple(written)))
    assert took < 0.05, took
for name, written in sorted(seen):
    print(name, *written)
"""


def test_kept_answers_are_torchs_for_fp4lab_kernels(tmp_path):
    """The real analysis (Triton's compiler to IR, for sm_90, on the CPU) of a linear's launches:
    the pair kernel's two passes, a single quantize, the amax pass. The kept analysis gives what
    torch's own gives, and a repeat takes no compile; the writes found are the outputs."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its NVIDIA backend")
    script = tmp_path / "real.py"
    script.write_text(_REAL)
    done = subprocess.run([sys.executable, str(script)], env=subprocess_env(interpret=False,
                          TRITON_CACHE_DIR=str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {tuple(line.split()) for line in done.stdout.splitlines() if line.startswith("_")}
    assert found == {("_fp4_pair_kernel", "amax_ptr"),  # the amax pass writes the amaxes alone
                     ("_fp4_pair_kernel", "cols_ptr", "rows_ptr", "s_dec_ptr"),
                     ("_fp4_quantize_kernel", "codes_ptr", "s_dec_ptr"),  # (block values: codes and scales share)
                     ("_finite_amax_kernel", "out_ptr")}
