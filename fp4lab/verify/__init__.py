from .gemm import check_gemm
from .layout import check_layout
from .operands import as_gemm_fn, emulated_gemm, kernels_gemm, reference_gemm
from .result import CheckResult
