"""Shared benchmark plumbing: device facts, timing, and writing results JSON."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    import triton
    # the device machine gets a copy of the tree without .git: the caller passes the commit
    sha = os.environ.get("FP4LAB_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")  # (CPU-only benchmarks)
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "git": sha or "unknown"}


def one_copy_at_a_time(active: bool = True):
    """While active, fp4lab's FP4 layers quantize x and dy one copy at a time (FP4LAB_PAIR=0, the
    library's own switch): a step as it ran before the pair kernel, for a side-by-side timing. A
    captured graph keeps the choice made at capture."""
    return switched("FP4LAB_PAIR", "0", active)


def opaque_ops(active: bool = True):
    """While active, a compiled model's FP4 layers take the opaque custom ops, whose Python body runs
    at every call (FP4LAB_TRACED=0: nn.ops.traceable), not the traced ones Inductor launches; all
    else as the traced arm (its SeedTable too). A compiled graph keeps the choice made when it was
    traced."""
    return switched("FP4LAB_TRACED", "0", active)


@contextlib.contextmanager
def switched(name: str, value: str, active: bool = True):
    """While active, the environment variable ``name`` holds ``value`` (restored after)."""
    if not active:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def bench_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn, rep: int = 100) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: device time, no host overhead."""
    from triton.testing import do_bench_cudagraph
    return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def captured_ms(fn, warmup: int = 3) -> float:
    """Median milliseconds of fn() captured once in a CUDA graph and replayed, where fn runs
    autograd (forward and backward): warmed up on a side stream first, as capture with autograd
    requires. The wall time a captured training step pays for this work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def host_us(fn, calls: int = 2000) -> float:
    """Microseconds of host time a call of fn(), eager: its launches' cost where the GPU keeps up
    (call it at a shape small enough that the host is the bound)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def kernel_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Milliseconds of GPU kernel time per fn() call: the sum of the durations of every kernel it
    launches (torch.profiler), averaged over ``reps`` calls. Device cost without launch gaps, for
    work that a CUDA graph cannot capture (autograd's backward runs on its own thread)."""
    return sum(us for us, _ in kernel_times(fn, reps, warmup).values()) / 1e3


def kernel_times(fn, reps: int = 10, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """{name: (GPU microseconds of its own per fn() call, launches per call)} of every kernel fn()
    launches (torch.profiler, ``reps`` calls after ``warmup``): kernel_ms by name."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.self_device_time_total / reps, e.count / reps) for e in prof.key_averages()
            if getattr(e, "self_device_time_total", 0)}


def host_profile(fn, calls: int, warmup: int = 3, rows: int = 30) -> str:
    """cProfile of ``calls`` calls of fn() after ``warmup``, by own time and by cumulative time:
    where the host spends a step's time (launch arguments, Python loops, small tensor ops)."""
    import cProfile
    import io
    import pstats
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    for order in ("tottime", "cumulative"):
        out.write(f"-- by {order}, {calls} calls\n")
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(rows)
    return out.getvalue()


def copy_bandwidth_gbs(numel: int = 1 << 28) -> float:
    """Device-to-device copy of a bf16 tensor, bytes read + written per second."""
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


_STAMP = ("git", "date", "device", "torch", "triton")


def save(name: str, payload: dict, latest_keys: dict | None = None) -> Path:
    """Write results/<name>.json; merge ``latest_keys`` (ratios) into results/latest.json, each
    with its own run under ``run_of`` (the keys come from many calls at many commits: one stamp
    for the whole file would date keys it did not write)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    if latest_keys:
        latest_path = RESULTS / "latest.json"
        latest = json.loads(latest_path.read_text()) if latest_path.exists() else {}
        stamp = ", ".join(f"{k} {payload[k]}" for k in _STAMP)
        for key in _STAMP:  # (the old file-wide stamp)
            latest.pop(key, None)
        latest.update(latest_keys)
        latest.setdefault("run_of", {}).update({key: stamp for key in latest_keys})
        latest_path.write_text(json.dumps(latest, indent=1, sort_keys=True))
    return path
