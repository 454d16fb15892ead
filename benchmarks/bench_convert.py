"""Checkpoint conversion speed and memory: fp4lab convert against a plain read + write of the
same tensors (CPU; the work is I/O and integer ops).

    OMP_NUM_THREADS=1 python benchmarks/bench_convert.py [--gib 1.0] [--repeats 3]

Writes a synthetic gpt-oss-style MXFP4 model directory of about --gib GiB (expert tensors [E, out,
in/32, 16] of realistic LLM weights, so 'best' takes its verbatim fast path where the exponent
spread allows), then times, alternating, (a) reading every tensor and writing them all to a new
safetensors file with safetensors (save_file) and (b) fp4lab convert to a model directory,
without the doctor (the CLI runs it after; timed apart, as ``doctor_s``). Each step runs in its
own fresh process (the parent, whose RSS a child's ru_maxrss starts from, imports no torch),
so its peak resident memory is its own: reported above the process's baseline after imports,
both ru_maxrss (which counts the pages of the memory-mapped input each step touches) and the
sampled peak of anonymous memory (what the step allocates), the latter also in units of the
largest tensor. The order alternates and each step starts after
os.sync(), so neither pays for flushing the other's writes. The ratio is of the medians. Saves benchmarks/results/convert.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _anon_mib() -> float:
    """Anonymous resident memory now (Linux): allocations, without the mapped input file's pages."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _AnonPeak(threading.Thread):
    """Samples RssAnon every 2 ms: the kernel keeps no peak of it."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = _anon_mib(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, _anon_mib())


def _read_write(src: Path, dst: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(dst))


def _convert(src: Path, dst: Path) -> None:
    from fp4lab.convert.checkpoint import convert_checkpoint
    convert_checkpoint(src, dst)


def _doctor(src: Path, dst: Path) -> None:
    from fp4lab.verify.checkpoint import check_checkpoint
    assert check_checkpoint(dst) == [], "the doctor found errors in the converted benchmark checkpoint"


STEPS = {"read_write": _read_write, "convert": _convert, "doctor": _doctor}


def _child(step: str, src: str, dst: str, queue) -> None:
    import torch  # the baseline includes torch and safetensors, as in both steps
    import fp4lab.convert.checkpoint  # noqa: F401
    import fp4lab.verify.checkpoint  # noqa: F401
    if step == "source":  # here too, so that the parent, whose RSS a child starts from, stays small
        queue.put((*write_source(Path(src), float(dst)), torch.__version__, torch.get_num_threads()))
        return
    base, anon_base, sampler = _rss_mib(), _anon_mib(), _AnonPeak()
    sampler.start()
    t0 = time.perf_counter()
    STEPS[step](Path(src), Path(dst))
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    queue.put((seconds, base, _rss_mib(), sampler.peak - anon_base))


def run_step(step: str, src: Path, dst) -> tuple:
    """-> (seconds, baseline RSS MiB, peak RSS MiB, peak anonymous RSS above baseline MiB) of step,
    in a fresh process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(step, str(src), str(dst), queue))
    p.start()
    result = queue.get()
    p.join()
    return result


def write_source(root: Path, gib: float) -> tuple[int, float]:
    import torch
    from safetensors.torch import save_file

    from fp4lab.formats import quantize_mxfp4

    experts, out, inp = 8, 1024, 2048  # each expert tensor: 8 * 1024 * 2048 / 2 bytes = 8 MiB of codes
    per_tensor = experts * out * inp // 2 * (1 + 1 / 16)
    n = max(1, int(gib * 2**30 / per_tensor))
    g = torch.Generator().manual_seed(0)
    q = quantize_mxfp4(torch.randn(experts, out, inp, generator=g) * 0.02, mode="rceil")
    blocks, scales = q.codes.reshape(experts, out, inp // 32, 16), q.scales
    tensors = {}
    for i in range(n):
        tensors[f"model.layers.{i}.mlp.experts.down_proj_blocks"] = blocks.clone()
        tensors[f"model.layers.{i}.mlp.experts.down_proj_scales"] = scales.clone()
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}))
    return n, per_tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    peaks: dict[str, float] = {s: 0.0 for s in STEPS}
    anon: dict[str, float] = {s: 0.0 for s in STEPS}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "mx"
        n, per_tensor, torch_version, threads = run_step("source", src, args.gib)
        size = (src / "model.safetensors").stat().st_size
        for r in range(args.repeats):
            # alternate the order, and start each step with no dirty pages of the one before to flush
            for step in ("read_write", "convert") if r % 2 == 0 else ("convert", "read_write"):
                os.sync()
                dst = Path(tmp) / f"{step}-{r}"
                seconds, base, peak, extra = run_step(step, src, dst if step == "convert" else Path(tmp) / f"copy-{r}")
                times[step].append(seconds)
                peaks[step], anon[step] = max(peaks[step], peak - base), max(anon[step], extra)
            os.sync()
            seconds, base, peak, extra = run_step("doctor", src, Path(tmp) / f"convert-{r}")
            times["doctor"].append(seconds)
            peaks["doctor"], anon["doctor"] = max(peaks["doctor"], peak - base), max(anon["doctor"], extra)
            for old in Path(tmp).glob(f"*-{r}"):  # keep the disk use to one output at a time
                if old.is_dir():
                    for f in old.iterdir():
                        f.unlink()
                    old.rmdir()
                else:
                    old.unlink()
    median = {s: statistics.median(v) for s, v in times.items()}
    result = {"input_bytes": size, "tensors": n, "largest_tensor_mib": per_tensor / 2**20, "repeats": args.repeats,
              "read_write_s": median["read_write"], "convert_s": median["convert"], "doctor_s": median["doctor"],
              "convert_over_read_write": median["convert"] / median["read_write"],
              "all_s": times,
              "peak_rss_above_baseline_mib": peaks,
              "peak_anon_rss_above_baseline_mib": anon,
              "peak_anon_in_largest_tensors": {s: p / (per_tensor / 2**20) for s, p in anon.items()},
              "torch": torch_version, "torch_threads": threads}
    print(json.dumps(result, indent=1))
    out_path = Path(__file__).parent / "results" / "convert.json"
    out_path.write_text(json.dumps(result, indent=1))
    print("saved", out_path)


if __name__ == "__main__":
    main()
