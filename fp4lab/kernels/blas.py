"""cuBLASLt's BF16 GEMM with the tensor scale read from device memory: the dense scaled GEMM on CUDA.

kernels.matmul's dense GEMM is C = round(alpha * (A @ B^T)) with an FP32 accumulation and alpha a
device scalar (the product of the operands' tensor scales, known only on the device). cuBLASLt
computes exactly that in its device pointer mode: alpha is read from memory when the GEMM runs, so
nothing syncs and a CUDA graph can capture the call. At d12's fifteen GEMM shapes it took 0.82 of
the persistent Triton kernel's time (cuBLAS's own speed: torch.mm's), and less host time a call
(benchmarks/NOTES.md, twenty-fourth session). It differs from the Triton kernels in summation
order only: the one reduction scheme allowed to split K sums the parts in fp32 (in a workspace,
then one pass that applies alpha), never in the output's bf16.

The library is the one torch loaded (found in the process's mappings), called through ctypes: no
build step. ``plan`` returns None wherever it does not apply (no CUDA, ROCm, the library not found,
FP4LAB_CUBLASLT=0, an operand without a unit stride or not 16-byte aligned, another dtype), and
matmul falls back to its Triton kernels. While torch.compile traces, a call is recorded as the
custom op ``fp4lab::lt_scaled_mm`` (an opaque call Inductor makes at run time).

The split-K workspace is one buffer per device, as the device constants are (made with the first
plan, never while a graph is captured): GEMMs of one device must not run on two streams at once,
which nothing in fp4lab does (a captured graph replays on the stream it is given, in order).

Public: ``plan``, ``LtPlan`` (``run``).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import weakref

import torch

from .host import PlanTable, env, starts_aligned, tracing

_BF16, _F32 = 14, 0  # cudaDataType_t
_COMPUTE_32F = 68  # cublasComputeType_t
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB = 2, 3, 4  # cublasLtMatmulDescAttributes_t
_POINTER_MODE_DEVICE = 1
_PREF_MAX_WORKSPACE, _PREF_REDUCTION_MASK = 1, 3  # cublasLtMatmulPreferenceAttributes_t
_PREF_ALIGNMENT = (5, 6, 7, 8)  # the minimum alignment of A, B, C and D in bytes
_REDUCTION_COMPUTE_TYPE = 2  # a split K summed in fp32 (never INPLACE or OUTPUT_TYPE: sums in the output dtype)
_WORKSPACE = 32 << 20  # bytes: split K at d12's [768, 768] weight gradient ran 1.6x faster (NOTES.md)
_ALIGN = 16


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_path() -> str | None:
    """The libcublasLt torch's CUDA build loaded into this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.cache
def _library():
    """(the ctypes library, its handle), or None where cuBLASLt cannot be had."""
    if torch.version.cuda is None or not torch.cuda.is_available() or not sys.platform.startswith("linux"):
        return None
    torch.cuda.current_blas_handle()  # (torch loads cuBLAS and cuBLASLt lazily)
    path = _loaded_path()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [p]
    lib.cublasLtMatmulDescCreate.argtypes = [p, i, i]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [p, i, p, size]
    lib.cublasLtMatrixLayoutCreate.argtypes = [p, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [p]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [p, i, p, size]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [p]
    lib.cublasLtMatmulDescDestroy.argtypes = [p]
    lib.cublasLtMatrixLayoutDestroy.argtypes = [p]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [p, p, p, p, p, p, p, i, p, p]
    lib.cublasLtMatmul.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p]
    handle = ctypes.c_void_p()
    if lib.cublasLtCreate(ctypes.byref(handle)) != 0:
        return None
    return lib, handle


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A device's fp32 1 (alpha where a GEMM has no scale), 0 (beta: C is not read) and split-K
    workspace: real memory even where the first plan is made while torch.compile traces (under
    its fake and functional modes a tensor made here would have no memory, and the plan kept for
    the run would read address 0)."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        made = (torch.ones((), dtype=torch.float32, device=device), torch.zeros((), dtype=torch.float32, device=device),
                torch.empty(_WORKSPACE, dtype=torch.uint8, device=device))
    if device.type == "cuda":  # (filled on the current stream; GEMMs may run on another)
        torch.cuda.current_stream(device).synchronize()
    return made


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _destroy(lib, desc: ctypes.c_void_p, layouts: tuple[ctypes.c_void_p, ...]) -> None:
    """Frees a plan's descriptors (those made: a null handle was never created)."""
    for layout in layouts:
        if layout.value:
            lib.cublasLtMatrixLayoutDestroy(layout)
    if desc.value:
        lib.cublasLtMatmulDescDestroy(desc)


def _layout(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """A 2D operand [rows, K] read as cuBLASLt's column-major matrix: (op, stored rows, stored
    columns, leading dimension), op 1 (transposed) where its K axis is the unit stride; None where
    no axis is, or the other stride is not a multiple of 16 bytes."""
    rows, k = t.shape
    if t.stride(1) == 1 and (t.stride(0) >= k or rows == 1):
        op, stored, ld = 1, (k, rows), max(t.stride(0), k)
    elif t.stride(0) == 1 and (t.stride(1) >= rows or k == 1):
        op, stored, ld = 0, (rows, k), max(t.stride(1), rows)
    else:
        return None
    if (ld * t.element_size()) % _ALIGN:
        return None
    return op, *stored, ld


class LtPlan:
    """One dense GEMM's cuBLASLt descriptors and algorithm, for its operands' shapes, strides and
    dtypes (an FP4 linear makes the same three GEMMs every step): D [M, N] row-major, computed as
    cuBLASLt's column-major D^T = op(B) op(A) with alpha and beta read from the device."""

    def __init__(self, lib, handle, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                 layouts: tuple[tuple, tuple]) -> None:
        self._lib, self._handle = lib, handle
        (m, k), n = a.shape, b.shape[0]
        (op_b, *b_dims), (op_a, *a_dims) = layouts[1], layouts[0]
        self._desc = ctypes.c_void_p()
        self._b, self._a, self._d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        # the descriptors are freed with the plan (matmul's plan table drops plans when it fills),
        # or here if the plan cannot be made
        weakref.finalize(self, _destroy, lib, self._desc, (self._b, self._a, self._d))
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _F32), "descriptor")
        # op_a (our layout's flag) says A's K is the unit stride: then A^T, read column-major, is
        # already K x M and cuBLASLt's second operand takes no transpose
        for attr, value in ((_DESC_POINTER_MODE, _POINTER_MODE_DEVICE), (_DESC_TRANSA, op_b), (_DESC_TRANSB, 1 - op_a)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(v), 4), "attribute")
        d_type = _BF16 if out_dtype == torch.bfloat16 else _F32
        for desc, dtype, dims in ((self._b, _BF16, b_dims), (self._a, _BF16, a_dims), (self._d, d_type, (n, m, n))):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(desc), dtype, *dims), "layout")
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            for attr, value in ((_PREF_MAX_WORKSPACE, ctypes.c_uint64(_WORKSPACE)),
                                (_PREF_REDUCTION_MASK, ctypes.c_uint32(_REDUCTION_COMPUTE_TYPE)),
                                *((a, ctypes.c_uint32(_ALIGN)) for a in _PREF_ALIGNMENT)):
                _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value),
                                                                ctypes.sizeof(value)), "preference attribute")
            found, count = _Heuristic(), ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self._desc, self._b, self._a, self._d, self._d, pref, 1,
                                                      ctypes.byref(found), ctypes.byref(count)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for {m} x {k} x {n}")
        self._algo = found  # (kept alive: cublasLtMatmul reads the algorithm through its address)
        self.m, self.n, self.out_dtype = m, n, out_dtype
        # the call's constant arguments, as plain ints (the call is on every GEMM's host path)
        self._matmul = lib.cublasLtMatmul
        self._device, self._index = a.device, a.device.index if a.device.index is not None else torch.cuda.current_device()
        self._constants = _constants(a.device)  # (held: the call passes their addresses)
        self._one, self._zero, self._workspace = (self._constants[0], self._constants[1].data_ptr(),
                                                  self._constants[2].data_ptr())
        self._algo_at = ctypes.addressof(found.algo)

    def run(self, a: torch.Tensor, b: torch.Tensor, scales: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """alpha * (a @ b^T) with alpha the product of ``scales`` (none, one or two [] fp32
        tensors, multiplied as S_dec_A * S_dec_B is in fp32), recorded as fp4lab::lt_scaled_mm
        while tracing; None where an operand does not start 16 bytes aligned (by address, or
        while tracing by its offset in its storage, which torch's and Inductor's allocations
        align): the caller's Triton kernels take that call."""
        if tracing():
            if not (starts_aligned(a) and starts_aligned(b)):
                return None
            return torch.ops.fp4lab.lt_scaled_mm(a, b, list(scales), self.out_dtype == torch.bfloat16)
        a_at, b_at = a.data_ptr(), b.data_ptr()
        if (a_at | b_at) % _ALIGN:
            return None
        if torch._C._cuda_getDevice() != self._index:  # (cuBLASLt launches on the current device)
            with torch.cuda.device(self._index):
                return self.run(a, b, scales)
        alpha = self._one if not scales else scales[0] if len(scales) == 1 else torch.mul(scales[0], scales[1])
        out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self._device)
        out_at = out.data_ptr()
        _check(self._matmul(self._handle, self._desc, alpha.data_ptr(), b_at, self._b, a_at, self._a, self._zero, out_at,
                            self._d, out_at, self._d, self._algo_at, self._workspace, _WORKSPACE,
                            torch._C._cuda_getCurrentRawStream(self._index)), "matmul")
        return out


def plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> LtPlan | None:
    """The cuBLASLt plan of a dense GEMM a [M, K] x b [N, K]^T, or None where it does not apply
    (module doc). Made once per call shape by matmul's plan table, so FP4LAB_CUBLASLT is read
    once per call shape (as TRITON_INTERPRET is), and a shape first met while a graph is captured
    keeps the Triton kernels in and out of graphs."""
    if (a.device.type != "cuda" or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16
            or out_dtype not in (torch.bfloat16, torch.float32) or env("FP4LAB_CUBLASLT", "1").lower() in (
                "0", "false", "off", "no")):
        return None
    layouts = _layout(a), _layout(b)
    if (b.shape[0] * (2 if out_dtype == torch.bfloat16 else 4)) % _ALIGN:
        return None  # (the output's rows would not start 16-byte aligned)
    # (made while a graph is captured, the device constants would be allocated in the graph's pool
    # and written only at replay: that call shape keeps the Triton kernels, in and out of graphs)
    if None in layouts or torch.cuda.is_current_stream_capturing():
        return None
    found = _library()
    if found is None:
        return None
    try:
        with torch.cuda.device(a.device):
            return LtPlan(*found, a, b, out_dtype, layouts)
    except RuntimeError:
        return None  # (no algorithm for this shape: the Triton kernels take it)


# A traced call's op. Defined on a Library fragment rather than with torch.library.custom_op: Inductor
# calls it from its generated Python once per GEMM, and custom_op's wrapper cost 3x the dispatch
# (11.5 against 3.6 us a call, measured on the CPU). No autograd: it is only ever traced inside
# nn.ops' traced GEMM ops, which carry their own.
_LIBRARY = torch.library.Library("fp4lab", "FRAGMENT")
_LIBRARY.define("lt_scaled_mm(Tensor a, Tensor b, Tensor[] scales, bool bf16_out) -> Tensor")


@functools.cache
def _matmul():
    from . import matmul  # (matmul imports this module)
    return matmul


# A traced call's plan, under a key of everything matmul's checks read (shapes, strides, dtypes,
# devices): a call after the first skips the checks and matmul's longer plan key. Inductor makes
# this call from Python once per GEMM, and the compiled step's host is as busy as its GPU.
_RECORDED = PlanTable(512)
_UNSEEN = object()


def _lt_scaled_mm(a: torch.Tensor, b: torch.Tensor, scales: list[torch.Tensor], bf16_out: bool) -> torch.Tensor:
    """A traced call of matmul.scaled_mm that took cuBLASLt, made at run time: the plan an eager
    call with these operands would take."""
    matmul = _matmul()
    out_dtype = torch.bfloat16 if bf16_out else torch.float32
    alphas = tuple(scales)
    if len(alphas) > 2:
        raise ValueError(f"fp4lab::lt_scaled_mm takes at most two scales, got {len(alphas)}")
    if matmul.CUBLASLT:  # (off: the Triton kernels, through scaled_mm; nothing kept for the key)
        key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device, bf16_out,
               tuple((s.dtype, s.device, s.shape) for s in alphas))
        lt = _RECORDED.get(key, _UNSEEN)
        if lt is _UNSEEN:
            plan = matmul.dense_plan(a, b, out_dtype, alphas)  # (raises where scaled_mm would)
            lt = _RECORDED.keep(key, plan.lt if plan is not None else None)
        if lt is not None and (out := lt.run(a, b, alphas)) is not None:
            return out
    return matmul.scaled_mm(a, b, alphas if len(alphas) == 2 else alphas[0] if alphas else None, out_dtype=out_dtype)


_LIBRARY.impl("lt_scaled_mm", _lt_scaled_mm, "CUDA")


@torch.library.register_fake("fp4lab::lt_scaled_mm")
def _(a, b, scales, bf16_out):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16 if bf16_out else torch.float32)
