"""Where an eager FP4 step's host time goes: Triton's launches against everything else.

    python benchmarks/host_split.py [--model d12 --batch 16 --seq 1024] [--steps 20]

An eager FP4 step is host-bound where its host time exceeds its GPU time (bench_model's eager
rows against its graphed ones). This splits the host time three ways, side by side in one run:

- ``wall``: the step as it runs (host-bound here, so host time);
- ``triton``: the host time of launching fp4lab's kernels (kernels.launch: a repeated call
  signature straight to the compiled kernel, a new one through Triton's JITFunction.run), timed
  around every launch, per kernel;
- ``no_launch``: the same step with every fp4lab kernel launch skipped (outputs left unwritten;
  nothing on the host reads them): fp4lab's Python and torch's own ops and launches (with
  ``--modes compiled``, Inductor's launches of the rest of the model too);
- ``gc``: the time Python's garbage collector ran during the wall timing, by generation, and
  ``wall_gc_off``: the step with the collector switched off (what a training loop that collects
  by hand between steps would pay).

Each timing is the median of ``--rounds`` rounds, taken in turns.

For one NVFP4 linear fwd+bwd at a shape where the GPU work is small (host-bound by far) and for
bench_model's step of ``--model`` in each of ``--modes`` (eager, compiled), NVFP4 and BF16.
Writes benchmarks/results/host_split.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_linear import bf16_step, nvfp4_step, tensors  # noqa: E402
from benchmarks.bench_model import make_step, step_arguments  # noqa: E402
from benchmarks.common import environment, save  # noqa: E402


class LaunchClock:
    """Times the host side of every launch of an fp4lab kernel (kernels.launch), per kernel;
    ``skip``: launch nothing."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.skip = False

    @contextlib.contextmanager
    def installed(self):
        from fp4lab.kernels import launch
        original = launch._Cached._launch

        def run(cached, grid, args, kwargs, kwargs_key):
            name = cached.kernel.fn.__name__
            self.calls[name] += 1
            if self.skip:
                return None
            start = time.perf_counter()
            try:
                return original(cached, grid, args, kwargs, kwargs_key)
            finally:
                self.seconds[name] += time.perf_counter() - start
        launch._Cached._launch = run
        try:
            yield self
        finally:
            launch._Cached._launch = original

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class GcClock:
    """Time spent in Python's garbage collector, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.runs = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.runs[info["generation"]] += 1

    @contextlib.contextmanager
    def installed(self):
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


def per_step_us(fn, steps: int, *, collector: bool = True) -> float:
    torch.cuda.synchronize()
    if not collector:
        gc.collect()
        gc.disable()
    try:
        start = time.perf_counter()
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps * 1e6
    finally:
        gc.enable()


def split(fn, steps: int, warmup: int, rounds: int, clock: LaunchClock) -> dict:
    """The timings of fn(i) (module doc), each kernel's launches and host µs per step, the collector's time."""
    for i in range(warmup):
        fn(i)
    walls, timed, no_launch, gc_off = [], [], [], []
    collector = GcClock()
    for _ in range(rounds):
        with collector.installed():
            walls.append(per_step_us(fn, steps))
        clock.reset()
        timed.append(per_step_us(fn, steps))  # (each launch timed: its wrapper's cost included)
        kernels = {name: {"launches": clock.calls[name] / steps, "host_us": clock.seconds[name] / steps * 1e6}
                   for name in sorted(clock.calls, key=lambda n: -clock.seconds[n])}
        clock.skip = True
        try:
            no_launch.append(per_step_us(fn, steps))
        finally:
            clock.skip = False
        gc_off.append(per_step_us(fn, steps, collector=False))
    triton_us = sum(k["host_us"] for k in kernels.values())  # (the last round's)
    launches = sum(k["launches"] for k in kernels.values())
    per_step = rounds * steps
    return {"wall_us": statistics.median(walls), "wall_rounds_us": walls, "wall_timed_us": statistics.median(timed),
            "triton_us": triton_us, "no_launch_us": statistics.median(no_launch),
            "wall_gc_off_us": statistics.median(gc_off), "gc_us": sum(collector.seconds) / per_step * 1e6,
            "gc_us_by_generation": [s / per_step * 1e6 for s in collector.seconds],
            "gc_runs_per_step": [n / per_step for n in collector.runs],
            "launches": launches, "triton_us_per_launch": triton_us / launches if launches else 0.0,
            "kernels": kernels}


def show(label: str, row: dict) -> None:
    print(f"{label}: wall {row['wall_us']:.0f} us; Triton launches {row['launches']:.0f} taking "
          f"{row['triton_us']:.0f} us ({row['triton_us_per_launch']:.1f} us each); without launching "
          f"{row['no_launch_us']:.0f} us; collector {row['gc_us']:.0f} us (runs per step by generation "
          f"{', '.join(f'{n:.2f}' for n in row['gc_runs_per_step'])}), wall with it off {row['wall_gc_off_us']:.0f} us",
          flush=True)
    for name, k in list(row["kernels"].items())[:8]:
        print(f"    {name}: {k['launches']:.1f} launches, {k['host_us']:.0f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    step_arguments(parser, warmup=3, steps=10)
    parser.add_argument("--linear", type=int, nargs=3, default=[1024, 1024, 1024], metavar=("M", "K", "N"))
    parser.add_argument("--linear-steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-model", action="store_true", help="the linear layer only")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"])
    args = parser.parse_args()
    clock = LaunchClock()
    rows = {}
    with clock.installed():
        x, w, dy = tensors(*args.linear)
        rows["linear_bf16"] = split(lambda i: bf16_step(x, w, dy), args.linear_steps, 20, args.rounds, clock)
        rows["linear_nvfp4"] = split(lambda i: nvfp4_step(x, w, dy), args.linear_steps, 20, args.rounds, clock)
        show(f"linear {args.linear} bf16", rows["linear_bf16"])
        show(f"linear {args.linear} nvfp4", rows["linear_nvfp4"])
        for mode in ([] if args.no_model else args.modes):
            torch.compiler.reset()
            for arm in ("bf16", "nvfp4"):
                key = f"{args.model}_{arm}" + ("" if mode == "eager" else f"_{mode}")
                rows[key] = split(make_step(arm, mode, args), args.steps, args.warmup, args.rounds, clock)
                show(f"{args.model} {arm} {mode} step", rows[key])
    payload = {**environment(), "linear": args.linear, "model": args.model, "batch": args.batch, "seq": args.seq,
               "modes": args.modes, "rows": rows}
    save("host_split", payload, {})


if __name__ == "__main__":
    main()
