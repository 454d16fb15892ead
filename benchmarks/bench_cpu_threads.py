"""CPU threads for the reference path: 1 vs 2 vs all intra-op threads, idle and loaded.

The reference FP4 path runs many small element-wise ops, where torch's intra-op thread pool can
cost more than it gives, and on a loaded machine (another job, another test process) a busy
pool thrashes. This measures, on the machine it runs on:

    quantize   formats.quantize_nvfp4 of a 512 x 384 bf16 tensor
    step_bf16  one training step (forward, backward, AdamW) of the demo model (tiny, 8 x 256) in BF16
    step_nvfp4 the same step under the nvfp4_plain recipe (every GEMM in NVFP4, the reference path)

each with torch.set_num_threads(1 / 2 / all), first on an idle machine, then with a competing
process that keeps all cores busy with its own torch work (what a second job does). Medians of
repeated timings; JSON to benchmarks/results/cpu_threads.json.

    python benchmarks/bench_cpu_threads.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _competitor(stop) -> None:
    """Keep every core busy with torch work, as a second job would."""
    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(384, 384)
    while not stop.is_set():
        for _ in range(20):
            a = torch.tanh(a @ a.T * 1e-3)


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cases():
    from fp4lab.formats import quantize_nvfp4
    from fp4lab.nn import GPT, model_config, quantize_model, preset

    x = torch.randn(512, 384).bfloat16()
    tokens = torch.randint(0, 8192, (8, 257))

    def step_of(recipe: str):
        torch.manual_seed(0)
        model = GPT(model_config("tiny", vocab_size=8192, seq_len=256))
        quantize_model(model, preset(recipe))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    return {"quantize": lambda: quantize_nvfp4(x, pad=True), "step_bf16": step_of("bf16"),
            "step_nvfp4": step_of("nvfp4_plain")}


def measure(repeats: int) -> dict:
    cores = os.cpu_count() or 1
    counts = sorted({1, 2, cores})
    cases = _cases()
    out: dict = {}
    for load in ("idle", "loaded"):
        spawn = mp.get_context("spawn")  # a forked child would inherit the parent's OpenMP pool state
        stop = spawn.Event()
        busy = spawn.Process(target=_competitor, args=(stop,), daemon=True) if load == "loaded" else None
        if busy is not None:
            busy.start()
            time.sleep(5.0)  # let it import torch and get going
        try:
            for n in counts:
                torch.set_num_threads(n)
                for name, fn in cases.items():
                    out[f"{load}/{name}/threads{n}"] = _median_s(fn, repeats)
                    print(f"{load:6s} {name:10s} threads={n}: {out[f'{load}/{name}/threads{n}']:.3f} s", flush=True)
        finally:
            if busy is not None:
                stop.set()
                busy.join(5)
                if busy.is_alive():
                    busy.terminate()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times = measure(args.repeats)
    cores = os.cpu_count() or 1
    ratios = {}
    for load in ("idle", "loaded"):
        for name in ("quantize", "step_bf16", "step_nvfp4"):
            one = times[f"{load}/{name}/threads1"]
            ratios[f"{load}/{name}/threads{cores}_over_1"] = times[f"{load}/{name}/threads{cores}"] / one
        ratios[f"{load}/nvfp4_over_bf16_step/threads1"] = times[f"{load}/step_nvfp4/threads1"] / \
            times[f"{load}/step_bf16/threads1"]
    record = {"machine": f"{platform.processor() or platform.machine()}, {cores} cores", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "seconds": times, "ratios": ratios}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_threads.json").write_text(json.dumps(record, indent=1) + "\n")
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")


if __name__ == "__main__":
    main()
