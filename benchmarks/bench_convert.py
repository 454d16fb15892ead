"""Checkpoint conversion speed and memory: fp4lab convert against a plain read + write of the
same tensors (CPU; the work is I/O and integer ops).

    python benchmarks/bench_convert.py [--gib 1.0] [--layers 24]

Writes a synthetic gpt-oss-style MXFP4 checkpoint of about --gib GiB (expert tensors [E, out,
in/32, 16] with realistic LLM weights, so 'best' takes its verbatim fast path where the exponent
spread allows), times (a) reading every tensor and writing it to a new safetensors file with
safetensors, (b) fp4lab's streamed conversion, and reports the ratio and the peak resident memory
of each step as a multiple of the largest tensor. Saves benchmarks/results/convert.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp4lab.convert.checkpoint import convert_checkpoint  # noqa: E402
from fp4lab.formats import quantize_mxfp4  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    experts, out, inp = 8, 1024, 2048  # each expert tensor: 8 * 1024 * 2048 / 2 bytes = 8 MiB of codes
    per_tensor = experts * out * inp // 2 * (1 + 1 / 16)
    n_tensors = max(1, int(args.gib * 2**30 / per_tensor))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "mx.safetensors"
        g = torch.Generator().manual_seed(0)
        w = torch.randn(experts, out, inp, generator=g) * 0.02
        q = quantize_mxfp4(w, mode="rceil")
        blocks, scales = q.codes.reshape(experts, out, inp // 32, 16), q.scales
        tensors = {}
        for i in range(n_tensors):
            tensors[f"model.layers.{i}.mlp.experts.down_proj_blocks"] = blocks.clone()
            tensors[f"model.layers.{i}.mlp.experts.down_proj_scales"] = scales.clone()
        save_file(tensors, str(src))
        del tensors
        size = src.stat().st_size
        base_rss = peak_rss_mib()

        t0 = time.perf_counter()
        with safe_open(str(src), framework="pt") as f:
            copied = {k: f.get_tensor(k) for k in f.keys()}
        save_file(copied, str(Path(tmp) / "copy.safetensors"))
        del copied
        read_write = time.perf_counter() - t0
        copy_rss = peak_rss_mib()

        t0 = time.perf_counter()
        report = convert_checkpoint(src, Path(tmp) / "nv.safetensors")
        convert = time.perf_counter() - t0
        convert_rss = peak_rss_mib()

    result = {"input_bytes": size, "tensors": n_tensors, "largest_tensor_mib": per_tensor / 2**20,
              "read_write_s": read_write, "convert_s": convert, "convert_over_read_write": convert / read_write,
              "peak_rss_mib_after_setup": base_rss, "peak_rss_mib_after_copy": copy_rss,
              "peak_rss_mib_after_convert": convert_rss,
              "lossless_tensors": sum(r["lossless"] for r in report.values()), "torch": torch.__version__}
    print(json.dumps(result, indent=1))
    out_path = Path(__file__).parent / "results" / "convert.json"
    out_path.write_text(json.dumps(result, indent=1))
    print("saved", out_path)


if __name__ == "__main__":
    main()
