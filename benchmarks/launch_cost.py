"""Host time of one launch of each of an FP4 linear's kernels: Triton's path step by step, and
the cached launch (kernels.launch) beside it.

    python benchmarks/launch_cost.py

Runs one NVFP4 linear forward and backward (1024 x 1024 x 1024, the nvfp4 preset) and keeps the
arguments of every distinct launch. Then, per kernel, in a tight loop with no GPU sync (µs of
host time a launch): ``kernel[grid](...)`` through Triton's JITFunction.run; the steps of that
path on their own (device and stream, the argument binder, the cache key, the check of the
kernel's globals, launch metadata, the compiled kernel's run); and the same call through
kernels.launch.cached, which repeats the compiled kernel's run for a signature it has seen.
The steps follow Triton 3.6's JITFunction.run. Writes benchmarks/results/launch_cost.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, host_us, save  # noqa: E402


def linear_launches() -> dict:
    """kernel name -> (JITFunction, args, grid, kwargs) of its first launch in one FP4 linear step."""
    from triton.runtime.jit import JITFunction

    from fp4lab.nn import QuantContext, fp4_linear
    from fp4lab.nn.recipe import nvfp4
    seen, real = {}, JITFunction.run

    def keep(fn, *args, grid, warmup, **kwargs):
        seen.setdefault(fn.fn.__name__, (fn, args, grid, dict(kwargs)))
        return real(fn, *args, grid=grid, warmup=warmup, **kwargs)
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    JITFunction.run = keep
    try:
        # a fresh recipe seed: each kernel's signatures are new to the launch cache, so Triton sees them
        torch.autograd.grad(fp4_linear(x, w, None, nvfp4(), name="launch_cost", context=QuantContext()), (x, w),
                            torch.randn_like(x))
    finally:
        JITFunction.run = real
    return seen


def steps(fn, args, grid, kwargs) -> dict[str, float]:
    """Triton 3.6's JITFunction.run, one step at a time."""
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    kw = {**kwargs, "debug": fn.debug or knobs.runtime.debug,
          "instrumentation_mode": knobs.compilation.instrumentation_mode}
    kernel_cache, key_cache, _target, _backend, binder = fn.device_caches[device]
    bound, specialization, options = binder(*args, **kw)
    kernel = kernel_cache[compute_cache_key(key_cache, specialization, options)]
    values = list(bound.values())
    grid3 = (*grid, 1, 1)[:3]

    def check_globals():
        absent = object()
        for (name, _), (value, scope) in fn.used_global_vals.items():
            if scope.get(name, absent) != value:
                raise RuntimeError(name)
    metadata = kernel.launch_metadata(grid, stream, *values)
    return {"device_and_stream": host_us(lambda: driver.active.get_current_stream(driver.active.get_current_device())),
            "binder": host_us(lambda: binder(*args, **kw)),
            "cache_key": host_us(lambda: compute_cache_key(key_cache, specialization, options)),
            "globals": host_us(check_globals),
            "launch_metadata": host_us(lambda: kernel.launch_metadata(grid, stream, *values)),
            "compiled_run": host_us(lambda: kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, metadata,
                                                       knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                                                       *values)),
            "globals_checked": len(fn.used_global_vals)}


def main() -> None:
    from fp4lab.kernels.launch import cached
    rows = {}
    for name, (fn, args, grid, kwargs) in linear_launches().items():
        fast = cached(fn)
        row = {"args": len(args), "triton_us": host_us(lambda: fn[grid](*args, **kwargs)),
               "cached_us": host_us(lambda: fast[grid](*args, **kwargs)), **steps(fn, args, grid, kwargs)}
        rows[name] = row
        print(f"{name}: Triton's launch {row['triton_us']:.1f} us, cached {row['cached_us']:.1f} us "
              f"({row['cached_us'] / row['triton_us']:.2f}x) | {row['args']} args, {row['globals_checked']} globals; "
              f"device+stream {row['device_and_stream']:.1f}, binder {row['binder']:.1f}, cache key "
              f"{row['cache_key']:.1f}, globals {row['globals']:.1f}, launch metadata {row['launch_metadata']:.1f}, "
              f"compiled run {row['compiled_run']:.1f}", flush=True)
    save("launch_cost", {**environment(), "kernels": rows})


if __name__ == "__main__":
    main()
