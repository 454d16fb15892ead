"""The quantize launches of one FP4 MoE projection at moe64's step shapes, each timed alone.

    python benchmarks/bench_moe_quantizes.py [--tokens 8192 --dim 512 --hidden 256 --experts 64 --top 6] [--tiles]

The graphed moe64 step spends about 14 ms of its GPU time in quantize passes against about 3 ms
of bytes (benchmarks/NOTES.md, 2026-11-26): this splits that time by the copy NVIDIA's recipe
makes of the routed rows (S = tokens x top rows over the experts, counts kept on the device as in a
graphed step), at the projection's two widths (gate/up read x [S, dim], down reads h [S, hidden]):

- ``x rows``: fprop's copy of x, 1x16 blocks along the width, round to nearest (grouped amax + values);
- ``dy rows SR``: dgrad's copy of dy, stochastic rounding;
- ``x columns RHT``: wgrad's copy of x along the tokens, read in place from the routed rows and
  laid out padded per expert to 32 (``rows=``, as nn runs it), random-sign Hadamard (a rotated
  amax pass + the values pass);
- ``dy columns RHT+SR``: wgrad's copy of dy, rotated and stochastically rounded;
- and, for scale, a dense linear's pair (both copies of [tokens, dim] from one read);
- controls, the routed rows without their groups: the tensor-wide amax pass, the per-expert amax
  pass the grouped rows copy makes, and the rows copy as one group with its amax given (so the
  grouped copy's time splits into its amax pass, its values pass and what finding each row's
  group costs).

Each is replayed from a CUDA graph (device time), as a fraction of the device's copy bandwidth.
Bytes counted: one read (2 per element) and the block values written (2 per element per copy),
so a copy that reads its input twice (an amax pass first) shows the second read in the ratio. Writes benchmarks/results/moe_quantizes.json.

``--tiles`` times each case again at every tile of benchmarks/sweep_quantize.py's lists for its
path (the rows copies: kernels.quantize.TILES["rows"]; the columns copies: TILES["transposed"],
whose column width a grouped launch fixes at 32; the pair: PAIR_TILE): the tiles were chosen at
8192 x 4096, and these copies are 256 or 512 wide. Writes moe_quantizes_tiles.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth_gbs, environment, graph_ms, save  # noqa: E402
from benchmarks.sweep_quantize import PAIR, ROWS, TRANSPOSED, with_tile  # noqa: E402
from fp4lab import kernels  # noqa: E402
from fp4lab.kernels import quantize  # noqa: E402
from fp4lab.kernels.amax import finite_amax, grouped_finite_amax  # noqa: E402

_RHT = {"hadamard": "random"}


def routed_counts(tokens: int, experts: int, top: int, seed: int = 0) -> torch.Tensor:
    """A routing's rows per expert: tokens x top rows over the experts, unevenly (a multinomial
    of skewed weights, as a router early in training gives)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.5
    picks = torch.multinomial(weights, tokens * top, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts)


def cases(counts: torch.Tensor, dim: int, hidden: int, tokens: int, dev: str = "cuda") -> dict:
    """name -> (fn, ideal bytes: one read of bf16, block values written): every launch on the device, the counts never read there
    (``dev`` cpu under TRITON_INTERPRET=1: a check of the calls at small sizes)."""
    sizes = counts.to(dev)
    widths = ((counts + 31) // 32 * 32).to(dev)  # wgrad's token axis, padded per expert
    seeds = torch.arange(1, counts.numel() + 1, dtype=torch.int64, device=dev)
    padded = int(widths.sum())
    out = {}
    for width, label in ((dim, f"[S, {dim}]"), (hidden, f"[S, {hidden}]")):
        x = torch.randn(int(counts.sum()), width, device=dev, dtype=torch.bfloat16)
        columns = 2 * x.numel() + 2 * padded * width  # the routed rows read, the padded layout written
        out[f"x rows {label}"] = (lambda x=x: kernels.quantize_grouped_values(x, "nvfp4", sizes, seeds), 4 * x.numel())
        out[f"dy rows SR {label}"] = (lambda x=x: kernels.quantize_grouped_values(
            x, "nvfp4", sizes, seeds, rounding="stochastic"), 4 * x.numel())
        out[f"x columns RHT {label}"] = (lambda x=x: kernels.quantize_grouped_columns(
            x, "nvfp4", widths, seeds, hadamard_seeds=seeds, rows=sizes, **_RHT), columns)
        out[f"dy columns RHT+SR {label}"] = (lambda x=x: kernels.quantize_grouped_columns(
            x, "nvfp4", widths, seeds, hadamard_seeds=seeds, rows=sizes, rounding="stochastic", **_RHT), columns)
        # controls, the same rows without the groups: where the grouped rows copy's time goes
        # (its per-expert amax pass, then the values pass, which finds each row's group)
        starts = sizes.cumsum(0) - sizes
        amax = finite_amax(x)
        out[f"control: amax pass [S, {width}]"] = (lambda x=x: finite_amax(x), 2 * x.numel())
        out[f"control: grouped amax [S, {width}]"] = (lambda x=x, starts=starts: grouped_finite_amax(x, starts),
                                                      2 * x.numel())
        out[f"control: rows, one group, amax given [S, {width}]"] = (
            lambda x=x, amax=amax: kernels.quantize_values(x, "nvfp4", global_amax=amax), 4 * x.numel())
    dense = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16)
    out[f"dense pair [{tokens}, {dim}]"] = (lambda: kernels.quantize_values_pair(
        dense, "nvfp4", rows={}, columns={"rounding": "stochastic", "seed": 5, "hadamard_seed": 7, **_RHT},
        columns_len=tokens), 6 * dense.numel())  # one read, two copies written
    return out


def device_ms(fn) -> float:
    """fn() replayed from a CUDA graph, its kernels compiled first (outside the graph)."""
    fn()
    return graph_ms(fn)


def tile_choices(name: str) -> tuple[str, list[tuple[int, int, int]]]:
    """The tile setting a case's launches read (a TILES key, or "pair") and the tiles to try."""
    if name.startswith("dense pair"):
        return "pair", PAIR
    if name.startswith("control: amax") or name.startswith("control: grouped"):
        return "amax", []  # not quantize launches: no tile to try
    if " columns " in name:  # a grouped columns launch fixes the tile's width at 32
        return "transposed", [t for t in TRANSPOSED if t[1] == quantize.COL_GROUP_WIDTH]
    return "rows", ROWS


def sweep_tiles(all_cases: dict, copy: float) -> dict:
    """Each case at every tile of its path: name -> tile -> ms and fraction of copy."""
    results = {}
    for name, (fn, nbytes) in all_cases.items():
        path, tiles = tile_choices(name)
        results[name] = {}
        for tile in tiles:
            key = f"{tile[0]}x{tile[1]}_w{tile[2]}"
            try:
                ms = with_tile(path, tile, lambda: device_ms(fn))
            except Exception as exc:  # e.g. too many registers for this tile
                print(f"{name:34s} {key:12s} {type(exc).__name__}")
                continue
            results[name][key] = {"ms": ms, "of_copy": nbytes / ms / 1e6 / copy}
            print(f"{name:34s} {key:12s} {ms * 1e3:8.1f} us  {results[name][key]['of_copy']:5.2f} of copy", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--tiles", action="store_true", help="time every case at each tile of its path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_quantizes.py times CUDA kernels: run it on a GPU")
    counts = routed_counts(args.tokens, args.experts, args.top)
    copy = copy_bandwidth_gbs()
    results = {}
    print(f"routed rows {int(counts.sum())} over {args.experts} experts (min {int(counts.min())}, "
          f"max {int(counts.max())}); device copy {copy:.0f} GB/s")
    for name, (fn, nbytes) in cases(counts, args.dim, args.hidden, args.tokens).items():
        ms = device_ms(fn)
        gbs = nbytes / ms / 1e6
        results[name] = {"ms": ms, "gb_per_s": gbs, "of_copy": gbs / copy}
        print(f"{name:34s} {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s  {gbs / copy:5.2f} of copy")
    save("moe_quantizes", {**environment(), "copy_gb_per_s": copy, "args": vars(args), "cases": results})
    if args.tiles:
        tiles = sweep_tiles(cases(counts, args.dim, args.hidden, args.tokens), copy)
        save("moe_quantizes_tiles", {**environment(), "copy_gb_per_s": copy, "args": vars(args), "cases": tiles})


if __name__ == "__main__":
    main()
