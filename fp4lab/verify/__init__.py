"""fp4lab.verify: check someone's FP4 GEMM, scale swizzle or quantizer against fp4lab's reference,
and say precisely where and why it differs.

    check_gemm(fn, fmt=, layout=, shapes=, seed=)   a candidate GEMM through a ladder of exact
                    cases (uniform, alpha, identity, one-hot blocks, every scale position), then
                    random operands within the FP32 summation bound (gemm.py, ladder.py); the
                    candidate's signature is in operands.py, with adapters for fp4lab's GEMMs
    check_layout(remap=, rows=, cols=)   the 128x4 swizzle round trip, byte by byte (layout.py)
    diff_quantizers(a, b, x)   where two quantizers disagree and which rule explains each block
                    (quantizer.py)
    check_checkpoint(dir, reference=)   the checkpoint doctor: an NVFP4 model directory against
                    the layout (ModelOpt, compressed-tensors) it declares, one ``Finding`` per
                    deviation (checkpoint.py, checkpoint_config.py, checkpoint_reference.py)
    cli.py          ``fp4lab verify gemm | layout | quantizer | checkpoint``

check_gemm and check_layout return a ``CheckResult`` (ok, rung, message, details; printable);
diff_quantizers a ``QuantizerDiff``.

Public: ``check_gemm``, ``check_layout``, ``diff_quantizers``, ``check_checkpoint``, ``Finding``,
``CheckResult``, ``QuantizerDiff``,
``as_gemm_fn``, ``fp4_operand``, ``reference_gemm``, ``emulated_gemm``, ``kernels_gemm``,
``describe_offset``.
"""

from .checkpoint import check_checkpoint
from .finding import Finding
from .gemm import DEFAULT_SHAPES, EXACT_SHAPE, check_gemm
from .layout import check_layout, describe_offset
from .operands import as_gemm_fn, emulated_gemm, fp4_operand, kernels_gemm, reference_gemm
from .quantizer import RULES, QuantizerDiff, diff_quantizers
from .result import CheckResult

__all__ = [
    "DEFAULT_SHAPES", "EXACT_SHAPE", "RULES", "CheckResult", "Finding", "QuantizerDiff", "as_gemm_fn",
    "check_checkpoint", "check_gemm",
    "check_layout", "describe_offset", "diff_quantizers", "emulated_gemm", "fp4_operand", "kernels_gemm",
    "reference_gemm",
]
