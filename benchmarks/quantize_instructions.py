"""SASS instructions an element and registers of the single quantize kernel's launches, compiled
for an H100 on the CPU.

    python benchmarks/quantize_instructions.py [--lines N] [--no-save]

Records the launches of `quantize_nvfp4` (codes) and `nvfp4_block_values` (what nn multiplies)
on an [8192, 4096]-like call (amax given; and RHT + SR along axis 0) with Triton's launch replaced
by tests/kernels/hopper_compile.py's recorder, compiles each for sm_90 with the divisibility a real
launch of that shape is specialized on, and counts the cubin's SASS (cuobjdump, shipped with
Triton) a thread, divided by the elements a thread quantizes, and the registers a thread. The
kernels are issue-bound where this count, at four warp instructions a clock on 132 SMs, takes
longer than the bytes at copy speed (benchmarks/NOTES.md, the sixteenth and twenty-ninth sessions).
With ``--lines N``, each launch's N source lines that compile to the most PTX instructions.
Writes benchmarks/results/quantize_instructions.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler is what is counted: unset TRITON_INTERPRET"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import environment, save  # noqa: E402
from benchmarks.sm90 import by_source_line, compiled_launches, sass_and_registers, source_text  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "kernels"))
import hopper_compile  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402

SIZES = ("R", "L", "R_OUT", "LP", "stride_r", "stride_c")  # the int arguments a real launch has as multiples of 16


def cases() -> dict:
    x, amax = torch.randn(256, 256, dtype=torch.bfloat16), torch.tensor(4.0)
    rht_sr = dict(axis=0, hadamard="te", rounding="stochastic", seed=hopper_compile.SEED)
    return {"codes_amax_given": lambda: quantize.quantize_nvfp4(x, global_amax=amax),
            "values_amax_given": lambda: quantize.nvfp4_block_values(x, global_amax=amax),
            "codes_rht_sr": lambda: quantize.quantize_nvfp4(x, **rht_sr),
            "values_rht_sr": lambda: quantize.nvfp4_block_values(x, **rht_sr)}


def count(work) -> list[dict]:
    rows = []
    for fn, named, options, kernel in compiled_launches(work, SIZES):
        sass, registers = sass_and_registers(kernel.asm["cubin"])
        elements = named["BR"] * named["BC"] // (32 * options.get("num_warps", 4))
        rows.append({"pass": "amax" if named["AMAX_ONLY"] else "quantize", "tile": [named["BR"], named["BC"]],
                     "warps": options.get("num_warps", 4), "sass": sass, "elements_a_thread": elements,
                     "sass_an_element": sass / elements, "registers": registers,
                     "lines": by_source_line(kernel.asm["ptx"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=0, help="print each launch's N costliest source lines")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    results = {}
    for name, work in cases().items():
        for row in count(work):
            results[f"{name}_{row['pass']}"] = row
            print(f"{name:18s} {row['pass']:8s} tile {row['tile'][0]}x{row['tile'][1]}, {row['warps']} warps: "
                  f"{row['sass_an_element']:5.1f} SASS an element ({row['sass']} a thread), {row['registers']} registers",
                  flush=True)
            for where, n in row.pop("lines").most_common(args.lines):
                print(f"    {n:5d}  {where}  {source_text(where)}")
    if not args.no_save:
        save("quantize_instructions", {**environment(), "launches": results})


if __name__ == "__main__":
    main()
