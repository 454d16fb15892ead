"""One MoE projection's FP4 GEMMs for all experts at once (the Triton backend).

moe.GroupedExperts runs each expert's rows through nn.linear.fp4_linear: three GEMMs per expert,
each with that expert's seeds and tensor scales. ``grouped_fp4_linear`` makes exactly the same
operands (the same per-expert ``_Call``, so the same bytes) but multiplies all experts in one
kernels.matmul.grouped_scaled_mm launch for fprop and one for dgrad (variable rows per expert);
wgrad stays one GEMM per expert, since its contraction runs over the expert's own rows. Experts
that received no rows are skipped, as in the loop (their weight gradient is zero).

``grouped_applies`` says when it runs: on the Triton backend, with no operand statistics being
collected, when the recipe in force gives every GEMM two FP4 operands (they arrive as
BlockValues); otherwise GroupedExperts keeps its per-expert loop.

Public: ``grouped_applies``, ``grouped_fp4_linear``.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.matmul import grouped_scaled_mm
from ..kernels.operand import alpha as operand_alpha
from .linear import QuantContext, _call, _Call, _pad_rows, compute_dtype
from .quant import dither, run_gemm
from .recipe import GEMMS, Recipe


def grouped_applies(recipe: Recipe, x: torch.Tensor, context: QuantContext) -> bool:
    """Whether grouped_fp4_linear runs this projection (see the module doc)."""
    now = recipe.at_progress(context.progress)
    both = all(now.gemm(g).a.quantized and now.gemm(g).b.quantized for g in GEMMS)
    return both and not context.collect and kernels.uses_triton(x)


def _grouped(a: list, b: list, sizes: list[int], shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Rows of group g: A_g @ B_g^T, from BlockValues pairs along the same K, in one launch ->
    ``shape`` in like's dtype (fp16 via an fp32 result, as run_gemm does; zeros when no group has rows)."""
    if not a:
        return like.new_zeros(shape)
    a_all = torch.cat([v.matrix for v in a])
    b_all = torch.stack([v.matrix for v in b])
    alpha = torch.stack([operand_alpha(va, vb) for va, vb in zip(a, b)])
    out_dtype = torch.float32 if like.dtype == torch.float16 else like.dtype
    return grouped_scaled_mm(a_all, b_all, sizes, alpha, out_dtype=out_dtype).to(like.dtype)


class _GroupedFP4Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: list[int], calls: list[_Call]):
        # x: [S, K] rows sorted by expert, weight: [E, N, K], counts: E row counts -> y: [S, N]
        live = [e for e, c in enumerate(counts) if c]
        xs = dict(zip(live, x.split([counts[e] for e in live])))
        w_src = {}
        for e in live:
            spec = calls[e].recipe.fprop.b
            w_src[e] = dither(weight[e], spec, calls[e].seed("fprop", "d")) if spec.dither else weight[e]
        w_fprop = {e: calls[e].operand(w_src[e], 1, "fprop", "b") for e in live}
        y = _grouped([calls[e].operand(xs[e], 1, "fprop", "a") for e in live], [w_fprop[e] for e in live],
                     [counts[e] for e in live], (x.shape[0], weight.shape[1]), x)
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.calls, ctx.live, ctx.w_src = counts, calls, live, w_src
        reuse = live and calls[live[0]].dgrad_reuses_fprop_weight() and ctx.needs_input_grad[0]
        ctx.w_fprop = w_fprop if reuse else None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        calls, live, counts = ctx.calls, ctx.live, ctx.counts
        sizes = [counts[e] for e in live]
        xs, dys = dict(zip(live, x.split(sizes))), dict(zip(live, dy.split(sizes)))
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dgrad: dx = dy @ W per expert, one launch
            k = weight.shape[2]
            w_ops = [ctx.w_fprop[e].transposed(k) if ctx.w_fprop is not None
                     else calls[e].operand(ctx.w_src[e], 0, "dgrad", "b") for e in live]
            dx = _grouped([calls[e].operand(dys[e], 1, "dgrad", "a") for e in live], w_ops, sizes, tuple(x.shape), dy)
        if ctx.needs_input_grad[1]:  # wgrad: dW_e = dy_e^T @ x_e, contraction over the expert's rows
            dw = torch.zeros_like(weight)
            for e in live:
                dy_m, x_m = _pad_rows(dys[e]), _pad_rows(xs[e])
                dw[e] = run_gemm(calls[e].operand(dy_m, 0, "wgrad", "a"), 0, calls[e].operand(x_m, 0, "wgrad", "b"), 0,
                                 dy.dtype)
        return dx, dw, None, None


def grouped_fp4_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], recipe: Recipe, *,
                       name: str, context: QuantContext, label: str = "") -> torch.Tensor:
    """x: [S, K] rows sorted by expert (counts[e] each), weight: [E, N, K] -> [S, N]: expert e's
    rows times weight[e]^T under ``recipe``; expert e is the layer f"{name}.{e}.{label}" for its
    seeds, as in fp4_linear(x_e, weight[e], name=f"{name}.{e}.{label}")."""
    dtype = compute_dtype(x)
    calls = [_call(recipe, f"{name}.{e}.{label}" if label else f"{name}.{e}", context) for e in range(weight.shape[0])]
    with torch.autocast(x.device.type, enabled=False):
        return _GroupedFP4Fn.apply(x.to(dtype), weight.to(dtype), list(counts), calls)
