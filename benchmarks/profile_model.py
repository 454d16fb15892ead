"""Where a training step's time goes, BF16 and FP4, eager and compiled: torch.profiler per arm.

    python benchmarks/profile_model.py [--model d12 --batch 16 --seq 1024] [--runs nvfp4/eager nvfp4/compiled ...] [--host]

For each arm/mode (bench_model's steps, the same model and batch), after warm-up: the step's wall
time, the GPU's busy time (the sum of kernel times) and the kernel launches per step, so a step
reads as host-bound (wall far above GPU time) or device-bound; then the ops by own CUDA time and
by own CPU time. Writes benchmarks/results/profile_<model>.txt. With ``--host``, a cProfile of
each arm's steps instead (profile_<model>_host.txt): which Python spends the host's time. bench_model.py gives the ratio;
this gives the why.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_model import make_step, step_arguments  # noqa: E402
from benchmarks.common import RESULTS, host_profile  # noqa: E402


def profile_run(arm: str, mode: str, args) -> str:
    step = make_step(arm, mode, args)
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            step(args.warmup + i)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    # kernels only: an operator's own device time repeats its kernels' (the 2026-11-25 files counted both)
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.steps
    launches = sum(e.count for e in kernels) / args.steps
    head = (f"== {args.model} {arm} {mode}: wall {wall:.1f} ms/step (profiled), GPU busy {gpu_us / 1e3:.1f} ms/step, "
            f"{launches:.0f} kernels/step")
    by_gpu = events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=args.name_width)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=args.name_width)
    return f"{head}\n-- by own CUDA time\n{by_gpu}\n-- by own CPU time\n{by_cpu}\n"


def host_run(arm: str, mode: str, args) -> str:
    step = make_step(arm, mode, args)
    counter = iter(range(10**9))
    return f"== {args.model} {arm} {mode}: cProfile\n" + host_profile(lambda: step(next(counter)), args.steps,
                                                                      warmup=args.warmup, rows=args.rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    step_arguments(parser, warmup=4, steps=2)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--name-width", type=int, default=60, help="characters of each kernel's name shown")
    parser.add_argument("--host", action="store_true", help="cProfile the host side instead")
    parser.add_argument("--runs", nargs="*", default=["bf16/eager", "nvfp4/eager", "bf16/compiled", "nvfp4/compiled"])
    args = parser.parse_args()
    texts = []
    for run in args.runs:
        arm, mode = run.split("/")
        try:
            text = (host_run if args.host else profile_run)(arm, mode, args)
        except Exception as exc:  # one arm's failure (a compile error, say) keeps the others' tables
            text = f"== {args.model} {arm} {mode}: failed: {type(exc).__name__}: {exc}\n"
        print(text.splitlines()[0], flush=True)
        texts.append(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"profile_{args.model.replace('-', '_')}{'_host' if args.host else ''}.txt"
    out.write_text(f"{torch.cuda.get_device_name()}, batch {args.batch} x {args.seq}\n\n" + "\n".join(texts))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
