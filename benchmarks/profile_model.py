"""Where a training step's time goes, BF16 and FP4, eager and compiled: torch.profiler per arm.

    python benchmarks/profile_model.py [--model d12 --batch 16 --seq 1024] [--runs nvfp4/eager nvfp4/compiled ...] [--host]

For each arm/mode (bench_model's steps, the same model and batch), after warm-up: the step's wall
time, the GPU's busy time (the sum of kernel times) and the kernel launches per step, so a step
reads as host-bound (wall far above GPU time) or device-bound; then the ops by own CUDA time and
by own CPU time. Writes benchmarks/results/profile_<model>.txt. With ``--host``, a cProfile of
each arm's steps instead (profile_<model>_host.txt): which Python spends the host's time. bench_model.py gives the ratio;
this gives the why. After the runs, each mode profiled in both arms gets a kernel diff: every kernel
name's time and launches a step in each arm and their difference, the largest first (``--diff-rows``),
so what FP4 adds to a step reads off one table (written beside the tables).
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


def kernel_totals(events, steps: int) -> dict[str, tuple[float, float]]:
    """-> {kernel name: (us a step, launches a step)} of a profile's device events."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(e.key, [0.0, 0.0])
            entry[0] += e.self_device_time_total / steps
            entry[1] += e.count / steps
    return {name: (us, count) for name, (us, count) in totals.items()}


def kernel_diff(base: dict[str, tuple[float, float]], other: dict[str, tuple[float, float]], *, rows: int,
                width: int, labels: tuple[str, str]) -> str:
    """The kernels whose time a step differs most between two runs, with both runs' totals."""
    names = sorted(set(base) | set(other), key=lambda n: -abs(other.get(n, (0, 0))[0] - base.get(n, (0, 0))[0]))
    head = f"{'kernel':<{width}} {labels[0] + ' us':>12} {labels[1] + ' us':>12} {'diff us':>10} {'launches':>17}"
    lines = [head, "-" * len(head)]
    for name in names[:rows]:
        (b_us, b_n), (o_us, o_n) = base.get(name, (0.0, 0.0)), other.get(name, (0.0, 0.0))
        lines.append(f"{name[:width]:<{width}} {b_us:12.1f} {o_us:12.1f} {o_us - b_us:+10.1f} {b_n:8.0f} {o_n:8.0f}")
    tb, to = (sum(v[0] for v in t.values()) for t in (base, other))
    nb, no = (sum(v[1] for v in t.values()) for t in (base, other))
    lines.append(f"{'all kernels':<{width}} {tb:12.1f} {to:12.1f} {to - tb:+10.1f} {nb:8.0f} {no:8.0f}")
    rest = sorted(names[rows:], key=lambda n: -abs(other.get(n, (0, 0))[1] - base.get(n, (0, 0))[1]))
    extra = sum(other.get(n, (0, 0))[1] - base.get(n, (0, 0))[1] for n in rest)
    lines.append(f"(the {len(rest)} names below the table: {extra:+.0f} launches a step between them)")
    return "\n".join(lines)


def profile_run(arm: str, mode: str, args) -> tuple[str, dict[str, tuple[float, float]]]:
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
    # kernels only: an operator's own device time repeats its kernels' (the 2026-11-25 files counted both)
    totals = kernel_totals(events, args.steps)
    gpu_us, launches = (sum(column) for column in zip((0.0, 0.0), *totals.values()))
    head = (f"== {args.model} {arm} {mode}: wall {wall:.1f} ms/step (profiled), GPU busy {gpu_us / 1e3:.1f} ms/step, "
            f"{launches:.0f} kernels/step")
    by_gpu = events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=args.name_width)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=args.name_width)
    return f"{head}\n-- by own CUDA time\n{by_gpu}\n-- by own CPU time\n{by_cpu}\n", totals


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
    parser.add_argument("--diff-rows", type=int, default=40, help="kernels in each mode's BF16-against-FP4 diff")
    parser.add_argument("--runs", nargs="*", default=["bf16/eager", "nvfp4/eager", "bf16/compiled", "nvfp4/compiled"])
    args = parser.parse_args()
    texts, kernels = [], {}
    for run in args.runs:
        arm, mode = run.split("/")
        try:
            if args.host:
                text = host_run(arm, mode, args)
            else:
                text, kernels[arm, mode] = profile_run(arm, mode, args)
        except Exception as exc:  # one arm's failure (a compile error, say) keeps the others' tables
            text = f"== {args.model} {arm} {mode}: failed: {type(exc).__name__}: {exc}\n"
        print(text, flush=True)  # whole, as it comes: a later arm's failure or a time limit keeps it
        texts.append(text)
    for (arm, mode), totals in kernels.items():
        if arm != "bf16" and ("bf16", mode) in kernels:
            diff = kernel_diff(kernels["bf16", mode], totals, rows=args.diff_rows, width=args.name_width,
                               labels=("bf16", arm))
            texts.append(f"== {args.model} {mode}: kernels a step, bf16 against {arm}\n{diff}\n")
            print(texts[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"profile_{args.model.replace('-', '_')}{'_host' if args.host else ''}.txt"
    out.write_text(f"{torch.cuda.get_device_name()}, batch {args.batch} x {args.seq}\n\n" + "\n".join(texts))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
