"""Quantize and dequantize throughput on the GPU, as a fraction of the device's copy bandwidth.

    python benchmarks/bench_quantize.py [--rows 8192 --cols 4096] [--cases NAME ...]

Bytes counted per element (bf16 input): NVFP4 2 read + 0.5 codes + 1/16 scales = 2.5625 (the
amax pass reads the input once more, but the figure keeps the ideal single-pass byte count, so a
ratio below 1 also shows what the extra pass costs); MXFP4 2 + 0.5 + 1/32; the block-values cases
(quantize written as exact bf16 code * block scale, what nn's GEMMs multiply) 2 + 2. Every kernel is timed
side by side with a torch.compile'd build of the fp4lab.formats reference, "what a user would
write", and a device copy. Each case is timed twice: replayed from a CUDA graph (device time,
the figure the ratios use) and eagerly from Python (what launch overhead adds at this size). Writes benchmarks/results/quantize.json and the quant_* keys of
latest.json. ``--cases`` times only the cases named (e.g. the step table's nvfp4_rtne,
nvfp4_rtne_amax_given and nvfp4_rht_sr, in seconds where all take minutes) and keeps the file's
other cases where it holds the same commit's run of the same shape on the same device and
software (else the old file moves to quantize_<its git>.json); latest.json gets this call's keys.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, bench_ms, copy_bandwidth_gbs, environment, graph_ms, save  # noqa: E402
from fp4lab import formats, kernels  # noqa: E402
from fp4lab.kernels.amax import finite_amax  # noqa: E402


_SAME_RUN = ("git", "device", "shape", "torch", "triton")


def _merge(payload: dict, rows: dict, pair: dict) -> None:
    """What quantize.json is to hold after a ``--cases`` call, set in ``payload``: the file's other
    cases and pair ratios too where it is the same run (commit, device, shape, torch, Triton), else
    only this call's; a file from another run is first kept beside it as quantize_<its git>.json
    (or _2, _3, ... where that name is taken), so nothing is lost."""
    path = RESULTS / "quantize.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if payload["git"] != "unknown" and all(old.get(k) == payload[k] for k in _SAME_RUN):
        payload["cases"] = {**old.get("cases", {}), **rows}
        payload["pair_over_two_copies"] = {**old.get("pair_over_two_copies", {}), **pair}
        return
    if old:
        stem = f"quantize_{old.get('git', 'unknown')}"
        kept, n = RESULTS / f"{stem}.json", 1
        while kept.exists():
            n += 1
            kept = RESULTS / f"{stem}_{n}.json"
        kept.write_text(path.read_text())
        print(f"quantize.json held another run's cases ({old.get('git')}, {old.get('device')}): kept as {kept.name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--cases", nargs="*", help="only these cases (default: every one)")
    args = parser.parse_args()
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    copy = copy_bandwidth_gbs()
    amax = finite_amax(x)
    nv_bytes, mx_bytes = n * (2 + 0.5 + 1 / 16), n * (2 + 0.5 + 1 / 32)
    tri = dict(backend="triton")
    cases = {
        "nvfp4_rtne": (lambda: kernels.quantize_nvfp4(x, **tri), nv_bytes),
        "nvfp4_rtne_amax_given": (lambda: kernels.quantize_nvfp4(x, global_amax=amax, **tri), nv_bytes),
        "nvfp4_sr": (lambda: kernels.quantize_nvfp4(x, rounding="stochastic", seed=1, **tri), nv_bytes),
        "nvfp4_2d_weight": (lambda: kernels.quantize_nvfp4(x, block=(16, 16), **tri), nv_bytes),
        "nvfp4_axis0": (lambda: kernels.quantize_nvfp4(x, axis=0, **tri), nv_bytes),
        "nvfp4_rht_sr": (lambda: kernels.quantize_nvfp4(x, axis=0, hadamard="te", rounding="stochastic", seed=1,
                                                        **tri), nv_bytes),
        "nvfp4_rht_sr_amax_given": (lambda: kernels.quantize_nvfp4(x, axis=0, hadamard="te", rounding="stochastic",
                                                                   seed=1, global_amax=amax, **tri), nv_bytes),
        "nvfp4_rht_sr_unfused_reference_rht": (lambda: kernels.quantize_nvfp4(
            formats.hadamard_transform(x, axis=0, signs="te"), axis=0, rounding="stochastic", seed=1, **tri),
            nv_bytes),
        "mxfp4_floor": (lambda: kernels.quantize_mxfp4(x, **tri), mx_bytes),
        "mxfp4_rceil_sr": (lambda: kernels.quantize_mxfp4(x, mode="rceil", rounding="stochastic", seed=1, **tri),
                           mx_bytes),
        "amax_pass": (lambda: finite_amax(x), n * 2),
        # straight to bf16 block values (what nn's GEMMs multiply): 2 read + 2 written per element
        "nvfp4_values": (lambda: kernels.quantize_values(x, global_amax=amax, **tri), n * 4),
        "nvfp4_values_axis0": (lambda: kernels.quantize_values(x, axis=0, global_amax=amax, **tri), n * 4),
        "nvfp4_values_rht_sr": (lambda: kernels.quantize_values(x, axis=0, hadamard="te", rounding="stochastic",
                                                                 seed=1, global_amax=amax, **tri), n * 4),
    }
    # a linear's two copies of one tensor (NVIDIA's recipe): x for fprop (along K) and wgrad (along
    # the tokens, random-sign RHT), dy for dgrad and wgrad (both SR); one at a time with their amax
    # passes (4 reads of x, 2 writes) against the pair kernel (2 reads, 2 writes)
    rht = dict(hadamard="random", hadamard_seed=2)
    sr = dict(rounding="stochastic", seed=1)
    pair_cases = {"x": ({}, rht), "dy": (sr, {**sr, **rht, "seed": 3})}
    for t, (rows_kw, cols_kw) in pair_cases.items():
        cases[f"nvfp4_{t}_two_copies"] = (lambda r=rows_kw, c=cols_kw: (
            kernels.quantize_values(x, **r, **tri), kernels.quantize_values(x, axis=0, **c, **tri)), n * 8)
        cases[f"nvfp4_{t}_pair"] = (lambda r=rows_kw, c=cols_kw: kernels.quantize_values_pair(
            x, "nvfp4", rows=r, columns=c, columns_len=x.shape[0], **tri), n * 6)
    q = kernels.quantize_nvfp4(x, **tri)
    cases["nvfp4_dequantize_bf16"] = (lambda: kernels.dequantize(q, torch.bfloat16, **tri), n * (0.5 + 1 / 16 + 2))
    if not args.cases or "nvfp4_rtne_torch_compile_reference" in args.cases:
        try:
            compiled = torch.compile(formats.quantize_nvfp4)
            compiled(x)
            cases["nvfp4_rtne_torch_compile_reference"] = (lambda: compiled(x), nv_bytes)
        except Exception as exc:  # report, do not hide: the baseline row says why it is missing
            print(f"torch.compile baseline failed: {type(exc).__name__}: {exc}"[:300])
    if args.cases:
        unknown = sorted(set(args.cases) - set(cases) - {"nvfp4_rtne_torch_compile_reference"})
        if unknown:
            sys.exit(f"no such case: {', '.join(unknown)} (cases: {', '.join(cases)})")
        cases = {name: case for name, case in cases.items() if name in args.cases}

    rows = {}
    for name, (fn, nbytes) in cases.items():
        eager = bench_ms(fn)
        try:
            ms = graph_ms(fn)
        except Exception as exc:  # e.g. a baseline that syncs cannot be captured
            print(f"{name}: no CUDA graph ({type(exc).__name__}); timing eagerly")
            ms = eager
        rows[name] = {"ms": ms, "eager_ms": eager, "gbs": nbytes / ms / 1e6, "over_copy": nbytes / ms / 1e6 / copy,
                      "copy_gbs": copy}  # (each row its own copy figure: a merged file holds several calls')
    payload = {**environment(), "shape": [args.rows, args.cols], "dtype": "bfloat16",
               "copy_gbs": copy, "cases": dict(rows)}
    print(f"{payload['device']}  torch {payload['torch']}  triton {payload['triton']}")
    print(f"copy bandwidth (read + write): {copy:.0f} GB/s; x: {args.rows}x{args.cols} bf16")
    print(f"{'case':40s} {'ms':>8s} {'GB/s':>8s} {'/copy':>6s} {'eager ms':>9s}")
    for name, r in rows.items():
        print(f"{name:40s} {r['ms']:8.3f} {r['gbs']:8.0f} {r['over_copy']:6.2f} {r['eager_ms']:9.3f}")
    # the ratios below read this call's rows only, never a merged file's older ones
    pair = {t: rows[f"nvfp4_{t}_pair"]["ms"] / rows[f"nvfp4_{t}_two_copies"]["ms"] for t in pair_cases
            if f"nvfp4_{t}_pair" in rows and f"nvfp4_{t}_two_copies" in rows}
    if pair:
        print("a linear's two copies from one read, time over one copy at a time: "
              + ", ".join(f"{t} {r:.2f}x" for t, r in pair.items()))
        payload["pair_over_two_copies"] = pair
    if args.cases:
        _merge(payload, rows, pair)
    keys = {"quant_nvfp4_over_copy": "nvfp4_rtne", "quant_nvfp4_amax_given_over_copy": "nvfp4_rtne_amax_given",
            "quant_rht_sr_over_copy": "nvfp4_rht_sr", "quant_rht_sr_amax_given_over_copy": "nvfp4_rht_sr_amax_given",
            "quant_mxfp4_over_copy": "mxfp4_floor"}
    latest = {key: rows[case]["over_copy"] for key, case in keys.items() if case in rows}
    latest.update({f"quant_pair_{t}_over_two_copies": r for t, r in pair.items()})
    print("saved", save("quantize", payload, latest))


if __name__ == "__main__":
    main()
