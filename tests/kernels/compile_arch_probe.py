"""Which forms fp4lab's element helpers compile to, in a process with no device to ask (as in
Inductor's compile workers, which compile a traced op's kernels). Run without TRITON_INTERPRET;
prints one line a compile: a kernel of the helpers for sm_90, sm_89, sm_100, sm_80 and sm_75, then
the dy pair's kernel as Inductor's workers get it (for sm_90), each with whether the PTX holds the
directed-rounding add (SR below 1) and the E4M3 conversion; then compile_arch's guard (no code
generator on the stack: a host call) with no device, with an sm_80 device, and with no driver."""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).parent))
import hopper_compile  # noqa: E402
from fp4lab.formats.types import Format  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402
from fp4lab.kernels.elements import compile_arch, e2m1_stochastic_value, e4m3_rtne  # noqa: E402


class NoDevice:  # Inductor's compile workers: no device to ask
    def __getattr__(self, name):
        raise RuntimeError("no CUDA device in this process")


class Sm80:
    def get_current_target(self):
        return GPUTarget("cuda", 80, 32)


def no_driver():
    raise RuntimeError("no driver")


def forms(ptx: str) -> str:
    return f"{'add.rp.f32' in ptx} {'e4m3x2' in ptx}"


@triton.jit
def kernel(x_ptr, r_ptr, out_ptr, byte_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, e2m1_stochastic_value(x, tl.load(r_ptr)))
    tl.store(byte_ptr, e4m3_rtne(x))


def dy_pair_copies_launch() -> tuple:
    """The dy pair's copies pass as quantize launches it (kernel, argument types, constexprs, options)."""
    sr = dict(rounding="stochastic", seed=1)
    launches = hopper_compile.record(lambda: hopper_compile.launch_only(
        quantize.block_values_pair, torch.randn(64, 64, dtype=torch.bfloat16), Format.NVFP4, rows=sr,
        columns=dict(sr, hadamard="te"), columns_len=64))
    for fn, types, constexprs, options, _ in launches.values():
        if not constexprs[(fn.arg_names.index("AMAX_ONLY"),)]:
            return fn, types, constexprs, options
    raise SystemExit("the pair made no copies launch")


driver.set_active(NoDevice())
for arch in (90, 89, 100, 80, 75):
    signature = {"x_ptr": "*fp32", "r_ptr": "*i32", "out_ptr": "*fp32", "byte_ptr": "*i32"}
    ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={}),
                         target=GPUTarget("cuda", arch, 32)).asm["ptx"]
    print(arch, forms(ptx))

# the dy pair's kernel as Inductor's workers get it: its source and its helpers' copied into a new
# module (torch's transitive-closure source of a user-defined kernel), compiled there for sm_90
fn, types, constexprs, options = dy_pair_copies_launch()
path = Path(tempfile.mkdtemp()) / "inductor_kernel.py"
path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                + user_defined_triton_kernel_transitive_closure_source_code(fn))
spec = importlib.util.spec_from_file_location("inductor_kernel", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
copied = ASTSource(fn=getattr(module, fn.__name__), signature=types, constexprs=constexprs)
print("inductor 90", forms(triton.compile(copied, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]))

# the guard: called from the host there is no code generator, so the driver is asked
answers = [compile_arch.fn()]  # (no device)
driver.set_active(Sm80())
answers.append(compile_arch.fn())
type(driver).active = property(lambda self: no_driver())  # (what Triton says where it finds no driver)
answers.append(compile_arch.fn())
print("host", *answers)
