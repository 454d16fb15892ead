"""The published FP4 findings fp4lab reruns, as data, and the budgets to run them at.

Sources (figures quoted from them; the verdict functions say how we judge them):
    NVFP4 MoE speedrun   gain isolation and the expert optimizer lane on a small MoE (E=64, K=6,
                         2 shared): embed-only gain -0.18 vs unit, logits-only +0.15, old pair
                         +0.05 at 384 steps; residual gap +0.046 after the fix
    AMD MXFP4 study      MXFP4 on Llama-3.1-8B / C4: quantizing Wgrad is the main cause of the
                         degradation; of SR, random-sign and deterministic Hadamard on Wgrad only
                         the deterministic Hadamard restored stable training
    NVIDIA NVFP4 recipe  arXiv 2509.25149 (12B, 10T tokens): loss within ~1% of FP8; removing any
                         of BF16 layers, RHT on Wgrad, 2D weight blocks, SR on gradients hurt;
                         switching to BF16 late recovers most of the gap; MXFP4 needed 36% more
                         tokens to match NVFP4 (8B, 1T)
    stiction             our question: does the fraction of FP4 weight codes that move per step
                         track the loss gap (RTNE vs dither vs SR on weights)?

Every verdict is a paired-interval decision (studies.study, train.stats): each part of a claim
is a paired gap or contrast over seeds with a predicted sign; the claim is "reproduced" when
every part's 95% interval lies on the predicted side, "contradicted" when any part's lies on
the other, else "not resolved". Claims about divergence or token counts that our budgets cannot
measure say so in the measured text and are judged on the direction they imply.

The embedding/logit gains are a training change, not a quantization change: wherever an FP4
arm carries a gain, the study has a BF16 arm with the same gain as its baseline, and reports
the gap to plain BF16 beside it.

Scales: ``smoke`` (CPU, seconds, run in CI), ``gpu-small`` (one H100, minutes per study),
``gpu-medium`` (one H100, the measurement protocol's budgets: d6 for 100M tokens, d12 for 50M,
on the 100M-token ``code`` corpus, 3 seeds; several runs share the GPU), ``gpu-stable`` (the same
token budgets with QK-norm and twice the batch: the settings whose BF16 seed spread meets the
protocol's 0.3% at d6; the tables are to be rerun at them).

Public: ``SCALES``, ``STUDIES``, ``study``, ``scale``.
"""

from __future__ import annotations

import math

from ..nn.recipe import Recipe
from ..train.receipt import Receipt
from ..train.stats import CONTRADICTED, NOT_RESOLVED, REPRODUCED, Interval, combine, verdict
from .study import Arm, Scale, Study, StudyRuns, Verdict

_SMOKE = dict(data="stdlib", data_max_bytes=300_000, vocab_size=512, steps=10, batch_size=4, seq_len=64,
              lr=3e-3, warmup=2, eval_every=5, eval_batches=2, log_every=5, val_fraction=0.1)
_SMALL = dict(data="code", vocab_size=8192, steps=1000, batch_size=32, seq_len=512, lr=2e-3, warmup=100,
              eval_every=100, eval_batches=16, log_every=25)
# the measurement protocol's budgets (issue 14): d6 100.0M tokens, d12 50.0M tokens, 32k tokens a step
_D6 = dict(data="code", vocab_size=8192, steps=3052, batch_size=64, seq_len=512, lr=2e-3, warmup=200,
           eval_every=250, eval_batches=16, log_every=50, model="d6")
_D12 = dict(data="code", vocab_size=8192, steps=1526, batch_size=32, seq_len=1024, lr=1e-3, warmup=150,
            eval_every=125, eval_batches=16, log_every=50, model="d12")

# the same budgets at the stable-baseline settings (issue 14's sweep, results/baseline-sweep): QK-norm
# at both depths. d6 also takes twice the batch in half the steps (BF16 seed spread 0.23% in the sweep,
# 0.35% in the fidelity rerun; 3 seeds each). d12 keeps 32 x 1024: at 64 x 1024 (half the steps) it
# ended 0.073 nats worse with no smaller spread (results/fidelity-d12-qkb64), at 32 x 1024 0.48%
_D6_STABLE = {**_D6, "steps": 1526, "batch_size": 128, "model_overrides": {"qk_norm": True}}
_D12_STABLE = {**_D12, "model_overrides": {"qk_norm": True}}

SCALES = {s.name: s for s in (
    Scale(name="smoke", dense={**_SMOKE, "model": "tiny"}, moe={**_SMOKE, "model": "moe-tiny"}, seeds=(0,),
          where="CPU (CI)", minutes_per_run={"dense": 0.03, "deep": 0.03, "moe": 0.05}),
    Scale(name="gpu-small", dense={**_SMALL, "model": "d6"}, deep={**_SMALL, "model": "d12", "lr": 1e-3},
          moe={**_SMALL, "model": "moe64", "model_overrides": {"depth": 4}, "steps": 300, "warmup": 30,
               "eval_every": 50},
          seeds=(0, 1, 2), where="one H100", minutes_per_run={"dense": 1.5, "deep": 4.0, "moe": 5.0},
          graph=True),
    Scale(name="gpu-medium", dense=_D6, deep=_D12, moe={**_D6, "model": "moe64", "steps": 1000, "lr": 1e-3},
          # measured: 3 BF16 + 3 NVFP4 d6 runs of 100M tokens, 6 at once, took ~9 minutes on an H200
          seeds=(0, 1, 2), where="one H200, 6 runs at once", minutes_per_run={"dense": 2.0, "deep": 8.0, "moe": 15.0},
          graph=True),
    Scale(name="gpu-stable", dense=_D6_STABLE, deep=_D12_STABLE,
          # d12 and MoE warm up over gpu-medium's tokens (d6 keeps the 200 steps its sweep measured)
          moe={**_D6_STABLE, "model": "moe64", "steps": 500, "lr": 1e-3, "warmup": 100, "eval_every": 125},
          # measured on an H100: eager, one NVFP4 d6 run alone trains its 100M tokens in 2.9 minutes,
          # four sharing the card took 11.7 minutes; six d12 runs (64 x 1024), three at a time, took
          # 25 minutes in all. Graphed (the default here where a run allows it), six NVFP4-family d6 runs
          # took 18 minutes in a campaign (a5f518c): each holds 20-22 GB (autograd saves ~14 GB a
          # step here), so about three run at once, at 197-240k tokens/s: 3 minutes of card time a
          # run (NOTES, eighth session). MoE, measured (twelfth session, H100, git 89dcc0d, graphed,
          # two runs sharing a card): a BF16 run 164 s, an NVFP4 one 205 s: ~1.6 minutes of card time
          seeds=(0, 1, 2), where="one H100, 3 dense or 2 MoE runs at once",
          minutes_per_run={"dense": 3.0, "deep": 4.5, "moe": 1.6}, graph=True),
)}


def _part(label: str, iv: Interval | None, direction: int) -> tuple[str, str]:
    """One part of a claim: 'label +0.0123 [+0.0050, +0.0196] (+0.41% ...): reproduced'."""
    if iv is None:
        return f"{label}: no finite pair", NOT_RESOLVED
    v = verdict(iv, direction)
    return f"{label} {iv.text()}: {v}", v


def _judge(parts: list[tuple[str, str]], note: str = "") -> Verdict:
    return "; ".join(p for p, _ in parts) + note, combine([v for _, v in parts])


def _diverged(runs: StudyRuns) -> str:
    gone = runs.diverged()
    return f"; diverged (left out of the pairs): {', '.join(gone)}" if gone else ""


# ---- gains -----------------------------------------------------------------------------------

_NV = "nvfp4"
_GAINS = {"unit": {}, "embed": {"embed_gain": 10.667}, "logits": {"logits_gain": 0.125},
          "old_pair": {"embed_gain": 10.667, "logits_gain": 0.125}}


def _gains(runs: StudyRuns) -> Verdict:
    if not runs.has(*_GAINS):
        return runs.missing(*_GAINS)
    parts = [_part("embed - unit", runs.gap("embed", "unit"), -1),
             _part("logits - unit", runs.gap("logits", "unit"), +1),
             _part("logits - embed", runs.gap("logits", "embed"), +1),
             _part("logits - old_pair", runs.gap("logits", "old_pair"), +1)]
    note = ""
    if runs.has("bf16", "bf16_embed"):  # is the embedding gain's effect NVFP4's, or training's?
        iv = runs.contrast({"embed": 1, "unit": -1, "bf16_embed": -1, "bf16": 1})
        reading = {REPRODUCED: "the gain helps NVFP4 less than BF16", CONTRADICTED: "the gain helps NVFP4 more",
                   NOT_RESOLVED: "no difference resolved: a training change as much as an NVFP4 fix"}
        note = (f"; the embed gain's effect on NVFP4 minus its effect on BF16 {iv.text() if iv else 'n/a'}"
                + (f" ({reading[verdict(iv, +1)]})" if iv else ""))
    return _judge(parts, note + _diverged(runs))


GAINS = Study(
    name="gains", title="embedding and logit gains, isolated, on NVFP4 and on BF16", size="moe",
    claim="embed-only gain best (-0.18 vs unit), logits-only worst (+0.15), old pair +0.05 at 384 steps",
    source="NVFP4 MoE speedrun",
    arms=(*(Arm(name=name, recipe=_NV, recipe_overrides=o, baseline=f"bf16_{name}" if o else "bf16")
            for name, o in _GAINS.items()),
          Arm(name="bf16"),
          *(Arm(name=f"bf16_{name}", recipe="bf16", recipe_overrides=o, baseline="bf16")
            for name, o in _GAINS.items() if o)),
    comparisons=tuple((name, "unit") for name in _GAINS if name != "unit")
    + tuple((name, "bf16") for name in _GAINS if name != "unit"),
    effects={"embed - unit": -0.18, "logits - unit": +0.15, "old_pair - unit": +0.05}, verdict=_gains)


# ---- expert lane -----------------------------------------------------------------------------

_EMBED = {"embed_gain": 10.667}
_LANES = ("adamw", "muon")


def _expert_lane(runs: StudyRuns) -> Verdict:
    need = [f"{p}_{lane}" for lane in _LANES for p in ("nvfp4", "bf16", "bf16_embed")]
    if not runs.has(*need):
        return runs.missing(*need)
    gaps = {lane: runs.gap(f"nvfp4_{lane}", f"bf16_embed_{lane}") for lane in _LANES}
    best = min(_LANES, key=lambda lane: gaps[lane].mean if gaps[lane] else float("inf"))
    plain = runs.gap(f"nvfp4_{best}", f"bf16_{best}")
    part = _part(f"NVFP4 - BF16 with the same gain, experts on {best} (the better lane)", gaps[best], +1)
    other = [lane for lane in _LANES if lane != best][0]
    note = (f"; on {other}: {gaps[other].text() if gaps[other] else 'n/a'}; "
            f"gap to plain BF16 (no gain) on {best}: {plain.text() if plain else 'n/a'}")
    return _judge([part], note + _diverged(runs))


EXPERT_LANE = Study(
    name="expert-lane", title="the expert optimizer lane (AdamW vs Muon), NVFP4 vs BF16 with the same gain",
    size="moe",
    claim="with the best gains and the expert lane fixed, NVFP4 trails BF16 by +0.046 valid loss",
    source="NVFP4 MoE speedrun",
    arms=(*(Arm(name=f"nvfp4_{lane}", recipe=_NV, recipe_overrides=_EMBED, train={"expert_opt": lane},
                baseline=f"bf16_embed_{lane}") for lane in _LANES),
          Arm(name="bf16_adamw", recipe="bf16", train={"expert_opt": "adamw"}),
          Arm(name="bf16_muon", recipe="bf16", train={"expert_opt": "muon"}, baseline="bf16_adamw"),
          *(Arm(name=f"bf16_embed_{lane}", recipe="bf16", recipe_overrides=_EMBED, train={"expert_opt": lane},
                baseline=f"bf16_{lane}") for lane in _LANES)),
    comparisons=(("nvfp4_adamw", "bf16_adamw"), ("nvfp4_muon", "bf16_muon"), ("nvfp4_muon", "nvfp4_adamw")),
    effects={f"nvfp4_{lane} - bf16_embed_{lane}": 0.046 for lane in _LANES},
    train={"dense_opt": "muon"}, verdict=_expert_lane)


# ---- GEMM progression ------------------------------------------------------------------------

def _nvfp4_gemms(*gemms: str) -> dict:
    return {f"{g}.{side}.format": "nvfp4" for g in gemms for side in ("a", "b")}


def _increments(runs: StudyRuns, names: tuple[str, str, str]) -> list[tuple[str, str]]:
    """Wgrad's increment against Fprop's and Dgrad's, as paired contrasts (claim: both > 0)."""
    f, fd, fdw = names
    return [_part(f"{fdw}: (+wgrad) - (+fprop)", runs.contrast({fdw: 1, fd: -1, f: -1, "bf16": 1}), +1),
            _part(f"{fdw}: (+wgrad) - (+dgrad)", runs.contrast({fdw: 1, fd: -2, f: 1}), +1)]


_MX_STEPS = ("fprop", "fprop_dgrad", "fprop_dgrad_wgrad")
_NV_STEPS = ("fprop_nv", "fprop_dgrad_nv", "fprop_dgrad_wgrad_nv")


def _progression(runs: StudyRuns) -> Verdict:
    if not runs.has("bf16", *_MX_STEPS):
        return runs.missing("bf16", *_MX_STEPS)
    note = ""
    if runs.has(*_NV_STEPS):
        nv = _increments(runs, _NV_STEPS)
        note = "; NVFP4 (not judged): " + "; ".join(text for text, _ in nv)
    return _judge(_increments(runs, _MX_STEPS), note + _diverged(runs))


GEMM_PROGRESSION = Study(
    name="gemm-progression", title="which GEMM's quantization costs the most (Fprop, +Dgrad, +Wgrad)",
    claim="quantizing Wgrad is the main cause of the MXFP4 degradation", source="AMD MXFP4 study (Llama-3.1-8B, C4)",
    arms=(Arm(name="bf16"), Arm(name="fprop", recipe="fprop"),
          Arm(name="fprop_dgrad", recipe="fprop_dgrad", baseline="fprop"),
          Arm(name="fprop_dgrad_wgrad", recipe="fprop_dgrad_wgrad", baseline="fprop_dgrad"),
          Arm(name="fprop_nv", recipe="fprop", recipe_overrides=_nvfp4_gemms("fprop")),
          Arm(name="fprop_dgrad_nv", recipe="fprop_dgrad", recipe_overrides=_nvfp4_gemms("fprop", "dgrad"),
              baseline="fprop_nv"),
          Arm(name="fprop_dgrad_wgrad_nv", recipe="fprop_dgrad_wgrad",
              recipe_overrides=_nvfp4_gemms("fprop", "dgrad", "wgrad"), baseline="fprop_dgrad_nv")),
    comparisons=(("fprop_dgrad_wgrad", "bf16"), ("fprop_dgrad_wgrad_nv", "bf16")),
    verdict=_progression)


# ---- Wgrad interventions ---------------------------------------------------------------------

def _wgrad(runs: StudyRuns) -> Verdict:
    arms = ("none", "sr", "random_hadamard", "det_hadamard")
    if not runs.has("bf16", *arms):
        return runs.missing("bf16", *arms)
    parts = [_part(f"det_hadamard - {other}", runs.gap("det_hadamard", other), -1)
             for other in ("none", "sr", "random_hadamard")]
    stable = "" if runs.diverged() else "; no arm diverged: the stability half of the claim is out of reach here"
    return _judge(parts, stable + _diverged(runs))


_MXW = "fprop_dgrad_wgrad"
WGRAD_INTERVENTIONS = Study(
    name="wgrad-interventions", title="fixing MXFP4 Wgrad: SR, random-sign or deterministic Hadamard",
    claim="only the deterministic Hadamard on Wgrad restored stable MXFP4 training", source="AMD MXFP4 study",
    arms=(Arm(name="bf16"), Arm(name="none", recipe=_MXW),
          Arm(name="sr", recipe=_MXW, recipe_overrides={"wgrad.a.rounding": "stochastic",
                                                        "wgrad.b.rounding": "stochastic"}),
          Arm(name="random_hadamard", recipe=_MXW, recipe_overrides={"wgrad.hadamard": "random",
                                                                     "wgrad.hadamard_size": 32}),
          Arm(name="det_hadamard", recipe=_MXW, recipe_overrides={"wgrad.hadamard": "deterministic",
                                                                  "wgrad.hadamard_size": 32})),
    comparisons=(("det_hadamard", "none"), ("sr", "none"), ("random_hadamard", "none")),
    verdict=_wgrad)


# ---- NVIDIA ablation -------------------------------------------------------------------------

_ABLATIONS = {
    "no_bf16_layers": {"keep_first": 0, "keep_last": 0},
    "no_rht": {"wgrad.hadamard": "none"},
    "no_2d_weights": {"fprop.b.block2d": False, "dgrad.b.block2d": False},
    "no_sr": {"dgrad.a.rounding": "rtne", "wgrad.a.rounding": "rtne"},
}


def _ablation(runs: StudyRuns) -> Verdict:
    need = ("full", *_ABLATIONS, "bf16_late")
    if not runs.has(*need):
        return runs.missing(*need)
    parts = [_part(f"{a} - full", runs.gap(a, "full"), +1) for a in _ABLATIONS]
    parts.append(_part("bf16_late - full", runs.gap("bf16_late", "full"), -1))
    hurt = sum(v == REPRODUCED for _, v in parts[:-1])
    return _judge(parts, f" ({hurt}/{len(_ABLATIONS)} removals hurt beyond the interval)" + _diverged(runs))


NVIDIA_ABLATION = Study(
    name="nvidia-ablation", title="NVIDIA's NVFP4 recipe, each part removed",
    claim="removing any part (BF16 layers, RHT on Wgrad, 2D weights, SR on gradients) hurt at 12B; "
          "BF16 late in training recovers most of the gap",
    source="arXiv 2509.25149",
    arms=(Arm(name="bf16"), Arm(name="full", recipe=_NV),
          *(Arm(name=name, recipe=_NV, recipe_overrides=o, baseline="full") for name, o in _ABLATIONS.items()),
          Arm(name="bf16_late", recipe=_NV, recipe_overrides={"bf16_after": 0.8}, baseline="full")),
    comparisons=(("full", "bf16"), ("bf16_late", "bf16")),
    verdict=_ablation)


# ---- formats ---------------------------------------------------------------------------------

def _formats(runs: StudyRuns) -> Verdict:
    if not runs.has("nvfp4", "mxfp4"):
        return runs.missing("nvfp4", "mxfp4")
    parts = [_part("mxfp4 - nvfp4", runs.gap("mxfp4", "nvfp4"), +1)]
    if runs.has("mxfp4_rceil"):
        parts.append(_part("mxfp4_rceil - nvfp4", runs.gap("mxfp4_rceil", "nvfp4"), +1))
    note = ("; the +36% token figure needs tokens-to-target runs at several budgets, out of reach here: "
            "judged on the direction it implies (MXFP4 worse than NVFP4 at equal tokens)")
    return _judge(parts, note + _diverged(runs))


FORMATS = Study(
    name="formats", title="BF16 vs NVFP4 (NVIDIA's recipe and plain) vs MXFP4 (floor, rceil)",
    claim="MXFP4 needs 36% more tokens to reach NVFP4's loss (8B, 1T tokens)", source="arXiv 2509.25149",
    arms=(Arm(name="bf16"), Arm(name="nvfp4", recipe="nvfp4"), Arm(name="nvfp4_plain", recipe="nvfp4_plain"),
          Arm(name="mxfp4", recipe="mxfp4"), Arm(name="mxfp4_rceil", recipe="mxfp4_rceil")),
    comparisons=(("mxfp4", "nvfp4"), ("mxfp4", "nvfp4_plain"), ("mxfp4_rceil", "nvfp4_plain")),
    verdict=_formats)


# ---- stiction --------------------------------------------------------------------------------

def mean_flip_rate(receipt: Receipt) -> float:
    """Mean fraction of FP4 weight codes an optimizer step flipped, over the run's samples."""
    rates = [rate for _, rate in receipt.flip_rate]
    return sum(rates) / len(rates) if rates else float("nan")


def _stiction(runs: StudyRuns) -> Verdict:
    """Judged on the loss: random weight rounding closes part of RTNE's gap for either arm. The
    flip rate is reported, not judged: the meter reads the codes around one optimizer step at
    one step's random bits, where an update crosses a rounding threshold about as often under
    RTNE as under dither or SR (each with probability ~ |update| / code step), so it cannot
    separate the arms (results/README, stiction)."""
    arms = ("rtne", "dither", "sr")
    if not runs.has("bf16", *arms):
        return runs.missing("bf16", *arms)
    losses = [_part(f"{arm} - rtne loss", runs.gap(arm, "rtne"), -1) for arm in ("dither", "sr")]
    flips = [f"{arm} - rtne flips/step {iv.text() if iv else 'n/a'} (not judged)"
             for arm in ("dither", "sr") for iv in [runs.contrast({arm: 1, "rtne": -1}, mean_flip_rate)]]
    text = "; ".join([p for p, _ in losses] + flips) + _diverged(runs)
    verdicts = [v for _, v in losses]
    if REPRODUCED in verdicts:
        return text, REPRODUCED
    return text, CONTRADICTED if all(v == CONTRADICTED for v in verdicts) else NOT_RESOLVED


_PLAIN = "nvfp4_plain"
STICTION = Study(
    name="stiction", title="weight-code stiction: RTNE vs dither vs SR on weights",
    claim="RTNE freezes FP4 weight codes under small updates (stiction); keeping codes moving "
          "(dither, SR) should close part of the gap", source="fp4lab question (after the NVFP4 SR literature)",
    # BF16 has no FP4 weight codes to sample: its arm is fidelity's BF16 run, which serves here
    arms=(Arm(name="bf16", train={"stiction_every": 0}), Arm(name="rtne", recipe=_PLAIN),
          Arm(name="dither", recipe=_PLAIN, recipe_overrides={"fprop.b.dither": 1.0, "dgrad.b.dither": 1.0},
              baseline="rtne"),
          Arm(name="sr", recipe=_PLAIN, recipe_overrides={"fprop.b.rounding": "stochastic",
                                                          "dgrad.b.rounding": "stochastic"}, baseline="rtne")),
    comparisons=(("dither", "bf16"), ("sr", "bf16")),
    train={"stiction_every": 5}, verdict=_stiction)


# ---- gap closers ------------------------------------------------------------------------------

_W1X16 = {"fprop.b.block2d": False, "dgrad.b.block2d": False}
_DEFAULT_KEEP = list(Recipe().keep_bf16)  # lm_head and routers: kept by every recipe
_KEEP_MORE = {"keep_fraction": [4 / 62, 16 / 62]}  # twice NVIDIA's share: d6 (0, 2), d12 (1, 3)
# keep_more's third of the block linears at d6, as every block's attention projections instead
_KEEP_ATTN = {"keep_first": 0, "keep_last": 0, "keep_bf16": [*_DEFAULT_KEEP, "blocks.*.attn.*"]}
# Four Over Six with 1x16 weights and the late all-GEMM switch: the base the stacked arms build on
_STACKED = {**_W1X16, "bf16_after": 0.8, "bf16_scope": "all"}
_CLOSERS = {  # arm -> (recipe, overrides): each against NVIDIA's full recipe, same seeds
    "four_over_six": ("nvfp4_four_over_six", {}),
    # ours: Four Over Six lowers 1x16 blocks' error by 18% on Gaussian data but 16x16 tiles' by ~0
    # (docs/numerics.md), so give the weights 1x16 blocks where the choice can act
    "four_over_six_w1x16": ("nvfp4_four_over_six", _W1X16),
    "late_bf16_forward": (_NV, {"bf16_after": 0.8, "bf16_scope": "forward"}),
    "late_bf16_all": (_NV, {"bf16_after": 0.8, "bf16_scope": "all"}),
    # ours: late_bf16_forward closed most of late_bf16_all's gain, but its model no longer runs in
    # FP4; this keeps fprop FP4 (the deployed model) and gives the cooldown's small updates exact
    # gradients, where FP4 gradient noise weighs most against weight codes that barely move
    "late_bf16_backward": (_NV, {"bf16_after": 0.8, "bf16_scope": "backward"}),
    "keep_more": (_NV, _KEEP_MORE),
    "keep_none": (_NV, {"keep_first": 0, "keep_last": 0}),
    "sr_forward": (_NV, {"fprop.a.rounding": "stochastic"}),
    # ours: the two closers that moved the loss most at the stable settings (results/README,
    # 2026-11-25: the late all-GEMM switch -0.019, Four Over Six with 1x16 weights -0.007), together;
    # whether their gains add is the question
    "stacked": ("nvfp4_four_over_six", _STACKED),
    # ours: stacked's two closers added (-0.0236 nats, 3 seeds, against their -0.0194 and -0.0069
    # alone), leaving +0.91% to BF16; keep_more's own -0.0067 would bring that near the 0.5% goal
    # if it adds too
    "stacked_keep_more": ("nvfp4_four_over_six", {**_STACKED, **_KEEP_MORE}),
    # ours: stacked_keep_more lands +0.72% [+0.59, +0.85] from BF16 (3 seeds, 2026-11-25); the late
    # all-GEMM switch is the largest single closer (-0.0194 at the last 20% of steps), so this asks
    # what the last 30% buy on top; 70% of the steps stay FP4 (the price, said with the result)
    "stacked_keep_more_late30": ("nvfp4_four_over_six", {**_STACKED, **_KEEP_MORE, "bf16_after": 0.7}),
    # ours: at d6 the forward's precision is what resolves (2026-11-26: a late forward-only switch
    # gains -0.019 and BF16 gradients late are not resolved, +0.003; removing the RHT or SR from
    # the backward separates from nothing; SR on the forward hurts, +0.018); a 16-point Hadamard on
    # both fprop operands (the GEMM's result unchanged in exact arithmetic) spreads a block's
    # outlier over its 16 values, so the block scale fits the other 15 better. Measured
    # (2026-11-26, 3 seeds): worse, +0.0067 [+0.0014, +0.0119] on NVIDIA's recipe
    "fprop_hadamard": (_NV, {"fprop.hadamard": "deterministic"}),
    "stacked_keep_more_fprop_hadamard": ("nvfp4_four_over_six", {**_STACKED, **_KEEP_MORE,
                                                                 "fprop.hadamard": "deterministic"}),
    # ours: which third of the linear FLOPs to keep in BF16. keep_more keeps the last two blocks
    # of six (a third, -0.0067); this keeps every block's attention projections instead (qkv and
    # proj: 4 d^2 of a block's 12 d^2 at d6, the same third) and no whole block, so the two
    # arms differ only in where the BF16 third sits (against NVIDIA's recipe it also puts the last
    # block's feed-forward back in FP4: keep_more is its baseline)
    "keep_attn": (_NV, _KEEP_ATTN),
    # ours: keep_attn against keep_more, -0.0036 [-0.0118, +0.0047] (3 seeds, 2026-11-26), not
    # resolved but on one side every seed; the best recipe, stacked_keep_more_late30, is at +0.67%
    # [+0.51, +0.83] from BF16, so the same swap there asks whether the 0.5% goal is in reach
    # with the same BF16 share
    "stacked_keep_attn_late30": ("nvfp4_four_over_six", {**_STACKED, **_KEEP_ATTN, "bf16_after": 0.7}),
}
# else NVIDIA's recipe: an arm that moves the BF16 layers is judged against the same share kept as blocks
_CLOSER_BASELINES = {"keep_attn": "keep_more", "stacked_keep_attn_late30": "stacked_keep_more_late30"}
_GOAL_PCT = 0.5


def _gap_closers(runs: StudyRuns) -> Verdict:
    if not runs.has("bf16", _NV, "four_over_six"):
        return runs.missing("bf16", _NV, "four_over_six")
    parts = [_part("four_over_six - nvfp4", runs.gap("four_over_six", _NV), -1)]
    others = [f"{a} - nvfp4 {runs.gap(a, _NV).text()}" for a in _CLOSERS
              if a != "four_over_six" and runs.has(a) and runs.gap(a, _NV) is not None]
    to_bf16 = {a: runs.gap(a, "bf16") for a in (_NV, *_CLOSERS) if runs.has(a) and runs.gap(a, "bf16") is not None}
    best = min(to_bf16, key=lambda a: to_bf16[a].mean)
    hi = to_bf16[best].pct(to_bf16[best].hi)
    met = hi is not None and math.isfinite(hi) and hi <= _GOAL_PCT  # the whole interval under the goal
    goal = (f"; closest to BF16: {best} {to_bf16[best].text()} (goal: at most {_GOAL_PCT:g}%: "
            f"{'met' if met else 'not met'} by its interval)")
    return _judge(parts, "".join(f"; {o}" for o in others) + goal + _diverged(runs))


GAP_CLOSERS = Study(
    name="gap-closers", title="recipes that close NVFP4's gap to BF16, against NVIDIA's full recipe (d6)",
    claim="Four Over Six brings NVFP4 training loss closer to BF16 than NVIDIA's recipe alone",
    source="arXiv 2512.02010 (Four Over Six); arXiv 2509.25149 (late BF16, BF16 blocks)",
    arms=(Arm(name="bf16"), Arm(name=_NV, recipe=_NV),
          *(Arm(name=name, recipe=recipe, recipe_overrides=o, baseline=_CLOSER_BASELINES.get(name, _NV))
            for name, (recipe, o) in _CLOSERS.items())),
    comparisons=tuple((name, "bf16") for name in (_NV, *_CLOSERS)),
    verdict=_gap_closers)


# ---- fidelity --------------------------------------------------------------------------------

_WITHIN_PCT = 1.0


def _fidelity(runs: StudyRuns) -> Verdict:
    if not runs.has("bf16", "nvfp4"):
        return runs.missing("bf16", "nvfp4")
    iv = runs.gap("nvfp4", "bf16")
    if iv is None or iv.n < 2:
        return f"nvfp4 - bf16 {iv.text() if iv else 'n/a'}", NOT_RESOLVED
    lo, hi = iv.pct(iv.lo), iv.pct(iv.hi)  # the claim: the gap is below 1% of the loss
    v = REPRODUCED if hi < _WITHIN_PCT else CONTRADICTED if lo > _WITHIN_PCT else NOT_RESOLVED
    others = [f"{a} - bf16 {runs.gap(a, 'bf16').text()}" for a in runs.runs
              if a not in ("bf16", "nvfp4") and runs.gap(a, "bf16") is not None]
    return "; ".join([f"nvfp4 - bf16 {iv.text()} (claim: below {_WITHIN_PCT:g}%)", *others]) + _diverged(runs), v


_FIDELITY_CLAIM = ("NVIDIA's NVFP4 recipe trains to within 1% of the higher-precision loss "
                   "(12B, 10T tokens, against FP8)")
FIDELITY = Study(
    name="fidelity", title="how far each FP4 recipe lands from BF16 (d6)",
    claim=_FIDELITY_CLAIM, source="arXiv 2509.25149",
    arms=(Arm(name="bf16"), Arm(name="nvfp4", recipe="nvfp4"), Arm(name="nvfp4_plain", recipe="nvfp4_plain"),
          Arm(name="mxfp4", recipe="mxfp4"), Arm(name="mxfp4_hadamard", recipe="mxfp4_hadamard")),
    comparisons=(("nvfp4", "nvfp4_plain"), ("mxfp4_hadamard", "mxfp4")),
    verdict=_fidelity)
FIDELITY_D12 = Study(
    name="fidelity-d12", title="BF16 vs NVIDIA's NVFP4 recipe on the deeper GPT (d12)", size="deep",
    claim=_FIDELITY_CLAIM, source="arXiv 2509.25149",
    arms=(Arm(name="bf16"), Arm(name="nvfp4", recipe="nvfp4")), verdict=_fidelity)


STUDIES = {s.name: s for s in (FIDELITY, FIDELITY_D12, GAINS, EXPERT_LANE, GEMM_PROGRESSION, WGRAD_INTERVENTIONS,
                               NVIDIA_ABLATION, FORMATS, STICTION, GAP_CLOSERS)}


def study(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; expected one of {', '.join(STUDIES)} (or conversion)")
    return STUDIES[name]


def scale(name: str) -> Scale:
    if name not in SCALES:
        raise ValueError(f"unknown scale {name!r}; expected one of {', '.join(SCALES)}")
    return SCALES[name]
