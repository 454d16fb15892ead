"""Checkpoint conversion speed and memory: fp4lab convert against a plain read + write of the
same tensors (CPU; the work is I/O and integer ops).

    python benchmarks/bench_convert.py [--gib 1.0] [--repeats 5] [--threads 1] [--stages]

Writes a synthetic gpt-oss-style MXFP4 model directory of about --gib GiB (expert tensors [E, out,
in/32, 16] of realistic LLM weights, so 'best' takes its verbatim fast path where the exponent
spread allows), then:

- times, in one worker process (imports and the input's page cache warmed by an untimed first
  round), --repeats rounds of (a) reading every tensor and writing them all to a new safetensors
  file with safetensors (save_file) and (b) fp4lab convert to a model directory, alternating
  which goes first, each after os.sync() so neither pays for flushing the other's writes, and
  each output removed before the next step; the doctor (which the CLI runs after convert) is
  timed apart on each round's output. The machine
  may be shared, so both the min (the least disturbed run) and the median are reported, with the
  ratio of each; the load average before and after says how contended the run was.
- measures peak memory apart from the timing, each step once in a fresh process (the parent,
  whose RSS a child's ru_maxrss starts from, imports no torch): ru_maxrss above the process's
  baseline after imports (it counts the pages of the memory-mapped input the step touches) and
  the sampled peak of anonymous memory (what the step allocates), also in units of the largest
  tensor.
- with --stages, splits one conversion into read (the input's bytes copied out of the mapped
  file), convert (mxfp4_to_nvfp4 on tensors already in memory) and write, summed over the MXFP4
  pairs: an estimate, as convert itself reads straight from the mapping (one copy less, which
  measured faster than reading into reused buffers).

Every process runs torch with --threads threads (OMP_NUM_THREADS too). Saves
benchmarks/results/convert.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import resource
import shutil
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


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _import_all(threads: int):
    import torch  # the baseline includes torch and safetensors, as in every step
    import fp4lab.convert.checkpoint  # noqa: F401
    import fp4lab.verify.checkpoint  # noqa: F401
    torch.set_num_threads(threads)
    return torch


def _timed(step: str, src: Path, dst: Path) -> float:
    os.sync()
    t0 = time.perf_counter()
    STEPS[step](src, dst)
    return time.perf_counter() - t0


def _time_worker(src: str, repeats: int, threads: int, queue) -> None:
    """All timed runs in one process: no process start or import in the numbers."""
    _import_all(threads)
    src, tmp = Path(src), Path(src).parent
    converted, copy = tmp / "convert-out", tmp / "copy.safetensors"
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    for r in range(-1, repeats):  # round -1 warms the page cache and lazy initialisation, untimed
        seconds = {}
        for step in ("read_write", "convert") if r % 2 == 0 else ("convert", "read_write"):
            seconds[step] = _timed(step, src, converted if step == "convert" else copy)
            if step == "convert":
                seconds["doctor"] = _timed("doctor", src, converted)
            # every step starts with only the input in the page cache: a step that ran beside the
            # last step's output (1 GB just written) took up to 2x longer
            _remove(converted if step == "convert" else copy)
        if r >= 0:
            for step, s in seconds.items():
                times[step].append(s)
    queue.put(times)


def _memory_child(step: str, src: str, dst: str, threads: int, queue) -> None:
    torch = _import_all(threads)
    if step == "source":  # here too, so that the parent, whose RSS a child starts from, stays small
        queue.put((*write_source(Path(src), float(dst)), torch.__version__, torch.get_num_threads()))
        return
    base, anon_base, sampler = _rss_mib(), _anon_mib(), _AnonPeak()
    sampler.start()
    STEPS[step](Path(src), Path(dst))
    sampler.stop.set()
    sampler.join()
    queue.put((_rss_mib() - base, sampler.peak - anon_base))


def _stages_worker(src: str, dst: str, threads: int, queue) -> None:
    """One conversion of every MXFP4 pair split into read, convert and write (seconds, summed)."""
    torch = _import_all(threads)
    from fp4lab.convert.mxfp4_to_nvfp4 import mxfp4_to_nvfp4
    from fp4lab.convert.stream import mx_tensor, open_safetensors

    buffers = {}
    with open_safetensors(Path(src) / "model.safetensors") as f, open(dst, "wb") as out:
        bases = [k[: -len("_blocks")] for k in f.keys() if k.endswith("_blocks")]
        for _ in range(2):  # the first pass warms the page cache and lazy initialisation
            stages = {"read": 0.0, "convert": 0.0, "write": 0.0}
            out.seek(0)
            for base in bases:
                t0 = time.perf_counter()
                q = mx_tensor(f, base)  # mapped, not read yet: the copies into reused buffers read it
                q = dataclasses.replace(q, codes=_reused(buffers, q.codes), scales=_reused(buffers, q.scales))
                t1 = time.perf_counter()
                nv, _ = mxfp4_to_nvfp4(q)
                t2 = time.perf_counter()
                for tensor in (nv.codes, nv.scales, nv.tensor_scale):
                    out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                t3 = time.perf_counter()
                stages["read"] += t1 - t0
                stages["convert"] += t2 - t1
                stages["write"] += t3 - t2
    queue.put(stages)


def _reused(buffers: dict, tensor):
    """tensor copied into a buffer kept per shape: a fresh one would add page faults to the read."""
    key = (tuple(tensor.shape), tensor.dtype)
    if key not in buffers:
        buffers[key] = tensor.new_empty(tensor.shape)
    return buffers[key].copy_(tensor)


def _in_process(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, queue))
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


def _summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "all": values}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stages", action="store_true", help="also split one conversion into read/convert/write")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned workers
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "mx"
        n, per_tensor, torch_version, threads = _in_process(_memory_child, "source", str(src), str(args.gib),
                                                            args.threads)
        size = (src / "model.safetensors").stat().st_size
        times = _in_process(_time_worker, str(src), args.repeats, args.threads)
        peak_rss, peak_anon = {}, {}
        for step in STEPS:
            os.sync()
            dst = Path(tmp) / ("copy.safetensors" if step == "read_write" else "convert-out")
            peak_rss[step], peak_anon[step] = _in_process(_memory_child, step, str(src), str(dst), args.threads)
            if step != "convert":  # the doctor reads convert's output
                _remove(dst)
        stages = _in_process(_stages_worker, str(src), str(Path(tmp) / "stages.bin"), args.threads) \
            if args.stages else None
    timing = {s: _summary(v) for s, v in times.items()}
    result = {"input_bytes": size, "tensors": n, "largest_tensor_mib": per_tensor / 2**20, "repeats": args.repeats,
              "torch_threads": threads, "torch": torch_version,
              "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
              "seconds": timing,
              "convert_over_read_write_min": timing["convert"]["min"] / timing["read_write"]["min"],
              "convert_over_read_write_median": timing["convert"]["median"] / timing["read_write"]["median"],
              "peak_rss_above_baseline_mib": peak_rss,
              "peak_anon_rss_above_baseline_mib": peak_anon,
              "peak_anon_in_largest_tensors": {s: p / (per_tensor / 2**20) for s, p in peak_anon.items()}}
    if stages is not None:
        result["convert_stages_s"] = stages
    print(json.dumps(result, indent=1))
    out_path = Path(__file__).parent / "results" / "convert.json"
    out_path.write_text(json.dumps(result, indent=1))
    print("saved", out_path)


if __name__ == "__main__":
    main()
