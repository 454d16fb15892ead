"""Which E4M3 conversion form gives the reference's block values on this GPU (a check, not a timing).

    python benchmarks/check_e4m3_forms.py FORM        FORM: triton_cast | integer | int_encode | int_decode | inline

Runs tests/kernels/test_quantize.py's 15 NVFP4 block-values cases (fp32 and bf16 input, the
hard input of that file) through the Triton quantizer with the E4M3 encode and decode that FORM
names swapped into fp4lab.kernels (a fresh process per form: Triton compiles each kernel once),
and prints the cases whose values differ from the reference: Triton's own fp8 cast
(``.to(tl.float8e4nv)``, which converts pairs), the integer forms, either side alone, or the
inline PTX the kernels run on sm_89+. On an H100 with Triton 3.6 the cast failed 2 cases (6 with
the integer decode) and the others none (results/e4m3_forms_h100.log).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from fp4lab import formats, kernels  # noqa: E402
from fp4lab.kernels import elements, quantize  # noqa: E402


@triton.jit
def _cast_rtne(y):
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _cast_value(b):
    return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


def _use(encode, decode) -> None:
    if encode is not None:
        quantize.e4m3_rtne = encode
    if decode is not None:  # (scale_value in elements decodes too)
        quantize.e4m3_value = elements.e4m3_value = decode


def main() -> None:
    form = sys.argv[1] if len(sys.argv) > 1 else "inline"
    integer_encode, integer_decode = elements._e4m3_rtne_integer, elements._e4m3_value_integer
    forms = {"triton_cast": (_cast_rtne, _cast_value), "integer": (integer_encode, integer_decode),
             "int_encode": (integer_encode, _cast_value), "int_decode": (_cast_rtne, integer_decode),
             "inline": (None, None)}
    if form not in forms or not torch.cuda.is_available():
        raise SystemExit(f"usage: check_e4m3_forms.py {{{' | '.join(forms)}}} (on a GPU)")
    _use(*forms[form])
    from test_quantize import NVFP4_CASES, hard_input
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for kw in NVFP4_CASES:
            x = hard_input((96, 160), 6, dtype)
            f = kernels.quantize_values(x.cuda(), "nvfp4", backend="triton", **kw).values.cpu().float()
            r = kernels.BlockValues.of(formats.quantize_nvfp4(x, **kw)).values.float()
            differ = (f.nan_to_num(0.5) != r.nan_to_num(0.5)) | (f.isnan() != r.isnan())
            if differ.any():
                failures.append(f"{dtype} {kw}: {int(differ.sum())} values differ")
    print(f"{form} failures: {len(failures)}")
    for line in failures:
        print("  ", line)


if __name__ == "__main__":
    main()
