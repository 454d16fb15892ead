"""Tile-shape sweep of the quantize kernel on the paths a training step runs along axis 0.

    python benchmarks/sweep_quantize.py

For each (BR, BC, warps) of kernels.quantize.TILES["transposed"] (and a few "rows" tiles): the
time of Wgrad's operands as nn quantizes them, x 8192 x 4096 bf16 read along axis 0 and written
as bf16 block values (2 + 2 bytes per element): RTNE, RHT + SR with the amax given, and the
rotated-amax pass alone; plus the plain row-wise quantize; and the pair kernel's tiles
(kernels.quantize.PAIR_TILE: x's fprop and wgrad copies from one read, both passes). Prints GB/s
over the copy bandwidth and writes benchmarks/results/sweep_quantize.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth_gbs, environment, graph_ms, save  # noqa: E402
from fp4lab import kernels  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402

TRANSPOSED = [(128, 64, 4), (64, 64, 4), (64, 32, 4), (128, 32, 4), (256, 32, 8), (64, 128, 4), (32, 64, 2),
              (128, 128, 8), (256, 64, 8), (32, 32, 1)]
ROWS = [(32, 128, 4), (16, 128, 2), (64, 64, 4), (16, 256, 4)]
PAIR = [(64, 64, 4), (32, 64, 4), (64, 32, 4), (128, 64, 8), (64, 128, 8), (32, 32, 2), (128, 128, 8)]


def with_tile(path: str, tile: tuple[int, int, int], fn):
    """fn() with the quantize kernel's tile for ``path`` (a kernels.quantize.TILES key, or "pair"
    for PAIR_TILE) set to ``tile``, restored after."""
    saved = quantize.PAIR_TILE if path == "pair" else quantize.TILES[path]
    if path == "pair":
        quantize.PAIR_TILE = tile
    else:
        quantize.TILES[path] = tile
    try:
        return fn()
    finally:
        if path == "pair":
            quantize.PAIR_TILE = saved
        else:
            quantize.TILES[path] = saved


def main() -> None:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    copy = copy_bandwidth_gbs()
    amax = kernels.quantize_values(x).tensor_scale * 2688  # any positive amax
    n = x.numel()
    cases = {"values_axis0": (dict(axis=0, global_amax=amax), n * 4, "transposed"),
             "values_axis0_rht_sr": (dict(axis=0, hadamard="te", rounding="stochastic", seed=1, global_amax=amax),
                                     n * 4, "transposed"),
             "values_axis0_rht_with_amax_pass": (dict(axis=0, hadamard="te"), n * 4, "transposed"),
             "values_rows": (dict(global_amax=amax), n * 4, "rows")}
    results = {}
    print(f"copy {copy:.0f} GB/s")
    for name, (kwargs, nbytes, path) in cases.items():
        for tile in TRANSPOSED if path == "transposed" else ROWS:
            key = f"{name}_{tile[0]}x{tile[1]}_w{tile[2]}"
            try:
                ms = with_tile(path, tile, lambda: graph_ms(
                    lambda: kernels.quantize_values(x, backend="triton", **kwargs)))
            except Exception as exc:  # e.g. too many registers for this tile
                print(f"{key}: {type(exc).__name__}")
                continue
            results[key] = {"ms": ms, "over_copy": nbytes / ms / 1e6 / copy}
            print(f"{key:52s} {ms:.3f} ms  {results[key]['over_copy']:.2f} of copy", flush=True)
    # the pair kernel (x's fprop and wgrad copies from one read: its two passes, amax included)
    for tile in PAIR:
        key = f"pair_x_rht_{tile[0]}x{tile[1]}_w{tile[2]}"
        try:
            ms = with_tile("pair", tile, lambda: graph_ms(lambda: kernels.quantize_values_pair(
                x, "nvfp4", rows={}, columns=dict(hadamard="random", hadamard_seed=2), columns_len=x.shape[0],
                backend="triton")))
        except Exception as exc:  # e.g. too many registers for this tile
            print(f"{key}: {type(exc).__name__}")
            continue
        results[key] = {"ms": ms, "over_copy": n * 6 / ms / 1e6 / copy}  # 2 read + 2 x 2 written
        print(f"{key:52s} {ms:.3f} ms  {results[key]['over_copy']:.2f} of copy", flush=True)
    save("sweep_quantize", {**environment(), "copy_gbs": copy, "cases": results})


if __name__ == "__main__":
    main()
