"""PTX and SASS instructions a thread of the pair kernel's launches, compiled for an H100 on the CPU.

    python benchmarks/pair_instructions.py [--tile 64,32,4] [--programs N] [--lines N] [--no-save]

Quantizes a linear's x (rows RTNE, columns random-sign RHT) and dy (both SR) pairs through
kernels.quantize.block_values_pair with Triton's launch replaced by tests/kernels/hopper_compile.py's
recorder, then compiles each launch for sm_90 (no GPU, no TRITON_INTERPRET) with the divisibility a
real launch of these shapes is specialized on (pointers and the sizes multiples of 16), and counts
the PTX: instructions in all, those in the amax pass's loop (one tile's worth when a program takes
several: ``--programs 1`` makes every program take PAIR_ITERS tiles), shared-memory traffic and
layout conversions; and the cubin's SASS instructions and registers a thread; with
``--lines N``, each launch's N source lines that compile to the most instructions (from the PTX's
line records). The pair kernel is instruction-bound on the H100 (benchmarks/NOTES.md, the
twenty-second session), so this count is what a change to it should lower. Writes
benchmarks/results/pair_instructions.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler is what is counted: unset TRITON_INTERPRET"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import environment, save  # noqa: E402
from benchmarks.sm90 import (by_source_line, compiled_launches, ptx_instructions, sass_and_registers,  # noqa: E402
                             source_text)
from fp4lab.formats.types import Format  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402

SIZES = ("M", "K", "MP", "stride_m")  # the int arguments a real launch has as multiples of 16
PAIRS = {"x": ({}, dict(hadamard="random", hadamard_seed=2)),
         "dy": (dict(rounding="stochastic", seed=1), dict(rounding="stochastic", seed=3, hadamard="random",
                                                          hadamard_seed=2))}


def loop_instructions(ptx: str) -> int | None:
    """Instructions between the first loop header's label and the branch back to it (None: no loop)."""
    lines = ptx.splitlines()
    head = next((i for i, line in enumerate(lines) if "Loop Header" in line), None)
    if head is None:
        return None
    label = lines[head].split(":")[0]
    back = next(i for i in range(head + 1, len(lines)) if "bra" in lines[i] and lines[i].rstrip(";").endswith(label))
    return len(ptx_instructions("\n".join(lines[head:back + 1])))


def count(tensor: str) -> dict[str, dict]:
    rows, columns = PAIRS[tensor]
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    out = {}
    for fn, named, options, kernel in compiled_launches(
            lambda: quantize.block_values_pair(x, Format.NVFP4, rows=rows, columns=columns, columns_len=256), SIZES):
        ptx, body = kernel.asm["ptx"], ptx_instructions(kernel.asm["ptx"])
        sass, registers = sass_and_registers(kernel.asm["cubin"])
        ops = collections.Counter(line.lstrip("@!%p0123456789 ").split()[0].split(".")[0] for line in body)
        out["amax" if named["AMAX_ONLY"] else "copies"] = {
            "instructions": len(body), "sass": sass, "registers": registers,
            "loop_instructions": loop_instructions(ptx), "iters": named["ITERS"],
            "shared_loads": sum(line.startswith("ld.shared") for line in body),
            "shared_stores": sum(line.startswith("st.shared") for line in body),
            "layout_conversions": kernel.asm["ttgir"].count("convert_layout"),
            "top": dict(ops.most_common(10)), "lines": by_source_line(ptx)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tile", default=",".join(map(str, quantize.PAIR_TILE)), help="BM,BK,warps")
    parser.add_argument("--programs", type=int, default=quantize.PAIR_PROGRAMS, help="PAIR_PROGRAMS")
    parser.add_argument("--lines", type=int, default=0, help="print each launch's N costliest source lines")
    parser.add_argument("--no-save", action="store_true", help="print only (the tests)")
    args = parser.parse_args()
    quantize.PAIR_TILE = tuple(int(v) for v in args.tile.split(","))
    quantize.PAIR_PROGRAMS = args.programs
    elements = quantize.PAIR_TILE[0] * quantize.PAIR_TILE[1] // (32 * quantize.PAIR_TILE[2])
    results = {}
    for tensor in PAIRS:
        for name, row in count(tensor).items():
            results[f"{tensor}_{name}"] = row
            per_tile = row["loop_instructions"] or row["instructions"]
            print(f"{tensor} {name:6s} tile {args.tile}, {row['iters']} a program: {row['instructions']} PTX "
                  f"instructions a thread, {per_tile} a tile ({per_tile / elements:.1f} an element); shared "
                  f"{row['shared_loads']} ld / {row['shared_stores']} st, {row['layout_conversions']} layout "
                  f"conversions; {row['sass']} SASS a thread, {row['registers']} registers", flush=True)
            lines = row.pop("lines")
            for where, n in lines.most_common(args.lines):
                print(f"    {n:5d}  {where}  {source_text(where)}")
    if not args.no_save:
        save("pair_instructions", {**environment(), "tile": quantize.PAIR_TILE, "programs": args.programs,
                                   "elements_a_thread": elements, "launches": results})


if __name__ == "__main__":
    main()
