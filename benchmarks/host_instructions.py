"""The host work of one FP4 linear's step, counted in CPU instructions: a measure the host's speed
does not move.

    python benchmarks/host_instructions.py [--base PATH] [--steps 300] [--size 64]

Wall-clock timings of host-bound steps on lent machines spread by more than a host-side change
moves them (benchmarks/NOTES.md, 2026-11-27), so this counts instructions instead: valgrind
(cachegrind, no cache simulation) runs one NVFP4 linear's fwd+bwd (``--size``^3, bf16, the
nvfp4 recipe, Triton's interpreter with fp4lab's kernel launches stubbed: what is counted is
fp4lab's Python and torch's own calls) for 10 and for 10 + ``--steps`` steps, and the difference
divided by ``--steps`` is the step's count. The same for a BF16 ``F.linear`` fwd+bwd at 16^3
(torch's dispatch, autograd and a tiny matmul), and, with ``--base``, for the fp4lab tree at
that path (e.g. ``git archive <commit> fp4lab | tar -x -C /tmp/base``). PYTHONHASHSEED=0 and
one torch thread, so that two runs count alike.
Needs valgrind on the PATH; CPU only. Writes benchmarks/results/host_instructions.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_NVFP4_STEP = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
os.environ["FP4LAB_BACKEND"] = "triton"
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)  # (no worker threads, whose waits valgrind would count)
from fp4lab.kernels import launch
launch._Cached._launch = lambda self, grid, args, kwargs, *key: None  # launches stubbed
from fp4lab.nn import QuantContext, fp4_linear
from fp4lab.nn.recipe import nvfp4
torch.manual_seed(0)
n = int(sys.argv[3])
x = torch.randn(n, n, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(n, n, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(n, n, dtype=torch.bfloat16)
recipe, context = nvfp4(), QuantContext()
def step():
    return torch.autograd.grad(fp4_linear(x, w, None, recipe, name="bench", context=context), (x, w), dy)
import gc; gc.disable()
for _ in range(10 + int(sys.argv[2])):
    step()
"""

_BF16_STEP = """
import sys
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(16, 16, dtype=torch.bfloat16)
import gc; gc.disable()
for _ in range(10 + int(sys.argv[2])):
    torch.autograd.grad(F.linear(x, w), (x, w), dy)
"""


def instructions(script: str, root: Path, steps: int, size: int) -> int:
    """Instructions valgrind counts for ``script`` run with (root, steps, size)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                               sys.executable, f.name, str(root), str(steps), str(size)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    finally:
        os.unlink(f.name)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"valgrind failed ({done.returncode}): {done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_step(script: str, root: Path, steps: int, size: int) -> float:
    """Instructions a step: (10 + steps) steps minus 10, over steps."""
    return (instructions(script, root, steps, size) - instructions(script, root, 0, size)) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="another fp4lab tree (a folder holding fp4lab/) to count too")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("host_instructions.py needs valgrind on the PATH")
    rows = {"bf16_linear": per_step(_BF16_STEP, ROOT, args.steps, 16)}
    trees = {"nvfp4_linear": ROOT, **({"nvfp4_linear_base": args.base.resolve()} if args.base else {})}
    for name, root in trees.items():
        rows[name] = per_step(_NVFP4_STEP, root, args.steps, args.size)
    for name, count in rows.items():
        print(f"{name:20s} {count / 1e6:6.3f} M instructions a step", flush=True)
    extra = {name: count - rows["bf16_linear"] for name, count in rows.items() if name != "bf16_linear"}
    for name, count in extra.items():
        print(f"{name:20s} {count / 1e6:6.3f} M over BF16's", flush=True)
    save("host_instructions", {**environment(), "steps": args.steps, "size": args.size,
                               "base": str(args.base) if args.base else None, "per_step": rows, "over_bf16": extra})


if __name__ == "__main__":
    main()
