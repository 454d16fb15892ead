"""The published FP4 findings fp4lab reruns, as data, and the budgets to run them at.

Sources (figures quoted from them; the verdict functions say how we judge "reproduced"):
    NVFP4 MoE speedrun   gain isolation and the expert optimizer lane on a small MoE (E=64, K=6,
                         2 shared): embed-only gain -0.18 vs unit, logits-only +0.15, old pair
                         +0.05 at 384 steps; residual gap +0.046 after the fix
    AMD MXFP4 study      MXFP4 on Llama-3.1-8B / C4: quantizing Wgrad is the main cause of the
                         degradation; of SR, random-sign and deterministic Hadamard on Wgrad only
                         the deterministic Hadamard restored stable training
    NVIDIA NVFP4 recipe  arXiv 2509.25149 (12B, 10T tokens): removing any of BF16 layers, RHT on
                         Wgrad, 2D weight blocks, SR on gradients hurt; switching to BF16 late
                         recovers most of the gap; MXFP4 needed 36% more tokens to match NVFP4
                         (8B, 1T)
    stiction             our question: does the fraction of FP4 weight codes that move per step
                         track the loss gap (RTNE vs dither vs SR on weights)?

Scales: ``smoke`` (CPU, seconds, run in CI), ``gpu-small`` (one H100, minutes per study),
``gpu-medium`` (one H100, about an hour per study).

Public: ``SCALES``, ``STUDIES``, ``study``, ``scale``.
"""

from __future__ import annotations

import statistics

from .study import Arm, Scale, Study, Verdict

_SMOKE = dict(data="stdlib", data_max_bytes=300_000, vocab_size=512, steps=10, batch_size=4, seq_len=64,
              lr=3e-3, warmup=2, eval_every=5, eval_batches=2, log_every=5)
_SMALL = dict(data="stdlib", vocab_size=8192, steps=400, batch_size=32, seq_len=256, lr=2e-3, warmup=40,
              eval_every=50, eval_batches=16, log_every=25)
_MEDIUM = dict(data="python", vocab_size=8192, steps=1500, batch_size=64, seq_len=512, lr=2e-3, warmup=100,
               eval_every=100, eval_batches=32, log_every=50)

SCALES = {s.name: s for s in (
    Scale(name="smoke", dense={**_SMOKE, "model": "tiny"}, moe={**_SMOKE, "model": "moe-tiny"}, seeds=(0,),
          where="CPU (CI)", minutes_per_run=(0.03, 0.05)),
    Scale(name="gpu-small", dense={**_SMALL, "model": "d6"},
          moe={**_SMALL, "model": "moe64", "model_overrides": {"depth": 4}, "steps": 150, "warmup": 15,
               "eval_every": 25},
          seeds=(0, 1), where="one H100", minutes_per_run=(0.6, 2.5)),
    Scale(name="gpu-medium", dense={**_MEDIUM, "model": "d12"}, moe={**_MEDIUM, "model": "moe64", "steps": 384},
          seeds=(0, 1, 2), where="one H100", minutes_per_run=(8.0, 12.0)),
)}


def _mean(finals: dict[str, list[float]], arm: str) -> float:
    return statistics.fmean(finals[arm])


def _sd(finals: dict[str, list[float]], arm: str) -> float:
    vals = finals[arm]
    return float("inf") if float("inf") in vals else statistics.stdev(vals) if len(vals) > 1 else 0.0


def _have(finals: dict[str, list[float]], *arms: str) -> bool:
    """Every arm has finished runs; a diverged run counts (as +inf, the worst result)."""
    return all(a in finals for a in arms)


def _missing(*arms: str) -> Verdict:
    return f"incomplete: needs finished runs of {', '.join(arms)}", "not run"


def _rel(finals, arms, base) -> dict[str, float]:
    return {a: _mean(finals, a) - _mean(finals, base) for a in arms}


def _fmt(deltas: dict[str, float], finals=None) -> str:
    parts = []
    for arm, d in deltas.items():
        sd = f" (sd {_sd(finals, arm):.3f})" if finals is not None and len(finals.get(arm, [])) > 1 else ""
        parts.append(f"{arm} {d:+.3f}{sd}")
    return ", ".join(parts)


def _diverged(finals: dict[str, list[float]]) -> str:
    gone = [a for a, v in finals.items() if float("inf") in v]
    return f"; diverged: {', '.join(gone)}" if gone else ""


# ---- gains -----------------------------------------------------------------------------------

def _gains(finals, _runs) -> Verdict:
    arms = ("embed", "logits", "old_pair")
    if not _have(finals, "unit", *arms):
        return _missing("unit", *arms)
    d = _rel(finals, arms, "unit")
    ok = [d["embed"] < 0, d["logits"] > 0, d["logits"] == max(d.values())]
    return (f"vs unit: {_fmt(d, finals)}", "yes" if all(ok) else "partly" if any(ok) else "no")


_NV = "nvfp4"
GAINS = Study(
    name="gains", title="NVFP4-only embedding and logit gains, isolated", moe=True,
    claim="embed-only gain best (-0.18 vs unit), logits-only worst (+0.15), old pair +0.05 at 384 steps",
    source="NVFP4 MoE speedrun",
    arms=(Arm(name="unit", recipe=_NV),
          Arm(name="embed", recipe=_NV, recipe_overrides={"embed_gain": 10.667}),
          Arm(name="logits", recipe=_NV, recipe_overrides={"logits_gain": 0.125}),
          Arm(name="old_pair", recipe=_NV, recipe_overrides={"embed_gain": 10.667, "logits_gain": 0.125})),
    verdict=_gains)


# ---- expert lane -----------------------------------------------------------------------------

def _expert_lane(finals, _runs) -> Verdict:
    need = ("nvfp4_adamw", "nvfp4_muon", "bf16_adamw", "bf16_muon")
    if not _have(finals, *need):
        return _missing(*need)
    gaps = {lane: _mean(finals, f"nvfp4_{lane}") - _mean(finals, f"bf16_{lane}") for lane in ("adamw", "muon")}
    best = min(gaps, key=gaps.get)
    text = (f"NVFP4 - BF16 with experts on AdamW {gaps['adamw']:+.3f}, on Muon {gaps['muon']:+.3f}; "
            f"best lane {best} leaves {gaps[best]:+.3f}")
    if gaps[best] < 0:
        text += " (NVFP4 ahead: its embedding gain is NVFP4-only, so the BF16 arms train without it)"
    return text, "yes" if 0 <= gaps[best] <= 0.1 else "no"


_EMBED = {"embed_gain": 10.667}
EXPERT_LANE = Study(
    name="expert-lane", title="the expert optimizer lane (AdamW vs Muon), NVFP4 vs BF16", moe=True,
    claim="with the best gains and the expert lane fixed, NVFP4 trails BF16 by +0.046 valid loss",
    source="NVFP4 MoE speedrun",
    arms=(Arm(name="nvfp4_adamw", recipe=_NV, recipe_overrides=_EMBED, train={"expert_opt": "adamw"}),
          Arm(name="nvfp4_muon", recipe=_NV, recipe_overrides=_EMBED, train={"expert_opt": "muon"}),
          Arm(name="bf16_adamw", recipe="bf16", train={"expert_opt": "adamw"}),
          Arm(name="bf16_muon", recipe="bf16", train={"expert_opt": "muon"})),
    train={"dense_opt": "muon"}, verdict=_expert_lane)


# ---- GEMM progression ------------------------------------------------------------------------

def _nvfp4_gemms(*gemms: str) -> dict:
    return {f"{g}.{side}.format": "nvfp4" for g in gemms for side in ("a", "b")}


def _progression(finals, _runs) -> Verdict:
    out, verdicts = [], []
    for fmt, names in (("MXFP4", ("fprop", "fprop_dgrad", "fprop_dgrad_wgrad")),
                       ("NVFP4", ("fprop_nv", "fprop_dgrad_nv", "fprop_dgrad_wgrad_nv"))):
        if not _have(finals, "bf16", *names):
            continue
        steps = {"+fprop": _mean(finals, names[0]) - _mean(finals, "bf16"),
                 "+dgrad": _mean(finals, names[1]) - _mean(finals, names[0]),
                 "+wgrad": _mean(finals, names[2]) - _mean(finals, names[1])}
        out.append(f"{fmt} increments {_fmt(steps)}")
        verdicts.append(steps["+wgrad"] == max(steps.values()))
    if not out:
        return _missing("bf16", "fprop", "fprop_dgrad", "fprop_dgrad_wgrad")
    return "; ".join(out) + _diverged(finals), "yes" if all(verdicts) else "partly" if any(verdicts) else "no"


GEMM_PROGRESSION = Study(
    name="gemm-progression", title="which GEMM's quantization costs the most (Fprop, +Dgrad, +Wgrad)",
    claim="quantizing Wgrad is the main cause of the MXFP4 degradation", source="AMD MXFP4 study (Llama-3.1-8B, C4)",
    arms=(Arm(name="bf16"), Arm(name="fprop", recipe="fprop"), Arm(name="fprop_dgrad", recipe="fprop_dgrad"),
          Arm(name="fprop_dgrad_wgrad", recipe="fprop_dgrad_wgrad"),
          Arm(name="fprop_nv", recipe="fprop", recipe_overrides=_nvfp4_gemms("fprop")),
          Arm(name="fprop_dgrad_nv", recipe="fprop_dgrad", recipe_overrides=_nvfp4_gemms("fprop", "dgrad")),
          Arm(name="fprop_dgrad_wgrad_nv", recipe="fprop_dgrad_wgrad",
              recipe_overrides=_nvfp4_gemms("fprop", "dgrad", "wgrad"))),
    verdict=_progression)


# ---- Wgrad interventions ---------------------------------------------------------------------

def _wgrad(finals, _runs) -> Verdict:
    arms = ("none", "sr", "random_hadamard", "det_hadamard")
    if not _have(finals, "bf16", *arms):
        return _missing("bf16", *arms)
    gaps = {a: _mean(finals, a) - _mean(finals, "bf16") for a in arms}
    best = min(gaps, key=gaps.get)
    text = f"gap to BF16: {', '.join(f'{a} {g:+.3f}' for a, g in gaps.items())}" + _diverged(finals)
    beats_none = gaps["det_hadamard"] < gaps["none"]
    return text, "yes" if best == "det_hadamard" else "partly" if beats_none else "no"


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
    verdict=_wgrad)


# ---- NVIDIA ablation -------------------------------------------------------------------------

_ABLATIONS = {
    "no_bf16_layers": {"keep_first": 0, "keep_last": 0},
    "no_rht": {"wgrad.hadamard": "none"},
    "no_2d_weights": {"fprop.b.block2d": False, "dgrad.b.block2d": False},
    "no_sr": {"dgrad.a.rounding": "rtne", "wgrad.a.rounding": "rtne"},
}


def _ablation(finals, _runs) -> Verdict:
    if not _have(finals, "full"):
        return _missing("full")
    done = [a for a in _ABLATIONS if a in finals]
    d = {a: _mean(finals, a) - _mean(finals, "full") for a in done}
    hurt = [a for a in done if d[a] > 0]
    text = f"vs full recipe: {_fmt(d, finals)}"
    if _have(finals, "bf16_late", "bf16"):
        full_gap = _mean(finals, "full") - _mean(finals, "bf16")
        late_gap = _mean(finals, "bf16_late") - _mean(finals, "bf16")
        text += f"; gap to BF16 {full_gap:+.3f}, with the last 20% in BF16 {late_gap:+.3f}"
    verdict = "yes" if len(hurt) == len(_ABLATIONS) else "partly" if hurt else "no"
    return text + f" ({len(hurt)}/{len(_ABLATIONS)} removals hurt)", verdict


NVIDIA_ABLATION = Study(
    name="nvidia-ablation", title="NVIDIA's NVFP4 recipe, each part removed",
    claim="removing any part (BF16 layers, RHT on Wgrad, 2D weights, SR on gradients) hurt at 12B; "
          "BF16 late in training recovers most of the gap",
    source="arXiv 2509.25149",
    arms=(Arm(name="bf16"), Arm(name="full", recipe=_NV),
          *(Arm(name=name, recipe=_NV, recipe_overrides=o) for name, o in _ABLATIONS.items()),
          Arm(name="bf16_late", recipe=_NV, recipe_overrides={"bf16_after": 0.8})),
    verdict=_ablation)


# ---- formats ---------------------------------------------------------------------------------

def tokens_to_reach(receipt: dict, target: float) -> float | None:
    """Tokens at which the eval curve first reaches ``target`` (linear between evals), or None."""
    prev = None
    for e in receipt["evals"]:
        if e["val_loss"] <= target:
            if prev is None or prev["val_loss"] == e["val_loss"]:
                return float(e["tokens"])
            t = (prev["val_loss"] - target) / (prev["val_loss"] - e["val_loss"])
            return prev["tokens"] + t * (e["tokens"] - prev["tokens"])
        prev = e
    return None


def _formats(finals, runs) -> Verdict:
    if not _have(finals, "nvfp4", "mxfp4"):
        return _missing("nvfp4", "mxfp4")
    parts, extra_all = [], []
    for mx in ("mxfp4", "mxfp4_rceil"):
        if not _have(finals, mx):
            continue
        extras = []
        for nv_run, mx_run in zip(runs["nvfp4"], runs[mx]):
            reach = tokens_to_reach(mx_run, nv_run["final"]["val_loss"])
            budget = nv_run["evals"][-1]["tokens"]
            extras.append(None if reach is None else reach / budget - 1)
        if None in extras:
            parts.append(f"{mx} does not reach NVFP4's final loss within the budget (> +0%, "
                         f"{_mean(finals, mx) - _mean(finals, 'nvfp4'):+.3f} loss at the end)")
            extra_all.append(float("inf"))
        else:
            mean = statistics.fmean(extras)
            parts.append(f"{mx} needs {100 * mean:+.0f}% tokens to reach NVFP4's loss")
            extra_all.append(mean)
    if _have(finals, "bf16"):
        parts.append(f"gaps to BF16: nvfp4 {_mean(finals, 'nvfp4') - _mean(finals, 'bf16'):+.3f}, "
                     f"mxfp4 {_mean(finals, 'mxfp4') - _mean(finals, 'bf16'):+.3f}")
    return "; ".join(parts), "yes" if all(e > 0 for e in extra_all) else "no"


FORMATS = Study(
    name="formats", title="BF16 vs NVFP4 vs MXFP4 (floor, rceil) on one recipe",
    claim="MXFP4 needs 36% more tokens to reach NVFP4's loss (8B, 1T tokens)", source="arXiv 2509.25149",
    arms=(Arm(name="bf16"), Arm(name="nvfp4", recipe="nvfp4_plain"), Arm(name="mxfp4", recipe="mxfp4"),
          Arm(name="mxfp4_rceil", recipe="mxfp4_rceil")),
    verdict=_formats)


# ---- stiction --------------------------------------------------------------------------------

def _mean_flip(receipts: list[dict]) -> float:
    rates = [rate for r in receipts for _, rate in r["flip_rate"]]
    return statistics.fmean(rates) if rates else float("nan")


def _stiction(finals, runs) -> Verdict:
    arms = ("rtne", "dither", "sr")
    if not _have(finals, "bf16", *arms):
        return _missing("bf16", *arms)
    flips = {a: _mean_flip(runs[a]) for a in arms}
    gaps = {a: _mean(finals, a) - _mean(finals, "bf16") for a in arms}
    text = ", ".join(f"{a}: flips {100 * flips[a]:.2f}%/step, gap {gaps[a]:+.3f}" for a in arms)
    by_flips, by_gap = sorted(arms, key=flips.get), sorted(arms, key=gaps.get, reverse=True)
    tracks = by_flips == by_gap  # fewer flips <-> larger gap, in the same order
    return text + ("; fewer flips go with a larger gap" if tracks else "; flip rate does not order the gaps"), \
        "yes" if tracks else "no"


_PLAIN = "nvfp4_plain"
STICTION = Study(
    name="stiction", title="weight-code stiction: RTNE vs dither vs SR on weights",
    claim="RTNE freezes FP4 weight codes under small updates (stiction); keeping codes moving "
          "(dither, SR) should close part of the gap", source="fp4lab question (after the NVFP4 SR literature)",
    arms=(Arm(name="bf16"), Arm(name="rtne", recipe=_PLAIN),
          Arm(name="dither", recipe=_PLAIN, recipe_overrides={"fprop.b.dither": 1.0, "dgrad.b.dither": 1.0}),
          Arm(name="sr", recipe=_PLAIN, recipe_overrides={"fprop.b.rounding": "stochastic",
                                                          "dgrad.b.rounding": "stochastic"})),
    train={"stiction_every": 5}, verdict=_stiction)


STUDIES = {s.name: s for s in (GAINS, EXPERT_LANE, GEMM_PROGRESSION, WGRAD_INTERVENTIONS, NVIDIA_ABLATION,
                               FORMATS, STICTION)}


def study(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; expected one of {', '.join(STUDIES)} (or conversion)")
    return STUDIES[name]


def scale(name: str) -> Scale:
    if name not in SCALES:
        raise ValueError(f"unknown scale {name!r}; expected one of {', '.join(SCALES)}")
    return SCALES[name]
