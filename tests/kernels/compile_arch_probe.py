"""Which forms fp4lab's element helpers compile to, in a process with no device to ask (as in
Inductor's compile workers, which compile a traced op's kernels). Run without TRITON_INTERPRET;
prints one line a compile: a kernel of the helpers for sm_90, then for sm_80, then the dy pair's
kernel as Inductor's workers get it (for sm_90), each with whether the PTX holds the
directed-rounding add (SR below 1) and the E4M3 conversion."""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import driver
from fp4lab.kernels.elements import e2m1_stochastic_value, e4m3_rtne


class NoDevice:  # Inductor's compile workers: no device to ask
    def __getattr__(self, name):
        raise RuntimeError("no CUDA device in this process")


driver.set_active(NoDevice())


@triton.jit
def kernel(x_ptr, r_ptr, out_ptr, byte_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, e2m1_stochastic_value(x, tl.load(r_ptr)))
    tl.store(byte_ptr, e4m3_rtne(x))


for arch in (90, 80):
    source = ASTSource(fn=kernel, signature={"x_ptr": "*fp32", "r_ptr": "*i32", "out_ptr": "*fp32", "byte_ptr": "*i32"},
                       constexprs={})
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["ptx"]
    print(arch, "add.rp.f32" in ptx, "e4m3x2" in ptx)

# the dy pair's kernel as Inductor's workers get it: its source and its helpers' copied into a new
# module (torch's transitive-closure source of a user-defined kernel), compiled there for sm_90
import importlib.util  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import hopper_compile  # noqa: E402
from fp4lab.formats.types import Format  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402

recorder, real_run = hopper_compile.Recorder(), JITFunction.run
JITFunction.run = lambda fn, *a, **k: recorder(fn, *a, **k)
try:
    sr = dict(rounding="stochastic", seed=1)
    quantize.block_values_pair(torch.randn(64, 64, dtype=torch.bfloat16), Format.NVFP4, rows=sr,
                               columns=dict(sr, hadamard="te"), columns_len=64)
except Exception:  # noqa: BLE001 (the launches are what counts; the unwritten outputs may fail later)
    pass
finally:
    JITFunction.run = real_run
fn, types, constexprs, options = next(v for v in recorder.launches.values() if not v[2][(fn_index := next(
    i for i, name in enumerate(v[0].arg_names) if name == "AMAX_ONLY"),)])
source = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n" + \
    user_defined_triton_kernel_transitive_closure_source_code(fn)
path = Path(tempfile.mkdtemp()) / "inductor_kernel.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("inductor_kernel", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
copied = ASTSource(fn=getattr(module, fn.__name__), signature=types, constexprs=constexprs)
ptx = triton.compile(copied, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
print("inductor 90", "add.rp.f32" in ptx, "e4m3x2" in ptx)
