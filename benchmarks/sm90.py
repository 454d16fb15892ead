"""fp4lab's Triton kernels compiled for an H100 (sm_90) on a machine with no GPU, and counted.

Shared by pair_instructions.py, quantize_instructions.py and grouped_instructions.py. A call's
launches are recorded through tests/kernels/hopper_compile.py (Triton's launch replaced, nothing
runs), compiled for sm_90 with the divisibility a real launch of a large shape is specialized on,
and read three ways: the PTX's instructions (and which source line each came from, by the PTX's
line records), and the cubin's SASS instructions and registers a thread (cuobjdump, which ships
with Triton). The kernels these scripts count are issue-bound on the H100 (benchmarks/NOTES.md,
the sixteenth and twenty-second sessions), so a count is what a change to them should lower; the
SASS is what the GPU issues (ptxas drops the PTX's register moves, and folds some operations).

Public: ``compiled_launches``, ``ptx_instructions``, ``by_source_line``, ``source_text``,
``sass_and_registers``.
"""

from __future__ import annotations

import collections
import linecache
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "the compiler is what is counted: unset TRITON_INTERPRET"

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
import hopper_compile  # noqa: E402

_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compiled_launches(work, sizes: tuple[str, ...], only: tuple[str, ...] | None = None):
    """-> [(kernel, {constexpr name: value}, launch options, the compiled kernel)] for each distinct
    launch ``work()`` makes (of the kernels named in ``only``, where given), compiled for sm_90 with
    every pointer and the ``sizes`` int arguments 16-divisible (what a real launch of a large shape
    is specialized on; not the recorder's attributes, whose small test shapes may leave a seed
    slice unaligned)."""
    out = []
    for fn, types, constexprs, options, _ in hopper_compile.record(lambda: hopper_compile.launch_only(work)).values():
        if only is not None and fn.__name__ not in only:
            continue
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if types[name] != "constexpr" and (types[name].startswith("*") or name in sizes)}
        kernel = triton.compile(ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=attrs),
                                target=hopper_compile.HOPPER, options=options)
        out.append((fn, {fn.arg_names[i[0]]: v for i, v in constexprs.items()}, options, kernel))
    return out


def ptx_instructions(ptx: str) -> list[str]:
    """The PTX body's instruction lines (predicated ones included), without labels and directives."""
    lines = (line.strip() for line in ptx.splitlines() if line.startswith("\t"))
    return [line for line in lines if line and (line[0].isalpha() or line.startswith("@"))]


def by_source_line(ptx: str) -> collections.Counter:
    """PTX instructions per source line ("file.py:line"), from the PTX's .file and .loc records."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.MULTILINE))
    counts, where = collections.Counter(), "?"
    for line in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            where = f"{Path(files.get(loc.group(1), '?')).name}:{loc.group(2)}"
        elif ptx_instructions(line):
            counts[where] += 1
    return counts


def source_text(where: str) -> str:
    """The text of a "file.py:line" of fp4lab's kernels (or Triton's language), for --lines."""
    name, _, number = where.partition(":")
    for folder in (ROOT / "fp4lab" / "kernels", Path(triton.__file__).parent / "language"):
        if (folder / name).is_file():
            return linecache.getline(str(folder / name), int(number)).strip()[:90]
    return ""


def sass_and_registers(cubin: bytes) -> tuple[int, int]:
    """(SASS instructions, registers a thread) of a compiled kernel, by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(_TOOLS / "cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(_TOOLS / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.MULTILINE)), int(re.search(r"REG:(\d+)", usage).group(1))
