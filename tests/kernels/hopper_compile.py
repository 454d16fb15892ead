"""Compile every Triton kernel launch fp4lab makes for Hopper (sm_90), on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts programs that Triton's
compiler rejects (one found on the H200: a `return` inside a constexpr `if` ends an interpreted
function, while the compiler goes on tracing the code after it). This script runs the public
kernel entry points with CPU tensors and Triton's launch replaced by a recorder, then compiles
each distinct launch (argument types, constexprs, options) to a cubin for sm_90: the compiler's
frontend, its MLIR passes, LLVM and ptxas all run on the CPU. Run without TRITON_INTERPRET.

    python tests/kernels/hopper_compile.py [--list]
Prints one line per launch and exits 1 if any fails to compile.

Launches are recorded as Triton specializes them (an int argument equal to 1 becomes a
constexpr): a one-expert grouped quantize compiled on Triton 3.9 but failed on 3.6, the device
machine's version, which this catches with that version's wheel put first on the path (.ci/run
does so, and test_hopper_compile.py compiles with it where FP4LAB_DEVICE_TRITON names the folder):
    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python tests/kernels/hopper_compile.py
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler is what is tested: unset TRITON_INTERPRET"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (this checkout's fp4lab, whatever the path holds)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(HOPPER)
SEED = 2**40 + 1  # a seed as runs draw them (63 bits): compiled as a run-time int64, where 1 would be a constexpr
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")


class Recorder:
    """Stands in for JITFunction.run: keeps (kernel, argument types, constexprs, options, attributes),
    launches nothing. Arguments are specialized by Triton's own binder and packing, as its launch
    specializes them: an int equal to 1 becomes a constexpr, and a pointer or int divisible by 16
    is compiled with that divisibility (what vectorizes a kernel's loads and stores). A launch
    Triton could not specialize is kept in ``errors`` (launch_only would swallow it)."""

    def __init__(self):
        self.launches: dict[tuple, tuple] = {}
        self.errors: list[str] = []
        self._binders: dict[JITFunction, object] = {}

    def __call__(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        try:
            binder = self._binders.get(fn)
            if binder is None:
                binder = self._binders[fn] = create_function_from_signature(fn.signature, fn.params, BACKEND)
            bound, specialization, _ = binder(*args, **kwargs)
            _, types, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, specialization, None)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{fn.__name__}: {e!r}")
            raise
        options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
        key = (fn.__name__, tuple(types.items()), tuple(sorted(constexprs.items())), tuple(sorted(options.items())),
               tuple(sorted((k, str(v)) for k, v in attrs.items())))
        self.launches.setdefault(key, (fn, types, constexprs, options, attrs))


def exercise() -> None:
    """A covering set of the library's launch configurations, kept small (each compile takes
    seconds): every scale rule with and without stochastic rounding plus a fused rotation, 1x16
    and 16x16 blocks, block values, a transposed read, fp32 input, grouped (MoE) quantizes; decode;
    the FP4 and scaled GEMMs."""
    from fp4lab.kernels import amax, decode, gemm, matmul, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    full = dict(rounding="stochastic", seed=SEED, hadamard="random", hadamard_seed=2)
    for profile, blocks in (("te", (16, (16, 16))), ("torchao", (16,)), ("four_over_six", (16, (16, 16)))):
        for block in blocks:
            for extra in ({}, full):
                launch_only(quantize.quantize_nvfp4, x, profile=profile, block=block, **extra)
        launch_only(quantize.nvfp4_block_values, x, profile=profile)
    for mode in ("floor", "ceil", "even", "rceil"):
        for extra in ({}, dict(rounding="stochastic", seed=SEED)):
            launch_only(quantize.quantize_mxfp4, x, mode=mode, **extra)
    launch_only(quantize.quantize_mxfp4, x, hadamard="random", hadamard_seed=2)
    launch_only(quantize.mxfp4_block_values, x)
    launch_only(quantize.quantize_nvfp4, x, axis=0, **full)  # a transposed read
    device_seeds = dict(rounding="stochastic", seed=torch.tensor([1]), hadamard="random", hadamard_seed=torch.tensor([2]))
    launch_only(quantize.nvfp4_block_values, x, axis=0, **device_seeds)  # seeds read from memory (nn.seeds)
    launch_only(quantize.mxfp4_block_values, x, axis=0, **device_seeds)
    launch_only(quantize.quantize_nvfp4, x.float())
    from fp4lab.formats.types import Format
    for fmt, knobs in ((Format.NVFP4, dict(profile="te")), (Format.NVFP4, dict(profile="torchao")),
                       (Format.NVFP4, dict(profile="four_over_six", block=(16, 16))), (Format.MXFP4, dict(mode="floor"))):
        for rounding in ("rtne", "stochastic"):  # every MoE expert's rows in one launch
            launch_only(quantize.grouped_block_values, x, fmt, [16, 48], [1, 2], rounding=rounding, **knobs)
    # one group: Triton specializes G = 1 to a constexpr (Triton 3.6 failed compiling group_of's search for it)
    launch_only(quantize.grouped_block_values, x, Format.NVFP4, [64], [1], rounding="stochastic")
    launch_only(quantize.grouped_column_block_values, x, Format.NVFP4, [64], [1], hadamard="random", hadamard_seeds=[3])
    for fmt, knobs in ((Format.NVFP4, dict(hadamard="random", rounding="stochastic")), (Format.NVFP4, {}),
                       (Format.MXFP4, dict(hadamard="random"))):  # wgrad's operands, every expert at once
        launch_only(quantize.grouped_column_block_values, x, fmt, [32, 32], [1, 2], hadamard_seeds=[3, 4], **knobs)
        # read from the routed rows in place, each group's padding as zeros (nn's wgrad)
        launch_only(quantize.grouped_column_block_values, x[:40], fmt, [32, 32], [1, 2], hadamard_seeds=[3, 4],
             rows=[25, 15], **knobs)
    nv = dict(block=(1, 16))
    for fmt, rows, columns in (  # a linear's two copies of one tensor from one read (x, or dy)
            (Format.NVFP4, nv, dict(hadamard="random", hadamard_seed=2, **nv)),
            (Format.NVFP4, dict(rounding="stochastic", seed=SEED, **nv), dict(rounding="stochastic", seed=3, **nv)),
            (Format.NVFP4, dict(profile="four_over_six", **nv), dict(profile="four_over_six", hadamard="te", **nv)),
            (Format.NVFP4, dict(rounding="stochastic", seed=torch.tensor([1]), **nv),
             dict(rounding="stochastic", seed=torch.tensor([3]), hadamard="random", hadamard_seed=torch.tensor([2]), **nv)),
            (Format.MXFP4, dict(mode="floor"), dict(mode="floor", hadamard="none"))):
        launch_only(quantize.block_values_pair, x, fmt, rows=rows, columns=columns, columns_len=64)
    launch_only(amax.finite_amax, x)
    for starts in ([0, 40], [0]):  # (every expert's amax in one launch; one group)
        launch_only(amax.grouped_finite_amax, x, torch.tensor(starts))
    launch_only(_decode_and_gemm, x, decode, gemm)
    a, b = torch.randn(64, 64, generator=g).bfloat16(), torch.randn(64, 64, generator=g).bfloat16()
    launch_only(matmul.scaled_mm, a, b, torch.ones(()), out_dtype=torch.bfloat16)
    launch_only(matmul.grouped_scaled_mm, a, torch.stack([b, b]), [32, 32], torch.ones(2), out_dtype=torch.float32)
    # the routing's counts kept on the device (a captured step): the tile list made by a kernel
    launch_only(matmul.grouped_scaled_mm, a, torch.stack([b, b]), torch.tensor([32, 32]), torch.ones(2))
    launch_only(matmul.grouped_scaled_mm, a, b[None], torch.tensor([64]), torch.ones(1))
    for dtype in (torch.float32, torch.bfloat16):  # every expert's wgrad, each over its own tokens
        launch_only(matmul.contraction_grouped_mm, a, b, [32, 0, 32], torch.ones(3), out_dtype=dtype)
    launch_only(matmul.contraction_grouped_mm, a, b, torch.tensor([32, 0, 32]), torch.ones(3), width_multiple=32)


def _decode_and_gemm(x, decode, gemm):
    """Decode and the packed-operand GEMM need real codes: quantize with the reference first."""
    from fp4lab.formats import quantize_mxfp4, quantize_nvfp4
    for q in (quantize_nvfp4(x.float()), quantize_mxfp4(x.float())):
        launch_only(decode.dequantize, q, torch.float32)
        launch_only(decode.block_values, q, torch.bfloat16)
        launch_only(gemm.fp4_mm, q, q, out_dtype=torch.bfloat16)


def launch_only(fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs), an error after its launches ignored: the launch is what counts, and what
    the entry point does with the (unwritten) outputs afterwards may fail."""
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001
        pass


def record(work) -> dict:
    """Runs ``work()`` with Triton's launch replaced by a Recorder -> the launches it made (its
    ``launches``: kernel, argument types, constexprs, options, attributes)."""
    recorder, real_run = Recorder(), JITFunction.run
    JITFunction.run = lambda fn, *a, **k: recorder(fn, *a, **k)
    try:
        work()
    finally:
        JITFunction.run = real_run
    if recorder.errors:  # (Triton would refuse these launches on a GPU too)
        raise RuntimeError("launches Triton could not specialize:\n" + "\n".join(recorder.errors))
    return recorder.launches


def main() -> int:
    launches = record(exercise)
    if "--list" in sys.argv:
        for fn, types, constexprs, options, attrs in launches.values():
            print(fn.__name__, types, constexprs, options, sorted(attrs))
    failed = 0
    for fn, types, constexprs, options, attrs in launches.values():
        consts = {fn.arg_names[i[0]]: v for i, v in constexprs.items()}
        start = time.perf_counter()
        try:
            triton.compile(ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=attrs), target=HOPPER,
                           options=options)
            print(f"ok     {time.perf_counter() - start:5.1f} s  {fn.__name__} {consts}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            print(f"FAILED {fn.__name__} {consts}\n{''.join(traceback.format_exception_only(e))}"
                  f"cause: {cause!r}")
    print(f"{len(launches)} launches compiled for sm_90 with Triton {triton.__version__}, {failed} failed")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
