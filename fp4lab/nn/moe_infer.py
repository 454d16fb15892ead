"""NVFP4 inference (forward only) for a trained fp4lab MoE layer (nn.moe.MoE), weights converted once.

Shape legend: T tokens, D model dim, F expert hidden dim, E routed experts, K experts per token,
S = T * K routed slots, n rows of one expert.

    route     choice_TK, weight_TK exactly as MoE.forward: the router runs in the layer's
              precision, the balancing bias steers the top-K choice only, weights renormalised
    stage     q_x = quantize_nvfp4(x_TD): 1x16 blocks along D, one FP32 tensor scale S_x; the
              slots, sorted by expert (stable), gather q_x's rows (codes and scales move, no
              re-quantization)
    L1        h_n2F = C(q_x[rows of e], w13[e])        alpha = S_x * S_w13[e]
    act       a_nF  = silu(h[:, :F]) * h[:, F:]        fp32
    requant   q_a   = quantize_nvfp4(a_nF)             the tensor scale of this expert's rows
    L2        y_nD  = C(q_a, w2[e])                    alpha = S_a * S_w2[e]
    combine   y_TD  = sum_k weight_TK * y[slot(t, k)]  (un-sorted, summed in k order)
              + the shared experts: L1 / act / requant / L2 on all T rows of q_x

C(A, B) = A @ B^T is an FP4 GEMM with formats.gemm's semantics (``mm``: kernels.fp4_mm by
default, Triton on CUDA and formats.emulated_mm on CPU; formats.scaled_mm works too).
Weights (``quantize_moe_weights``): w13[e] = cat(w_gate[e], w_up[e]) [2F, D] is quantized as one
tensor, so gate and up share a tensor scale (as a fused w13 checkpoint must), and w2[e] =
w_down[e] [D, F]; 1x16 blocks along the contraction axis, te profile, RTNE; one FP32 tensor
scale per expert and matrix. The shared SwiGLU is converted the same way (as one "expert").

``reference_nvfp4_moe_forward`` is an independent, deliberately plain version of the same math:
its own routing and weight quantization, a loop over experts, dequantized operands multiplied
in float64 (exact products), each GEMM output rounded once to fp32. It agrees with the pipeline
to fp32 summation order in each GEMM, not bit for bit: the requantized hidden codes can differ
only where an element sits within that rounding of an E2M1 boundary, and one such flip would
move a token's output by ~1e-2 relative. Measured on the layers below: outputs within 4e-8 ..
3e-7 relative, max abs difference 2e-7 (no flips); the tests bound it by 1e-6.

Expected FP4 error (``compare_moe``, NVFP4 pipeline vs the layer's own FP32 forward), measured
on freshly initialised layers (D = 64..256, F = 64..128, E = 8, K = 2, one shared expert, sigmoid
and softmax routers, 3 seeds each) with x ~ N(0, 1), 256 tokens: relative error 0.244 .. 0.255,
cosine 0.970 .. 0.972, worst token cosine ~0.88. Where it comes from (measured the same way):
NVFP4 stores Gaussian data with ~0.095 relative error per operand (E2M1 has one mantissa bit),
so a GEMM of two quantized operands is off by ~0.135; silu(gate) * up multiplies two such
outputs (~0.19); requantizing it and the down projection's weight add two more ~0.095 terms:
sqrt(0.19^2 + 2 * 0.095^2) ~ 0.24. On an H100 (kernels.fp4_mm's Triton path; D = 256, F = 128,
512 tokens): relative error 0.245, cosine 0.9715, pipeline vs reference 2.9e-8.
tests/nn/test_moe_infer.py asserts 0.15 < rel < 0.3 and
cosine > 0.96 (the lower bound proves the operands really were quantized).

Public: ``NVFP4Experts``, ``NVFP4MoEWeights``, ``quantize_moe_weights``, ``route``, ``Dispatch``,
``stage_tokens``, ``expert_ffn``, ``nvfp4_moe_forward``, ``reference_nvfp4_moe_forward``,
``compare_moe``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..formats import FP4Tensor, block_values, quantize_nvfp4
from .moe import MoE, RouterKind

GemmOp = Callable[[FP4Tensor, FP4Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class NVFP4Experts:
    """E matrices [out, in] in NVFP4 along ``in``: codes [E, out, in/2] uint8, scales
    [E, out, in/16] float8_e4m3fn, tensor_scale [E] float32 (S_dec per expert)."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor

    @classmethod
    def from_weights(cls, w_Eoi: torch.Tensor) -> "NVFP4Experts":
        qs = [quantize_nvfp4(w.detach().float()) for w in w_Eoi]
        return cls(codes=torch.stack([q.codes for q in qs]), scales=torch.stack([q.scales for q in qs]),
                   tensor_scale=torch.stack([q.tensor_scale for q in qs]))

    def __len__(self) -> int:
        return self.codes.shape[0]

    def __getitem__(self, e: int) -> FP4Tensor:
        out, half = self.codes.shape[1:]
        return FP4Tensor(codes=self.codes[e], scales=self.scales[e], tensor_scale=self.tensor_scale[e],
                         shape=(out, 2 * half), axis=1, block=(1, 16), format="nvfp4", rounding="rtne",
                         profile="te")


@dataclass(frozen=True, kw_only=True)
class NVFP4MoEWeights:
    """A MoE layer's expert weights in NVFP4 (the router stays in the layer)."""

    w13: NVFP4Experts
    """[E, 2F, D]: gate rows 0..F-1, up rows F..2F-1."""
    w2: NVFP4Experts
    """[E, D, F]."""
    shared_w13: NVFP4Experts | None
    """[1, 2 F_s, D] or None without shared experts."""
    shared_w2: NVFP4Experts | None
    """[1, D, F_s]."""


def quantize_moe_weights(moe: MoE) -> NVFP4MoEWeights:
    """moe: a trained nn.moe.MoE -> its expert weights in NVFP4 (converted once, frozen)."""
    if not isinstance(moe, MoE):
        raise TypeError(f"quantize_moe_weights takes an fp4lab.nn.moe.MoE, got {type(moe).__name__}")
    ex = moe.experts
    with torch.no_grad():
        shared = moe.shared
        return NVFP4MoEWeights(
            w13=NVFP4Experts.from_weights(torch.cat([ex.w_gate, ex.w_up], dim=1)),
            w2=NVFP4Experts.from_weights(ex.w_down),
            shared_w13=None if shared is None else
            NVFP4Experts.from_weights(torch.cat([shared.gate.weight, shared.up.weight])[None]),
            shared_w2=None if shared is None else NVFP4Experts.from_weights(shared.down.weight[None]))


def _check(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(moe, MoE):
        raise TypeError(f"expected an fp4lab.nn.moe.MoE, got {type(moe).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    d = moe.router.in_features
    if x.dim() < 1 or x.shape[-1] != d:
        raise ValueError(f"x must be [..., D = {d}], got shape {tuple(x.shape)}")
    if d % 16:
        raise ValueError(f"NVFP4 needs D divisible by 16, got D = {d}")
    return x.reshape(-1, d)


def route(moe: MoE, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_TD -> (choice_TK int64, weight_TK float32): MoE.forward's routing (MoE.route)."""
    _, choice_TK, weight_TK = moe.route(x_TD)
    return choice_TK, weight_TK


@dataclass(frozen=True)
class Dispatch:
    choice_TK: torch.Tensor
    weight_TK: torch.Tensor
    order_S: torch.Tensor
    """Slots (t * K + k) sorted by expert, stable."""
    counts: list[int]
    """Slots per expert, [E]."""
    q_x: FP4Tensor
    """x_TD in NVFP4 (one tensor scale)."""
    q_sorted: FP4Tensor
    """[S, D]: q_x's rows in slot order (token order_S // K)."""


def _rows(q: FP4Tensor, index: torch.Tensor) -> FP4Tensor:
    """The rows ``index`` of a plain 2D FP4Tensor quantized along axis 1 (same tensor scale)."""
    return dataclasses.replace(q, codes=q.codes[index], scales=q.scales[index],
                               shape=torch.Size([index.numel(), q.shape[1]]))


def stage_tokens(moe: MoE, x_TD: torch.Tensor) -> Dispatch:
    """Route x_TD [T, D], quantize it once, and gather its NVFP4 rows into expert order."""
    choice_TK, weight_TK = route(moe, x_TD)
    order_S, counts_E = moe.sort_slots(choice_TK)
    counts = counts_E.tolist()
    q_x = quantize_nvfp4(x_TD)
    return Dispatch(choice_TK, weight_TK, order_S, counts, q_x, _rows(q_x, order_S // moe.cfg.top_k))


def expert_ffn(q_x: FP4Tensor, w13: FP4Tensor, w2: FP4Tensor, mm: GemmOp) -> tuple[torch.Tensor, FP4Tensor]:
    """q_x [n, D], w13 [2F, D], w2 [D, F] -> (y_nD float32, q_a: the requantized [n, F] hidden)."""
    h_n2F = mm(q_x, w13)  # alpha = S_x * S_w13 inside
    gate_nF, up_nF = h_n2F.chunk(2, dim=-1)
    q_a = quantize_nvfp4(F.silu(gate_nF) * up_nF)
    return mm(q_a, w2), q_a


def nvfp4_moe_forward(moe: MoE, qweights: NVFP4MoEWeights, x: torch.Tensor, *,
                      mm: GemmOp = kernels.fp4_mm) -> torch.Tensor:
    """x: [..., D] -> y: [..., D] in x's dtype, the NVFP4 pipeline above (no autograd)."""
    x_TD = _check(moe, x)
    if len(qweights.w13) != moe.cfg.n_experts:
        raise ValueError(f"qweights hold {len(qweights.w13)} experts, the layer has {moe.cfg.n_experts}")
    with torch.no_grad():
        d = stage_tokens(moe, x_TD)
        y_sorted_SD = x_TD.new_zeros(x_TD.shape[0] * moe.cfg.top_k, x_TD.shape[1], dtype=torch.float32)
        start = 0
        for e, n in enumerate(d.counts):
            if n:
                q_nD = _rows(d.q_sorted, torch.arange(start, start + n, device=x_TD.device))
                y_sorted_SD[start:start + n] = expert_ffn(q_nD, qweights.w13[e], qweights.w2[e], mm)[0]
            start += n
        y_SD = y_sorted_SD[torch.argsort(d.order_S)]
        y_TD = (y_SD.view(-1, moe.cfg.top_k, x_TD.shape[1]) * d.weight_TK[..., None]).sum(1)
        if qweights.shared_w13 is not None:
            y_TD = y_TD + expert_ffn(d.q_x, qweights.shared_w13[0], qweights.shared_w2[0], mm)[0]
    return y_TD.to(x.dtype).reshape(x.shape)


def _exact(q: FP4Tensor) -> torch.Tensor:
    """q [rows, L] -> float64 values code * block scale * tensor scale, exact."""
    return block_values(q).double() * float(q.tensor_scale)


def _reference_ffn(x_nD: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Plain SwiGLU on NVFP4 operands: x_nD float64 (exact NVFP4 values), w13 [2F, D], w2 [D, F] float."""
    h = (x_nD @ _exact(quantize_nvfp4(w13.float())).T).float()  # one rounding to fp32
    f = w13.shape[0] // 2
    a = F.silu(h[:, :f]) * h[:, f:]
    return _exact(quantize_nvfp4(a)) @ _exact(quantize_nvfp4(w2.float())).T


def reference_nvfp4_moe_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same NVFP4 pipeline written plainly (see the module docstring): x [..., D] -> y [..., D]."""
    x_TD = _check(moe, x)
    with torch.no_grad():
        scores = moe.router(x_TD).float()
        scores = scores.sigmoid() if moe.cfg.router is RouterKind.SIGMOID else scores.softmax(-1)
        top = torch.topk(scores + moe.bias, moe.cfg.top_k, dim=-1).indices
        x_exact = _exact(quantize_nvfp4(x_TD))
        y = torch.zeros(x_TD.shape, dtype=torch.float64, device=x_TD.device)
        ex = moe.experts
        for e in range(moe.cfg.n_experts):
            tokens = (top == e).any(-1).nonzero().flatten()  # ascending token order
            if tokens.numel() == 0:
                continue
            w = scores[tokens, e] / scores.gather(-1, top)[tokens].sum(-1).clamp_min(1e-20)
            w13 = torch.cat([ex.w_gate[e], ex.w_up[e]])
            y[tokens] += w.double()[:, None] * _reference_ffn(x_exact[tokens], w13, ex.w_down[e]).float().double()
        if moe.shared is not None:
            sh = moe.shared
            w13 = torch.cat([sh.gate.weight, sh.up.weight])
            y += _reference_ffn(x_exact, w13, sh.down.weight).float().double()
    return y.to(x.dtype).reshape(x.shape)


def compare_moe(moe: MoE, x: torch.Tensor, *, mm: GemmOp = kernels.fp4_mm) -> dict[str, float]:
    """NVFP4 pipeline vs the layer's own forward on x [..., D]: cosine similarity, relative error
    ||y4 - y|| / ||y||, max abs error, and the worst per-token cosine. The layer is left as it was."""
    x_TD = _check(moe, x)
    training = moe.training
    try:
        moe.eval()  # a training forward would count expert loads
        with torch.no_grad():
            y = moe(x_TD).double()
    finally:
        moe.train(training)
    y4 = nvfp4_moe_forward(moe, quantize_moe_weights(moe), x_TD, mm=mm).double()
    err = y4 - y
    return {"cosine": float(F.cosine_similarity(y4.flatten(), y.flatten(), dim=0)),
            "rel_error": float(err.norm() / y.norm()), "max_abs_error": float(err.abs().max()),
            "min_token_cosine": float(F.cosine_similarity(y4, y, dim=-1).min()), "tokens": x_TD.shape[0]}
