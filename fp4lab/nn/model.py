"""A small GPT (pre-norm RMSNorm, RoPE, SwiGLU, SDPA attention) and its Mixture-of-Experts variant.

    x = wte(idx) * embed_gain                         [B, T, D]
    for each block:  x = x + attn(rms(x));  x = x + ffn(rms(x))     ffn: SwiGLU or moe.MoE
    logits = lm_head(rms(x)) * logits_gain            [B, T, V]

Every GEMM is an nn.Linear (or moe.GroupedExperts), so nn.swap.quantize_model can put each
under a recipe; attention's softmax and the norms stay in high precision. The gains are 1 unless
the recipe sets them (Recipe.embed_gain / logits_gain; the MoE speedrun's NVFP4 runs used
embedding 10.667 / logits 0.125). They are a training change, not a quantization change: under
AdamW an embedding gain g acts as a g-times larger embedding learning rate and initial scale,
on any recipe. A comparison of an FP4 arm with gains against BF16 gives the BF16 arm the same
gains (a BF16 recipe may set them), or it measures the gains along with the format.
Norms have no weights (as modded-nanogpt); linears start N(0, 0.02), residual-output
projections scaled by 1/sqrt(2 * depth). Model size has one knob, the depth (nanochat): see
``gpt_config``; named presets in ``MODEL_PRESETS``.

Public: ``ModelConfig``, ``gpt_config``, ``MODEL_PRESETS``, ``model_config``, ``GPT``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoE, MoEConfig, SwiGLU


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 50304
    depth: int = 12
    """Transformer blocks."""
    dim: int = 768
    """D, the residual width (a multiple of 32 for FP4 blocks)."""
    n_heads: int = 6
    mlp_hidden: int = 2048
    """SwiGLU hidden size of the dense feed-forward."""
    seq_len: int = 1024
    """Longest sequence (RoPE table length)."""
    rope_base: float = 10000.0
    moe: MoEConfig | None = None
    """Set to make the feed-forward of blocks >= dense_first a Mixture of Experts."""
    dense_first: int = 1
    """MoE models: the first N blocks keep a dense feed-forward (DeepSeek-V3 style)."""
    qk_norm: bool = False
    """RMS-normalise each head's queries and keys before RoPE (parameter-free): bounds the attention
    logits, which lets training tolerate larger steps and makes seeds agree more closely."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.n_heads} heads of even size")
        for name in ("dim", "mlp_hidden"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} must be a multiple of 32 (FP4 blocks), got {getattr(self, name)}")
        if self.depth < 1 or self.vocab_size < 1 or self.seq_len < 1:
            raise ValueError(f"depth, vocab_size and seq_len must be positive: {self}")

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown model config key(s) {sorted(unknown)}")
        return cls(**data)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value.value if hasattr(value, "value") else value


def gpt_config(depth: int, *, vocab_size: int = 50304, seq_len: int = 1024,
               moe: MoEConfig | None = None) -> ModelConfig:
    """Depth-driven sizing: D = 64 * depth, 128-dim heads (64 below D = 256), SwiGLU hidden
    = 8/3 D rounded up to 64 (the parameter count of a 4 D GELU MLP)."""
    dim = 64 * depth
    head = 64 if dim < 256 else 128
    hidden = -(-8 * dim // 3 // 64) * 64
    return ModelConfig(vocab_size=vocab_size, depth=depth, dim=dim, n_heads=max(1, dim // head),
                       mlp_hidden=hidden, seq_len=seq_len, moe=moe)


MODEL_PRESETS = {
    # CPU tests and the CPU demo
    "tiny": lambda **kw: gpt_config(2, **{"seq_len": 128, **kw}),
    "moe-tiny": lambda **kw: gpt_config(2, **{"seq_len": 128, **kw},
                                        moe=MoEConfig(n_experts=8, top_k=2, n_shared=1, expert_hidden=64)),
    # GPU sizes: ~30M, ~125M and ~300M parameters with a GPT-2 vocabulary
    "d6": lambda **kw: gpt_config(6, **kw),
    "d12": lambda **kw: gpt_config(12, **kw),
    "d16": lambda **kw: gpt_config(16, **kw),
    # after the NVFP4 MoE speedrun's small MoE: 64 fine-grained experts, top-6, 2 shared
    "moe64": lambda **kw: gpt_config(8, **kw, moe=MoEConfig(n_experts=64, top_k=6, n_shared=2,
                                                            expert_hidden=256)),
}


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name, with field overrides (vocab_size and seq_len size it; others replace)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(MODEL_PRESETS)}")
    sizing = {k: overrides.pop(k) for k in ("vocab_size", "seq_len") if k in overrides}
    return dataclasses.replace(MODEL_PRESETS[name](**sizing), **overrides)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, hd]; rotate pairs (first half, second half) by position-dependent angles
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.qk_norm = cfg.n_heads, cfg.qk_norm
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if self.qk_norm:
            q, k = _rms(q), _rms(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.attn = Attention(cfg)
        use_moe = cfg.moe is not None and index >= cfg.dense_first
        self.ffn = MoE(cfg.dim, cfg.moe) if use_moe else SwiGLU(cfg.dim, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(_rms(x), cos, sin)
        return x + self.ffn(_rms(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.depth))
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.embed_gain, self.logits_gain = 1.0, 1.0
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = cfg.rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.depth)
        for name, p in self.named_parameters():
            out_proj = name.endswith(("attn.proj.weight", "down.weight", "w_down"))
            p.normal_(0.0, residual_std if out_proj else 0.02, generator=generator)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def num_params(self, active: bool = False) -> int:
        """Parameter count; ``active`` counts only the K of E routed experts a token uses."""
        total = sum(p.numel() for p in self.parameters())
        if active:
            for moe in self.moe_layers():
                per_expert = sum(p.numel() // p.shape[0] for p in moe.experts.parameters())  # [E, ...]
                total -= per_expert * (moe.cfg.n_experts - moe.cfg.top_k)
        return total

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: [B, T] int64 -> logits [B, T, V] float32, or the mean cross-entropy loss (plus
        any MoE auxiliary loss) when ``targets`` [B, T] is given (-1 targets are ignored)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.wte(idx)
        if self.embed_gain != 1.0:
            x = x * self.embed_gain
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(_rms(x)).float()
        if self.logits_gain != 1.0:
            logits = logits * self.logits_gain
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
        for moe in self.moe_layers():
            if moe.aux_loss is not None:
                loss = loss + moe.aux_loss
        return loss
