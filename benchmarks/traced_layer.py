"""One FP4 linear's step, eager against compiled on the traced ops (nn.ops): the GPU time per kernel.

    python benchmarks/traced_layer.py [--rows 16384 --k 768 --n 3072] [--recipe nvfp4] [--steps 10]

Compiled, a dense FP4 layer's kernels are launched by Inductor's generated code (the traced ops of
nn.ops); its kernels must be the eager layer's, with the same GPU time. Both run here side by side
(forward and backward of fp4_linear, x and W bf16, the seeds in a SeedTable): the CUDA time of
each kernel name a step under torch.profiler, summed, and the wall time of a step (one layer, so
host-bound: the host time each path spends).

Writes benchmarks/results/traced_layer.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, kernel_times, save  # noqa: E402
from fp4lab.nn import ops  # noqa: E402
from fp4lab.nn.gemms import QuantContext  # noqa: E402
from fp4lab.nn.linear import fp4_linear, layer_keys  # noqa: E402
from fp4lab.nn.recipe import preset  # noqa: E402
from fp4lab.nn.seeds import SeedTable  # noqa: E402


def wall_us(fn, steps: int) -> float:
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--k", type=int, default=768)
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--recipe", default="nvfp4")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    recipe = preset(args.recipe)
    index = ops.register_recipe(recipe)
    context, keys = QuantContext(seeds=SeedTable("cuda")), layer_keys(["block.fc"])
    x = torch.randn(args.rows, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.rows, args.n, device="cuda", dtype=torch.bfloat16)
    layer = torch.compile(lambda x, w: fp4_linear(x, w, None, index, context=context, keys=keys), fullgraph=True)
    paths = {"eager": lambda: fp4_linear(x, w, None, recipe, name="block.fc", context=context).backward(dy),
             "compiled": lambda: layer(x, w).backward(dy)}
    result = {**environment(), "shape": [args.rows, args.k, args.n], "recipe": args.recipe, "steps": args.steps,
              "traced": ops.traceable(index, True, "cuda"), "paths": {}}
    for name, fn in paths.items():
        for tick in range(5):  # (compiles, warms up)
            context.tick = tick
            fn()
        kernels = kernel_times(fn, args.steps, warmup=0)
        total = sum(us for us, _ in kernels.values())
        result["paths"][name] = {"kernels_us": kernels, "kernel_us": total, "wall_us": wall_us(fn, args.steps)}
        print(f"== {name}: {total:.1f} us of kernels a step, wall {result['paths'][name]['wall_us']:.1f} us")
        for key, (us, count) in sorted(kernels.items(), key=lambda row: -row[1][0])[:12]:
            print(f"  {us:9.1f} us  x{count:4.1f}  {key[:70]}")
    eager, compiled = result["paths"]["eager"], result["paths"]["compiled"]
    result["compiled_over_eager_kernels"] = compiled["kernel_us"] / eager["kernel_us"]
    result["compiled_over_eager_wall"] = compiled["wall_us"] / eager["wall_us"]
    print(f"compiled / eager: kernels x{result['compiled_over_eager_kernels']:.3f}, "
          f"wall x{result['compiled_over_eager_wall']:.3f}")
    save("traced_layer", result)


if __name__ == "__main__":
    main()
