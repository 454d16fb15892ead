"""diff_quantizers: where two FP4 quantizers disagree on the same input, and which rule explains it.

Both quantizers map x to an FP4Tensor (e.g. fp4lab's te and torchao profiles, or a user's
kernel against formats.quantize_nvfp4). The diff counts differing code bytes, element codes,
scale bytes and the tensor scale, then explains each differing block by inspecting the data
(x, both scales, both codes), first rule that fits:

    nonfinite         the block holds NaN or Inf: each side's NaN/Inf policy
    scale_floor       one scale is 2^-6 (byte 0x08), the other below: torchao's 2^-6 floor vs
                      te's unclamped scale, which flushes a tiny or all-zero block
    scale_tie         scales one E4M3 step apart and the exact block scale amax_b / (6 S_dec)
                      (fp64) lies within 2^-20 of the midpoint of the two: a tie in E4M3 rounding
    tensor_scale      the tensor scales differ and nothing closer explains the block
    scale_step        one step apart, off a tie: the scale arithmetic differs (fp32 order)
    scale_rule        more than one step apart: a different scale formula
    mx_exponent       (MXFP4) the UE8M0 exponents differ: a different exponent mode; the
                      example lists which of floor / ceil / even / rceil reproduce each side
    flushed_codes     equal scales of 0: codes differ but both decode to 0
    zero_sign         equal scales, codes differ only as +0 / -0
    element_tie       equal scales; every differing element's |x| / (s_b S_dec) (fp64) lies
                      within 2^-20 of an E2M1 midpoint (0.25, 0.75, ..., 5): a rounding tie
    element_rounding  equal scales, off a tie: another rounding (stochastic) or element scale

Examples of the first differing blocks carry the block index, the inputs, both codes, both
scales, the rule, a sentence with the numbers, and which named scale rules (NVFP4 profiles te /
torchao, MX modes) reproduce each side's scale byte from x.

Public: ``diff_quantizers``, ``QuantizerDiff``, ``RULES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..formats import Format, FP4Tensor, MXScaleMode, NVFP4Profile, decode_e2m1, unpack_nibbles, with_scale_layout
from ..formats.blocks import block_amax, blocks_of, finite_amax, prepare
from ..formats.dequantize import block_scales
from ..formats.mxfp4 import mx_exponent
from ..formats.nvfp4 import nvfp4_block_scales, nvfp4_tensor_terms

RULES = {
    "nonfinite": "NaN/Inf handling: the block holds a non-finite input",
    "scale_floor": "scale floor 2^-6 (torchao) vs flush (te) on a tiny or all-zero block",
    "scale_tie": "block scale differs by one E4M3 step: tie in E4M3 rounding of the scale",
    "tensor_scale": "tensor scale differs; the block follows it",
    "scale_step": "block scale differs by one step off a tie: different fp32 scale arithmetic",
    "scale_rule": "block scale differs by more than one step: a different scale formula",
    "mx_exponent": "UE8M0 exponent differs: a different exponent mode",
    "flushed_codes": "codes differ in a block whose scale is 0 on both sides (both decode to 0)",
    "zero_sign": "element code differs only in the sign of zero",
    "element_tie": "element code differs with equal scales: E2M1 rounding tie",
    "element_rounding": "element code differs with equal scales, off a tie: different rounding or element scale",
}
TIE = 2.0**-20
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True, kw_only=True)
class QuantizerDiff:
    names: tuple[str, str]
    format: str
    code_bytes: int
    """Packed code bytes that differ (of ``total_bytes``)."""
    elements: int
    """Element codes that differ."""
    scale_bytes: int
    """Block scale bytes that differ (of ``total_blocks``)."""
    tensor_scale: tuple[float, float] | None
    """Both tensor scales when they differ, else None."""
    blocks: int
    """Blocks with any difference."""
    total_bytes: int
    total_blocks: int
    rules: dict[str, int] = field(default_factory=dict)
    """Rule -> number of differing blocks it explains (the first ``max_classified``)."""
    examples: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No difference at all."""
        return not (self.code_bytes or self.scale_bytes or self.tensor_scale)

    def __str__(self) -> str:
        a, b = self.names
        lines = [f"diff_quantizers {a} vs {b} ({self.format}): " + ("identical" if self.ok else "differ"),
                 f"  code bytes {self.code_bytes} / {self.total_bytes}, element codes {self.elements}, "
                 f"scale bytes {self.scale_bytes} / {self.total_blocks}, blocks {self.blocks}"]
        if self.tensor_scale:
            lines.append(f"  tensor scale: {a} {self.tensor_scale[0]!r}, {b} {self.tensor_scale[1]!r}")
        for rule, count in sorted(self.rules.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count:6d} blocks  {rule}: {RULES[rule]}")
        for ex in self.examples:
            lines.append(f"  block {ex['block']} [{ex['rule']}] {ex['note']}")
            lines.append(f"    x {ex['inputs']}")
            lines.append(f"    {a}: scale {ex['scale_a']} codes {ex['codes_a']}  ({', '.join(ex['matches_a']) or '-'})")
            lines.append(f"    {b}: scale {ex['scale_b']} codes {ex['codes_b']}  ({', '.join(ex['matches_b']) or '-'})")
        return "\n".join(lines)


def _flat(q: FP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q -> (codes [R, nb, bl] uint8, scale bytes [R, nb] uint8, scale values [R, nb] float64)."""
    q = with_scale_layout(q, "plain")
    rows, nb = q.lead_shape.numel(), q.padded_len // q.block_len
    codes = unpack_nibbles(q.codes.reshape(rows, -1).cpu()).reshape(rows, nb, q.block_len)
    return codes, q.scales.reshape(rows, nb).cpu().view(torch.uint8), block_scales(q).reshape(rows, nb).cpu().double()


def _named_scales(xb: torch.Tensor, tile_rows: int, fmt: Format) -> dict[str, torch.Tensor]:
    """Scale bytes each named rule gives x's blocks: NVFP4 profiles, or MX exponent modes."""
    b_amax, _ = block_amax(xb, tile_rows)
    if fmt is Format.MXFP4:
        return {m.value: mx_exponent(b_amax, m).to(torch.int64) + 127 for m in MXScaleMode}
    out = {}
    for profile in NVFP4Profile:
        s_dec, mult = nvfp4_tensor_terms(finite_amax(xb), profile)
        scales = nvfp4_block_scales(b_amax, s_dec, mult, profile, xb=xb, tile_rows=tile_rows)[0]
        out[profile.value] = scales.view(torch.uint8).to(torch.int64)
    return out


def diff_quantizers(a: Callable[[torch.Tensor], FP4Tensor], b: Callable[[torch.Tensor], FP4Tensor],
                    x: torch.Tensor, *, names: tuple[str, str] = ("a", "b"), max_examples: int = 5,
                    max_classified: int = 20000) -> QuantizerDiff:
    """Quantize x: [...] float with both callables and explain where their FP4Tensors differ."""
    qa, qb = a(x), b(x)
    for name, q in zip(names, (qa, qb)):
        if not isinstance(q, FP4Tensor):
            raise TypeError(f"quantizer {name} must return an FP4Tensor, got {type(q).__name__}")
    layout_a, layout_b = ((q.format, tuple(q.shape), q.axis, q.block, tuple(q.codes.shape)) for q in (qa, qb))
    if layout_a != layout_b:
        raise ValueError(f"cannot compare: {names[0]} gives (format, shape, axis, block, codes) {layout_a}, "
                         f"{names[1]} gives {layout_b}")
    codes_a, bytes_a, s_a = _flat(qa)
    codes_b, bytes_b, s_b = _flat(qb)
    xm, _ = prepare(x.cpu(), qa.axis, qa.block, pad=True)
    xb = blocks_of(xm.reshape(codes_a.shape[0], -1), qa.block_len)  # [R, nb, bl] float32
    ts = [None if q.tensor_scale is None else float(q.tensor_scale) for q in (qa, qb)]
    code_diff = codes_a != codes_b
    scale_diff = bytes_a != bytes_b
    block_diff = code_diff.any(-1) | scale_diff
    ctx = _Context(names, qa.format, ts, float(finite_amax(xb)), _named_scales(xb, qa.block[0], qa.format),
                   block_amax(xb, qa.block[0])[0])
    rules: dict[str, int] = {}
    examples = []
    finite = torch.isfinite(xb).all(-1)
    for r, j in block_diff.nonzero()[:max_classified].tolist():
        rule, note = ctx.explain(xb[r, j], bool(finite[r, j]), codes_a[r, j], codes_b[r, j], int(bytes_a[r, j]),
                                 int(bytes_b[r, j]), float(s_a[r, j]), float(s_b[r, j]), float(ctx.amax[r, j]))
        rules[rule] = rules.get(rule, 0) + 1
        if len(examples) < max_examples:
            examples.append(ctx.example((r, j), qa, xb[r, j], codes_a[r, j], codes_b[r, j],
                                        int(bytes_a[r, j]), int(bytes_b[r, j]), rule, note))
    return QuantizerDiff(names=tuple(names), format=qa.format.value,
                         code_bytes=int((qa.codes != qb.codes).sum()), elements=int(code_diff.sum()),
                         scale_bytes=int(scale_diff.sum()), tensor_scale=None if ts[0] == ts[1] else tuple(ts),
                         blocks=int(block_diff.sum()), total_bytes=qa.codes.numel(), total_blocks=bytes_a.numel(),
                         rules=rules, examples=examples)


@dataclass
class _Context:
    names: tuple[str, str]
    fmt: Format
    ts: list[float | None]
    amax_x: float  # max |x| over finite values
    named: dict[str, torch.Tensor]
    amax: torch.Tensor  # [R, nb] block (or tile) amax over finite values

    def explain(self, x, finite, ca, cb, ba, bb, sa, sb, amax) -> tuple[str, str]:
        if not finite or sa != sa or sb != sb:  # a non-finite input, or a NaN scale on either side
            return "nonfinite", (f"input holds {int((~torch.isfinite(x)).sum())} non-finite value(s); "
                                 f"scale bytes {ba:#04x} vs {bb:#04x}")
        tensor_differs = self.ts[0] != self.ts[1]
        if ba != bb:
            return self._scale_rule(ba, bb, sa, sb, amax, tensor_differs)
        if sa == 0:
            return "flushed_codes", "scale 0 on both sides: every code decodes to 0"
        differ = (ca != cb).nonzero().flatten().tolist()
        va, vb = decode_e2m1(ca[differ]), decode_e2m1(cb[differ])
        if bool((va == vb).all()):
            return "zero_sign", f"elements {differ}: +0 vs -0"
        s_dec = self.ts[0] if self.ts[0] is not None else 1.0
        ratios = [abs(float(x[e])) / (sa * s_dec) for e in differ]
        near = [min(E2M1_MIDPOINTS, key=lambda mid: abs(v - mid)) for v in ratios]
        if all(abs(v - mid) <= TIE * mid for v, mid in zip(ratios, near)):
            return "element_tie", f"|x| / scale = {ratios[0]!r} at element {differ[0]}: the midpoint {near[0]}"
        if tensor_differs:
            return "tensor_scale", f"tensor scales {self.ts[0]!r} vs {self.ts[1]!r}"
        return "element_rounding", f"|x| / scale = {ratios[0]!r} at element {differ[0]}, nearest midpoint {near[0]}"

    def _scale_rule(self, ba, bb, sa, sb, amax, tensor_differs) -> tuple[str, str]:
        if self.fmt is Format.MXFP4:
            return "mx_exponent", f"exponents {ba - 127} vs {bb - 127} for block amax {amax!r}"
        lo, hi = sorted((sa, sb))
        if hi == 2.0**-6 and lo < hi:
            floor, other = self.names if sa == hi else self.names[::-1]
            return "scale_floor", f"block amax {amax!r}: {floor} floors the scale at 2^-6, {other} gives {lo!r}"
        if abs(ba - bb) == 1:
            mid = (sa + sb) / 2
            # the exact scale from x's amax (2688 = 448 * 6), and from each side's own S_dec
            exact = [amax * 2688 / (6 * self.amax_x)] * (self.amax_x > 0) + [amax / (6 * t) for t in self.ts if t]
            ties = [q for q in exact if abs(q - mid) <= TIE * mid]
            if ties:
                up = self.names[0] if sa > sb else self.names[1]
                return "scale_tie", (f"exact block scale {ties[0]!r} is the midpoint of {lo!r} and {hi!r}; "
                                     f"{up} rounds up")
            if tensor_differs:
                return "tensor_scale", f"tensor scales {self.ts[0]!r} vs {self.ts[1]!r}"
            return "scale_step", f"exact block scale {exact[0] if exact else float('nan')!r}, midpoint {mid!r}"
        if tensor_differs:
            return "tensor_scale", f"tensor scales {self.ts[0]!r} vs {self.ts[1]!r}"
        return "scale_rule", f"scale bytes {ba:#04x} vs {bb:#04x} ({abs(ba - bb)} steps)"

    def example(self, rj, q, x, ca, cb, ba, bb, rule, note) -> dict:
        r, j = rj
        lead = list(torch.unravel_index(torch.tensor(r), q.lead_shape)) if len(q.lead_shape) else []
        matches = [[name for name, s in self.named.items() if int(s[r, j]) == byte] for byte in (ba, bb)]
        return dict(block=(*[int(i) for i in lead], j), rule=rule, note=note,
                    inputs=[float(f"{v:.6g}") for v in x.tolist()], codes_a=ca.tolist(), codes_b=cb.tolist(),
                    scale_a=f"{ba:#04x}", scale_b=f"{bb:#04x}", matches_a=matches[0], matches_b=matches[1])
