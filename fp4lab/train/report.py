"""Tables and plots rebuilt from receipts alone, with every gap paired by seed.

Runs are grouped into **arms** by name: ``nvfp4-seed2`` is seed 2 of arm ``nvfp4`` (a name
without a ``-seed<k>`` suffix is an arm of one run). Each run is compared with the run of the
**baseline arm** that has the same seed (same initial weights, data order and random bits):
the plain BF16 arm (a recipe that quantizes nothing and sets no gains) unless one is named. A
run whose seed has no baseline run says so instead of borrowing another seed's.

``report(run_dirs, out_dir)`` writes
    report.md   the arms (seeds, mean final val loss ± sd, the mean paired gap to the baseline
                with its 95% t-interval in nats and %, and whether the interval separates the
                arms), then every run (its own seed's gap, tokens/s against that baseline)
    loss.png    validation-loss curves (train loss faint) against tokens, every run
    gap.png     the mean paired gap to the baseline against tokens, per arm, with its 95% band
``final_loss``, ``runs_by_arm``, ``paired_gap`` and ``served_lines`` (an FP4 arm's gap split
into its forward's and its weights' shares, where receipts hold a BF16-forward evaluation; arms
against an FP4 baseline compared with both served in BF16) are shared with the study reports.

Public: ``load_receipts``, ``arm_name``, ``runs_by_arm``, ``final_loss``, ``paired_gap``,
``baseline_arm``, ``gap_table``, ``arm_table``, ``served_lines``, ``served_bf16``, ``served_fp4``,
``plots``, ``report``.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from pathlib import Path

from ..nn.recipe import Recipe
from .receipt import Receipt
from .stats import Interval, interval, seeds_to_resolve

_SEED = re.compile(r"-seed(\d+)$")
Runs = dict[str, dict[int, Receipt]]
"""{arm: {seed: receipt}}"""


def load_receipts(run_dirs: list[Path]) -> list[Receipt]:
    """Run directories (or receipt.json files) -> their receipts, validated (Receipt.load)."""
    return [Receipt.load(run) for run in map(Path, run_dirs)]


def provenance(receipts: list[Receipt]) -> str:
    """Where the runs ran: every distinct device and git commit, in order of first appearance
    (a study's arms may come from several campaigns)."""
    devices = dict.fromkeys(r.device for r in receipts)
    commits = dict.fromkeys(r.git.sha[:12] for r in receipts)
    return f"device {', '.join(devices)}; git {', '.join(commits)}"


def arm_name(receipt: Receipt) -> str:
    """The run's arm: its name without a trailing -seed<k>."""
    return _SEED.sub("", receipt.name)


def runs_by_arm(receipts: list[Receipt]) -> Runs:
    """Receipts -> {arm: {seed: receipt}} (two runs of one arm and seed are an error)."""
    runs: Runs = {}
    for r in receipts:
        arm = runs.setdefault(arm_name(r), {})
        if r.seed in arm:
            raise ValueError(f"two runs of arm {arm_name(r)!r} with seed {r.seed}: {arm[r.seed].name} and {r.name}")
        arm[r.seed] = r
    return runs


def final_loss(receipt: Receipt) -> float:
    """Final validation loss; a diverged or unfinished run (or a non-finite loss) is +inf."""
    value = receipt.final.val_loss if receipt.status == "ok" else None
    return value if value is not None and math.isfinite(value) else math.inf


def _plain_bf16(receipt: Receipt) -> bool:
    recipe = receipt.recipe
    return not Recipe.from_dict(recipe).quantized and (recipe.get("embed_gain", 1.0), recipe.get("logits_gain", 1.0)) \
        == (1.0, 1.0)


def baseline_arm(runs: Runs, name: str | None = None) -> str | None:
    """The named arm, or the first arm whose runs are plain BF16 (None if there is none)."""
    if name is not None:
        if name not in runs:
            raise ValueError(f"baseline arm {name!r} not among the runs: {', '.join(runs)}")
        return name
    return next((arm for arm, seeds in runs.items() if all(map(_plain_bf16, seeds.values()))), None)


def paired_gap(arm: dict[int, Receipt], base: dict[int, Receipt], *, value=final_loss) -> Interval | None:
    """Mean over shared seeds of value(arm run) - value(base run), with its 95% interval (in %
    of the baseline's mean over those seeds). Seeds where either run diverged are left out;
    None when no seed is shared by two finite runs."""
    pairs = {s: (value(arm[s]), value(base[s])) for s in sorted(set(arm) & set(base))}
    pairs = {s: p for s, p in pairs.items() if all(map(math.isfinite, p))}
    if not pairs:
        return None
    return interval({s: a - b for s, (a, b) in pairs.items()},
                    base_mean=statistics.fmean(b for _, b in pairs.values()))


def served_lines(runs: dict[str, dict[int, Receipt]], baselines: dict[str, str | None]) -> list[str]:
    """FP4 arms whose final weights were also evaluated with a BF16 forward: their gap to a
    baseline that runs no FP4 forward (BF16) split into what the FP4 forward costs at inference
    (FP4 forward - BF16 forward, same weights) and what FP4 training did to the weights (BF16
    forward - the baseline). Arms against an FP4 baseline are left out. [] if none."""
    def served(r: Receipt) -> float | None:
        return r.final.bf16_forward_val_loss

    rows, fp4_based = [], []
    for arm, seeds in runs.items():
        base = baselines.get(arm)
        if base is None or base == arm or base not in runs:
            continue
        if any(map(_ends_with_fp4_forward, runs[base].values())):
            fp4_based.append(arm)  # an FP4 baseline: its own forward's share would hide in the weights' column
            continue
        shared = [s for s in sorted(set(seeds) & set(runs[base]))
                  if served(seeds[s]) is not None and math.isfinite(served(seeds[s]))
                  and math.isfinite(final_loss(seeds[s])) and math.isfinite(final_loss(runs[base][s]))]
        if not shared:
            continue
        base_mean = statistics.fmean(final_loss(runs[base][s]) for s in shared)
        forward = interval({s: final_loss(seeds[s]) - served(seeds[s]) for s in shared}, base_mean=base_mean)
        weights = interval({s: served(seeds[s]) - final_loss(runs[base][s]) for s in shared}, base_mean=base_mean)
        rows.append(f"| {arm} | {len(shared)} | {_mean_sd([served(seeds[s]) for s in shared])} | "
                    f"{forward.text()} | {weights.text()} |")
    lines = [] if not rows else [
        "", "The FP4 arms' final weights served with a BF16 forward (the same weights, every GEMM in "
        "BF16): the gap to the baseline split into the FP4 forward's share at inference and the share "
        "FP4 training left in the weights.", "",
        "| arm | seeds | final val, BF16 forward | FP4 forward - BF16 forward, nats [95% CI] (%) | "
        "BF16 forward - baseline, nats [95% CI] (%) |", "|---|---|---|---|---|", *rows]
    return lines + _same_forward_lines(runs, baselines, fp4_based) + _fp4_forward_lines(runs, baselines, fp4_based)


def _ends_with_fp4_forward(receipt: Receipt) -> bool:
    """Whether the run's final evaluation ran an FP4 forward: the recipe in force at its last
    step's progress, (steps - 1) / steps, which is the one the loop evaluates with."""
    steps = receipt.final.steps
    final = Recipe.from_dict(receipt.recipe).at_progress((steps - 1) / steps if steps else 0.0)
    return final.fprop.emulated


def _served(receipt: Receipt, evaluated: float | None, *, fp4: bool) -> float | None:
    """The final weights' loss through one forward: ``evaluated`` (the receipt's extra evaluation
    with it), else the final loss where the run's last forward was that one anyway; None for a
    run that did not finish or has neither."""
    if receipt.status != "ok":
        return None
    if evaluated is not None:
        return evaluated
    return final_loss(receipt) if _ends_with_fp4_forward(receipt) == fp4 else None


def served_bf16(receipt: Receipt) -> float | None:
    """The final validation loss of the run's weights served with a BF16 forward: its BF16-forward
    evaluation, or its final loss where its last steps ran no FP4 forward anyway (BF16, a late
    switch of the forward); None for a run that did not finish, or an FP4-forward run whose
    receipt has no such evaluation."""
    return _served(receipt, receipt.final.bf16_forward_val_loss, fp4=False)


def _nan_for_none(served: Callable[[Receipt], float | None]) -> Callable[[Receipt], float]:
    """A served_* score as paired_gap's value: NaN (left out of the pairs) where there is none."""
    def value(receipt: Receipt) -> float:
        score = served(receipt)
        return math.nan if score is None else score
    return value


def _same_forward_lines(runs: Runs, baselines: dict[str, str | None], arms: list[str]) -> list[str]:
    """Arms against an FP4 baseline compared with both sides served in BF16: an arm that ends
    with a BF16 forward (a late switch) is otherwise evaluated at another precision than its
    baseline, and its gain would mix better weights with the evaluation's forward."""
    plain = baseline_arm(runs)
    rows = []
    for arm in arms:
        gap = paired_gap(runs[arm], runs[baselines[arm]], value=_nan_for_none(served_bf16))
        if gap is None:
            continue
        to_plain = paired_gap(runs[arm], runs[plain], value=_nan_for_none(served_bf16)) if plain is not None else None
        rows.append(f"| {arm} - {baselines[arm]} | {gap.n} | "
                    f"{_mean_sd([served_bf16(runs[arm][s]) for s in gap.seeds])} | {gap.text()} | {separation(gap)} | "
                    f"{to_plain.text() if to_plain is not None else '-'} |")
    if not rows:
        return []
    return ["", "The same comparisons with both arms' final weights served with a BF16 forward, so that "
            "an arm whose last steps ran a BF16 forward (a late switch) is not scored at another "
            "precision than its baseline: what the arm changed in the weights. The last column is the "
            f"arm's weights against the plain BF16 arm ({plain or 'none here'}), the same way.", "",
            "| comparison | seeds | arm's final val, BF16 forward | paired, both BF16 forward, nats [95% CI] (%) | "
            "separated? | weights' gap to BF16, nats [95% CI] (%) |", "|---|---|---|---|---|---|", *rows]


def served_fp4(receipt: Receipt) -> float | None:
    """The final validation loss of the run's weights served with its FP4 forward: the FP4-forward
    evaluation of a late switch to BF16, or the final loss of a run whose last steps ran FP4
    anyway; None for a run that did not finish, or a switched run whose receipt has none."""
    return _served(receipt, receipt.final.fp4_forward_val_loss, fp4=True)


def _fp4_forward_lines(runs: Runs, baselines: dict[str, str | None], arms: list[str]) -> list[str]:
    """Arms that switched to a BF16 forward late, against their FP4 baseline with both sides
    served in FP4: whether the switch's weights are better as an FP4 model."""
    rows = []
    for arm in arms:
        if not any(r.final.fp4_forward_val_loss is not None for r in runs[arm].values()):
            continue
        gap = paired_gap(runs[arm], runs[baselines[arm]], value=_nan_for_none(served_fp4))
        if gap is None:
            continue
        served = _mean_sd([served_fp4(runs[arm][s]) for s in gap.seeds])
        rows.append(f"| {arm} - {baselines[arm]} | {gap.n} | {served} | {gap.text()} | {separation(gap)} |")
    if not rows:
        return []
    return ["", "The arms that switched their forward to BF16 late, with their final weights served through the "
            "FP4 forward they trained with before the switch, against their FP4 baseline as run: whether the "
            "switch leaves a better FP4 model.", "",
            "| comparison | seeds | arm's final val, FP4 forward | paired, both FP4 forward, nats [95% CI] (%) | "
            "separated? |", "|---|---|---|---|---|", *rows]


def separation(iv: Interval | None) -> str:
    """What the interval says about the two arms, in words."""
    if iv is None:
        return "no shared seed"
    if iv.n < 2:
        return "1 seed: not resolved"
    return "worse" if iv.lo > 0 else "better" if iv.hi < 0 else "not resolved"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _mean_sd(values: list[float]) -> str:
    if any(not math.isfinite(v) for v in values):
        return f"{sum(not math.isfinite(v) for v in values)} of {len(values)} diverged"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 \
        else f"{values[0]:.4f}"


def arm_table(runs: Runs, baselines: dict[str, str | None]) -> str:
    """One row per arm: seeds, mean ± sd, and the paired gap to ``baselines[arm]`` (95% CI)."""
    lines = ["| arm | recipe | seeds | final val (mean ± sd) | baseline | paired gap, nats [95% CI] (%) | "
             "separated? |", "|---|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        base = baselines.get(arm)
        iv = paired_gap(seeds, runs[base]) if base is not None and base != arm and base in runs else None
        gap = iv.text() if iv is not None else "-"
        sep = separation(iv) if base is not None and base != arm else "-"
        recipe = next(iter(seeds.values())).recipe["name"]
        lines.append(f"| {arm} | {recipe} | {len(seeds)} | {_mean_sd([final_loss(r) for r in seeds.values()])} | "
                     f"{base if base != arm else '-'} | {gap} | {sep} |")
    return "\n".join(lines)


def gap_table(receipts: list[Receipt], baselines: dict[str, str | None] | None = None) -> str:
    """One row per run: final and min val loss, the gap to its own seed's baseline run, speed."""
    runs = runs_by_arm(receipts)
    if baselines is None:
        base = baseline_arm(runs)
        baselines = {arm: base for arm in runs}
    lines = ["| run | recipe | seed | final val | min val | gap to baseline (same seed) | gap % | tokens/s | "
             "x baseline | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in receipts:
        final, best = r.final.val_loss, r.final.min_val_loss
        base_arm = baselines.get(arm_name(r))
        ref = runs.get(base_arm, {}).get(r.seed) if base_arm else None
        gap = pct = speed = None
        note = "-"
        if base_arm is not None and base_arm != arm_name(r):
            if ref is None:
                note = f"no {base_arm} run for seed {r.seed}"
            elif math.isfinite(final_loss(r)) and math.isfinite(final_loss(ref)):
                gap = final_loss(r) - final_loss(ref)
                pct = 100 * gap / final_loss(ref)
                note = f"{gap:+.4f} vs {ref.name}"
            if ref is not None and r.tokens_per_s and ref.tokens_per_s and _graphed(r) == _graphed(ref):
                speed = r.tokens_per_s / ref.tokens_per_s  # a graphed run beside an eager one: no ratio
        rate = _fmt(r.tokens_per_s, ',.0f') + (" (graphed)" if _graphed(r) and r.tokens_per_s else "")
        lines.append(f"| {r.name} | {r.recipe['name']} | {r.seed} | {_fmt(final, '.4f')} | "
                     f"{_fmt(best, '.4f')} | {note} | {_fmt(pct, '+.2f')} | {rate} | "
                     f"{_fmt(speed, '.2f')} | {r.status} |")
    return "\n".join(lines)


def _graphed(receipt: Receipt) -> bool:
    """Whether the run replayed its steps from a CUDA graph (its tokens/s are not an eager run's)."""
    return bool(receipt.config.get("cuda_graph"))


def gap_curve(arm: dict[int, Receipt], base: dict[int, Receipt]) -> list[tuple[int, Interval]]:
    """(tokens, paired gap interval) at every evaluation step that all shared seeds reached."""
    seeds = sorted(set(arm) & set(base))
    curves = [({e.step: e for e in arm[s].evals}, {e.step: e for e in base[s].evals}) for s in seeds]
    steps = sorted(set.intersection(*(set(a) & set(b) for a, b in curves))) if curves else []
    out = []
    for step in steps:
        diffs = {s: a[step].val_loss - b[step].val_loss for s, (a, b) in zip(seeds, curves)}
        if all(math.isfinite(d) for d in diffs.values()):
            out.append((curves[0][0][step].tokens, interval(diffs)))
    return out


def _running_mean(values: list[float], width: int) -> list[float]:
    """Trailing mean over ``width`` values (fewer at the start); non-finite values pass through."""
    out, window = [], []
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        window = (window + [v])[-width:]
        out.append(sum(window) / len(window))
    return out


def plots(receipts: list[Receipt], out_dir: Path, title: str,
          baselines: dict[str, str | None] | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = []
    # one color per arm (its seeds share it: a dozen runs stay readable), one legend entry per arm
    arms = list(dict.fromkeys(arm_name(r) for r in receipts))
    colors = {arm: plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")(i % 20) for i, arm in enumerate(arms)}
    labelled = set()
    for r in receipts:
        arm = arm_name(r)
        tokens_per_step = r.config["batch_size"] * r.config["seq_len"]
        ax.plot([e.tokens for e in r.evals], [e.val_loss for e in r.evals], marker="o", markersize=3,
                color=colors[arm], label=None if arm in labelled else f"{arm} (val)")
        labelled.add(arm)
        shown += [e.val_loss for e in r.evals[len(r.evals) // 3:]]
        if r.train_curve:
            steps, losses = zip(*r.train_curve)
            smooth = _running_mean(list(losses), max(1, len(losses) // 40))  # the trend, not the batch noise
            ax.plot([s * tokens_per_step for s in steps], smooth, color=colors[arm], alpha=0.3, linewidth=0.8)
            shown += smooth[len(smooth) // 3:]
    ax.set(xlabel="tokens", ylabel="loss", title=f"{title}: validation loss (training, smoothed, faint)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    shown = [v for v in shown if math.isfinite(v)]
    if shown:  # the later two thirds of both curves, where the arms separate
        ax.set_ylim(min(shown) - 0.05, max(shown) + 0.2)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=120)
    written.append(out_dir / "loss.png")
    plt.close(fig)
    runs = runs_by_arm(receipts)
    if baselines is None:
        base = baseline_arm(runs)
        baselines = {arm: base for arm in runs}
    pairs = [(arm, baselines.get(arm)) for arm in runs if baselines.get(arm) not in (None, arm)
             and baselines.get(arm) in runs]
    curves = {(arm, base): gap_curve(runs[arm], runs[base]) for arm, base in pairs}
    curves = {pair: curve for pair, curve in curves.items() if curve}  # none: the arms share no eval step
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for (arm, base), curve in curves.items():
            tokens = [t for t, _ in curve]
            line, = ax.plot(tokens, [iv.mean for _, iv in curve], marker="o", markersize=3,
                            label=f"{arm} - {base} ({curve[-1][1].n} seeds)")
            if curve[-1][1].n > 1:
                ax.fill_between(tokens, [iv.lo for _, iv in curve], [iv.hi for _, iv in curve],
                                color=line.get_color(), alpha=0.15, linewidth=0)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(xlabel="tokens", ylabel="val loss gap (nats)", title=f"{title}: paired gap, 95% band over seeds")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "gap.png", dpi=120)
        written.append(out_dir / "gap.png")
        plt.close(fig)
    return written


def resolution_lines(gaps: dict, effects: dict[str, float] | None = None) -> list[str]:
    """The arithmetic behind a scale choice: per gap, the paired spread, the interval's half-width
    and how many seeds would resolve a gap of the measured size at that spread; with ``effects``
    ({gap label: the effect the claim predicts, nats}) also the seeds that would resolve the claim's
    own effect at that spread, the number a rerun's scale is chosen by."""
    effects = effects or {}
    rows = []
    for label, iv in gaps.items():
        if iv is None or iv.n < 2:
            continue
        sd = statistics.stdev(iv.values)
        need = seeds_to_resolve(iv)
        row = (f"| {label} | {iv.mean:+.4f} | {sd:.4f} | {iv.half:.4f} ({iv.n} seeds) | "
               f"{'resolved' if iv.half < abs(iv.mean) else need if need else 'more than 100'} |")
        if effects:
            effect = effects.get(label)
            claimed = None if effect is None else seeds_to_resolve(iv, effect)
            row += (" - |" if effect is None else
                    f" {effect:+.4f}: {'resolvable' if iv.half < abs(effect) else claimed or 'more than 100'} |")
        rows.append(row)
    if not rows:
        return []
    head, rule = "| gap | mean | sd of per-seed differences | 95% half-width | seeds to resolve |", "|---|---|---|---|---|"
    if effects:
        head, rule = head + " the claim's effect: seeds to resolve it |", rule + "---|"
    return ["", "Resolution: the per-seed differences' standard deviation, the 95% half-width it gives, and "
            "the seeds a gap of the measured size would need at that spread (t-interval half-width below "
            "|gap|); a study reruns where the effect its claim predicts exceeds the half-width"
            + (" (last column: the claim's own effect, 'resolvable' when this many seeds already resolve it)"
               if effects else "") + ".", "", head, rule, *rows]


def report(run_dirs: list[Path], out_dir: Path, *, title: str = "fp4lab",
           baseline: str | None = None) -> tuple[str, list[Path]]:
    """Write report.md (and the plots) into out_dir -> (the markdown, the files written)."""
    receipts = load_receipts(run_dirs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = runs_by_arm(receipts)
    base = baseline_arm(runs, baseline)
    baselines = {arm: base for arm in runs}
    env = receipts[0]
    split = env.data.split
    header = (f"# {title}\n\n{len(receipts)} runs; {provenance(receipts)}; torch {env.versions['torch']}; "
              f"data {env.data.source} "
              f"({env.data.tokens:,} tokens, sha256 {str(env.data.identity.get('sha256'))[:12]}"
              + (f"; validation: {split['val_docs']} held-out documents, {split['val_tokens']:,} tokens" if split
                 else "") + ")\n\n"
              + (f"Gaps are paired by seed against arm `{base}`." if base else "No BF16 arm: no gaps.") + "\n\n")
    gaps = {f"{arm} - {base}": paired_gap(runs[arm], runs[base]) for arm in runs if base and arm != base}
    text = (header + arm_table(runs, baselines) + "\n" + "\n".join(resolution_lines(gaps) + served_lines(runs, baselines))
            + "\n\nEvery run:\n\n" + gap_table(receipts, baselines) + "\n")
    (out_dir / "report.md").write_text(text)
    return text, [out_dir / "report.md"] + plots(receipts, out_dir, title, baselines)
