"""Where an NVFP4 linear fwd+bwd spends its GPU time: torch.profiler's kernel table for one step.

    python benchmarks/profile_linear.py [--m 8192 --k 4096 --n 4096] [--host]

Prints the kernels of one fp4_linear forward + backward (nvfp4 preset, bf16 x, W, dy) by total
CUDA time, after warm-up, and the same for the BF16 layer; writes
benchmarks/results/profile_linear.txt. With --host: cProfile of 50 steps by own time, for the
host side (profile_linear_host.txt). Complements bench_linear.py's ratio with the why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_linear import bf16_step, nvfp4_step, tensors  # noqa: E402
from benchmarks.common import RESULTS, host_profile  # noqa: E402


def table(step, x, w, dy) -> str:
    for _ in range(3):
        step(x, w, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(x, w, dy)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)


def host_table(step, x, w, dy, calls: int = 50) -> str:
    """cProfile of ``calls`` steps: where the host spends its time per step."""
    return host_profile(lambda: step(x, w, dy), calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--host", action="store_true", help="profile the host side (cProfile) instead")
    args = parser.parse_args()
    x, w, dy = tensors(args.m, args.k, args.n)
    if args.host:
        text = host_table(nvfp4_step, x, w, dy)
        print(text)
        (RESULTS / "profile_linear_host.txt").write_text(text)
        return
    text = (f"M={args.m} K={args.k} N={args.n}, {torch.cuda.get_device_name()}\n\n== nvfp4\n"
            f"{table(nvfp4_step, x, w, dy)}\n== bf16\n{table(bf16_step, x, w, dy)}\n")
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "profile_linear.txt").write_text(text)


if __name__ == "__main__":
    main()
