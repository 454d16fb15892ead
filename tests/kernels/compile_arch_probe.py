"""Which forms fp4lab's element helpers compile to, for sm_90 and sm_80, in a process with no
device to ask (as in Inductor's compile workers, which compile a traced op's kernels). Run without
TRITON_INTERPRET; prints one line a target: its capability, then whether the PTX holds the
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
