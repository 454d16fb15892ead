"""Study: MXFP4 -> NVFP4 conversion methods on 27 input scenarios (after the Model-Optimizer
draft study; docs/numerics.md "MXFP4 -> NVFP4 conversion").

Each scenario is a seeded generator, pinned by the SHA-256 of its float32 bytes. Every input is
encoded to MXFP4 with fp4lab's RCEIL encoder (the NVIDIA conversion rule; ``--mx-mode`` changes
it), converted by every method, and scored by exact MSE against the MXFP4 values. The report is a
markdown table (MSE per method, the spread, the closed-form m) with win/tie counts, plus the
receipt JSON it is rebuilt from.

Public: ``SCENARIOS``, ``run``, ``report``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable

import torch

from ..convert import ConvertMethod, mxfp4_to_nvfp4
from ..formats import quantize_mxfp4

METHODS = [m.value for m in ConvertMethod]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _block_exponents(rows: int, cols: int, spread: int, g: torch.Generator) -> torch.Tensor:
    """Uniform data whose 32-element blocks have amax exactly 2^e, e uniform in [0, spread] with
    both ends used: any exponent rule then gives a block-exponent spread of exactly ``spread``."""
    e = torch.randint(0, spread + 1, (rows, cols // 32), generator=g)
    e.view(-1)[0], e.view(-1)[1] = 0, spread
    x = (torch.rand(rows, cols // 32, 32, generator=g) * 2 - 1) * 0.99
    x[..., 0] = 1.0
    return (x * torch.exp2(e.float())[..., None]).reshape(rows, cols)


def _outliers(x: torch.Tensor, fraction: float, scale: float, g: torch.Generator) -> torch.Tensor:
    mask = torch.rand(x.shape, generator=g) < fraction
    return torch.where(mask, x * scale, x)


SCENARIOS: dict[str, Callable[[torch.Generator], torch.Tensor]] = {
    "uniform": lambda g: torch.rand(256, 1024, generator=g) * 2 - 1,
    "gaussian": lambda g: torch.randn(256, 1024, generator=g),
    "heavy_tail": lambda g: torch.randn(256, 1024, generator=g) / torch.randn(2, 256, 1024, generator=g)
    .square().mean(0).sqrt(),  # Student-t, 2 degrees of freedom
    "rare_outliers": lambda g: _outliers(torch.randn(256, 1024, generator=g), 1e-3, 100.0, g),
    "mixed_block_scales": lambda g: _block_exponents(256, 1024, 12, g),
    "narrow_range": lambda g: 1.0 + 0.01 * torch.randn(256, 1024, generator=g),
    "llm_weights": lambda g: 0.02 * torch.randn(256, 1024, generator=g)
    * torch.exp(0.5 * torch.randn(256, 1, generator=g)),
    "mostly_zeros": lambda g: torch.randn(256, 1024, generator=g) * (torch.rand(256, 1024, generator=g) < 0.05),
    "spread_15": lambda g: _block_exponents(256, 1024, 15, g),
    "spread_17": lambda g: _block_exponents(256, 1024, 17, g),
    "spread_18": lambda g: _block_exponents(256, 1024, 18, g),
    "spread_50": lambda g: _block_exponents(256, 1024, 50, g),
    "bimodal": lambda g: torch.randn(256, 1024, generator=g) * 0.1
    + torch.where(torch.rand(256, 1024, generator=g) < 0.5, -2.0, 2.0),
    "pareto": lambda g: (torch.rand(256, 1024, generator=g).clamp(min=1e-6) ** (-1 / 1.5))
    * torch.where(torch.rand(256, 1024, generator=g) < 0.5, -1.0, 1.0),
    "row_outliers": lambda g: torch.randn(256, 1024, generator=g)
    * torch.where(torch.rand(256, 1, generator=g) < 0.02, 1000.0, 1.0),
    "col_outliers": lambda g: torch.randn(256, 1024, generator=g)
    * torch.where(torch.rand(1, 1024, generator=g) < 0.01, 1000.0, 1.0),
    "single_outlier": lambda g: torch.randn(256, 1024, generator=g).index_put_(
        (torch.tensor([7]), torch.tensor([300])), torch.tensor([1e6])),
    "subnormal_heavy": lambda g: torch.randn(256, 1024, generator=g) * 1e-39,
    "saturating": lambda g: torch.randn(256, 1024, generator=g) * 1e36,
    "sign_bimodal": lambda g: torch.randn(256, 1024, generator=g).abs() * 0.2 + 1.0
    * torch.where(torch.rand(256, 1024, generator=g) < 0.5, -1.0, 1.0),
    "constant": lambda g: torch.full((256, 1024), 0.3),
    "qkv_weight": lambda g: torch.randn(3 * 256, 512, generator=g) / math.sqrt(512)
    * torch.tensor([1.0, 1.0, 0.5]).repeat_interleave(256)[:, None],
    "mlp_weight": lambda g: torch.randn(1024, 256, generator=g) / 16
    * torch.exp(0.3 * torch.randn(1, 256, generator=g)),
    "embedding": lambda g: torch.randn(2048, 128, generator=g) * torch.exp(torch.randn(2048, 1, generator=g)),
    "layernorm": lambda g: (1.0 + 0.1 * torch.randn(1, 4096, generator=g)),
    "conv_weight": lambda g: (torch.randn(128, 64, 3, 3, generator=g) / 24).reshape(128, 576),
    "large_flat": lambda g: torch.randn(1 << 22, generator=g),
}


def scenario_input(name: str, seed: int = 0) -> torch.Tensor:
    """The float32 input of a scenario (seeded: the same bytes every run)."""
    return SCENARIOS[name](_gen(seed)).to(torch.float32).contiguous()


def _sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()


def run(out_dir: str | Path, *, mx_mode: str = "rceil", seed: int = 0,
        names: list[str] | None = None) -> dict:
    """Run the study; write receipt.json and table.md under out_dir; return the receipt."""
    rows = []
    for name in names or list(SCENARIOS):
        x = scenario_input(name, seed)
        q = quantize_mxfp4(x, mode=mx_mode, pad=True)
        row = {"scenario": name, "shape": list(x.shape), "sha256": _sha256(x), "mse": {}}
        for method in METHODS:
            _, r = mxfp4_to_nvfp4(q, method)
            row["mse"][method] = r.mse
            if method == "hybrid":
                row.update(spread=r.spread, m=r.m, blocks_out_of_range=r.blocks_out_of_range, blocks=r.blocks)
            if method == "best":
                row["best_chose"] = r.chosen
        rows.append(row)
    receipt = {"study": "conversion", "mx_encoder": mx_mode, "seed": seed, "methods": METHODS, "rows": rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "receipt.json").write_text(json.dumps(receipt, indent=1))
    (out / "table.md").write_text(report(receipt))
    return receipt


def report(receipt: dict) -> str:
    """A receipt -> the markdown table: MSE per method, the winner(s), win/tie counts."""
    methods = receipt["methods"]
    lines = [f"# MXFP4 -> NVFP4 conversion, {len(receipt['rows'])} scenarios "
             f"(MXFP4 encoder: {receipt['mx_encoder']}, seed {receipt['seed']})", "",
             "| scenario | spread | m | out of range | " + " | ".join(methods) + " | best chose | winner(s) |",
             "|---|---|---|---|" + "---|" * len(methods) + "---|---|"]
    wins = {m: 0 for m in methods}
    ties = {m: 0 for m in methods}
    for r in receipt["rows"]:
        scored = {m: r["mse"][m] for m in methods if m != "best"}
        low = min(scored.values())
        winners = [m for m, v in scored.items() if v == low]
        for m in winners:
            (wins if len(winners) == 1 else ties)[m] += 1
        cells = " | ".join(f"{r['mse'][m]:.3g}" for m in methods)
        lines.append(f"| {r['scenario']} | {r['spread']} | {r['m']} | {r['blocks_out_of_range']}/{r['blocks']} | "
                     f"{cells} | {r['best_chose']} | {', '.join(winners)} |")
    lines += ["", "Among the four published methods (best excluded): sole wins / ties for the lowest MSE.", "",
              "| method | wins | ties |", "|---|---|---|"]
    lines += [f"| {m} | {wins[m]} | {ties[m]} |" for m in methods if m != "best"]
    lossless = sum(r["mse"]["hybrid"] == 0 for r in receipt["rows"])
    never_worse = all(r["mse"]["best"] <= r["mse"]["requant"] for r in receipt["rows"])
    lines += ["", f"hybrid is lossless (MSE 0) on {lossless}/{len(receipt['rows'])} scenarios; "
              f"best <= requant on every scenario: {never_worse}.", ""]
    return "\n".join(lines)
