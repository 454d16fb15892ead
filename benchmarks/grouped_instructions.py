"""PTX instructions a thread of the MoE's grouped quantize launches, compiled for an H100 on the CPU.

    python benchmarks/grouped_instructions.py [--experts 64] [--no-save]

Makes the grouped launches one FP4 MoE projection's step makes with the routing's counts on the
device (the rows copy RTNE and SR, the per-expert amax, the columns copy's amax and values passes
with random-sign RHT, read from unpadded rows), through tests/kernels/hopper_compile.py's
recorder, compiles each for sm_90 (no GPU, no TRITON_INTERPRET) and counts its PTX: instructions
in all, and those compiled from ``elements.group_of`` (finding a row's or a column tile's expert),
split by the PTX's loops into those run once and those in its loops, which run about
ceil(log2 G) times (the binary search; the linear scan before it ran G - 1 times). The estimate of
instructions executed a thread counts the search's loops at that trip count and every other
instruction once (the per-expert amax's own loop over columns included: it runs L / BC times).
These launches are instruction-bound on the H100 (benchmarks/NOTES.md, the sixteenth session), so
the executed count is what a change to them should lower. Writes
benchmarks/results/grouped_instructions.json.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import re
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler is what is counted: unset TRITON_INTERPRET"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
import hopper_compile  # noqa: E402
from benchmarks.common import environment, save  # noqa: E402
from benchmarks.sm90 import compiled_launches, ptx_instructions  # noqa: E402
from fp4lab.formats.types import Format  # noqa: E402
from fp4lab.kernels import elements, quantize  # noqa: E402


def _group_of_lines() -> range:
    """The source lines of elements.group_of."""
    lines, first = inspect.getsourcelines(elements.group_of.fn)
    return range(first, first + len(lines))


def _loop_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(header, back branch) line indices of each loop the PTX marks ("Loop Header")."""
    spans = []
    for i, line in enumerate(lines):
        if "Loop Header" in line:
            label = (line if re.match(r"^\$L__\w+:", line.strip()) else lines[i - 1]).strip().split(":")[0]
            back = next(j for j in range(i + 1, len(lines)) if "bra" in lines[j]
                        and lines[j].rstrip().rstrip(";").endswith(label))
            spans.append((i, back))
    return spans


def search_split(ptx: str, search: range) -> tuple[int, int]:
    """(instructions of group_of run once, those inside a loop) in a kernel's PTX."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.MULTILINE))
    lines = ptx.splitlines()
    spans, inside, once, looped = _loop_spans(lines), False, 0, 0
    for i, line in enumerate(lines):
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            inside = files.get(loc.group(1), "").endswith("elements.py") and int(loc.group(2)) in search
        elif inside and ptx_instructions(line):
            if any(a <= i <= b for a, b in spans):
                looped += 1
            else:
                once += 1
    return once, looped


def launches(experts: int) -> list:
    """The grouped quantize and amax launches of one MoE projection's step, compiled for sm_90
    (sm90.compiled_launches; pointers 16-byte aligned, sizes as they come)."""
    x = torch.randn(64 * experts, 512, dtype=torch.bfloat16)
    counts = torch.full((experts,), 64, dtype=torch.int64)
    widths = (counts + 31) // 32 * 32

    def work() -> None:
        hopper_compile.launch_only(quantize.grouped_block_values, x, Format.NVFP4, counts, [0] * experts)
        hopper_compile.launch_only(quantize.grouped_block_values, x, Format.NVFP4, counts, torch.arange(experts),
                                   rounding="stochastic")
        hopper_compile.launch_only(quantize.grouped_column_block_values, x, Format.NVFP4, widths, [0] * experts,
                                   rows=counts, hadamard="random", hadamard_seeds=torch.arange(experts))
    # (the small table launches of kernels.groups left out)
    return compiled_launches(work, (), only=("_fp4_quantize_kernel", "_grouped_amax_kernel"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    search = _group_of_lines()
    steps = max(1, math.ceil(math.log2(args.experts)))
    results = {}
    for fn, named, _, kernel in launches(args.experts):
        ptx = kernel.asm["ptx"]
        once, looped = search_split(ptx, search)
        name = fn.__name__ if fn.__name__ == "_grouped_amax_kernel" else (
            f"{'columns' if named['GROUPED'] == quantize.COL_GROUPS.value else 'rows'}"
            f"{' amax' if named['AMAX_ONLY'] else ''}{' SR' if named['STOCHASTIC'] else ''}")
        total = len(ptx_instructions(ptx))
        executed = total + looped * (steps - 1)
        results[name] = {"instructions": total, "search_once": once, "search_in_loops": looped,
                         "executed_estimate": executed, "search_executed": once + looped * steps}
        print(f"{name:16s} {total:5d} PTX instructions a thread; the group search {once} once and {looped} in "
              f"loops run about {steps} times at {args.experts} experts: about {once + looped * steps} of about "
              f"{executed} executed", flush=True)
    if not args.no_save:
        save("grouped_instructions", {**environment(), "experts": args.experts, "launches": results})


if __name__ == "__main__":
    main()
