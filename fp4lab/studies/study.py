"""A study: a published FP4 finding as data (arms = recipe diffs), run on one data stream, judged.

    Arm      a name, a recipe preset, dotted recipe overrides, TrainConfig overrides
    Scale    the budget: TrainConfig fields for dense and for MoE studies, and the seeds
    Study    the claim (with its source), the arms, whether it needs the MoE model, and the
             verdict: a function of {arm: [final val loss per seed]} and the receipts ->
             (what we measured, reproduced?)

``run_study(study, scale, out)`` trains every (arm, seed) into ``out/<arm>-seed<k>`` (a run whose
receipt already exists with the same configuration is kept, so an interrupted study resumes
where it stopped, and runs can be spread over several sessions), optionally ``jobs`` at a time
in subprocesses (small models leave a GPU mostly idle). Every arm of a seed shares the data
order and the initial weights; the seed also seeds the recipe's stochastic rounding and signs.
``write_report(study, out)`` rebuilds, from the receipts alone, report.md (the headline row, a
table of arms with mean and spread over seeds and the gap to the BF16 arm, every run's row) and
the plots of seed 0 (loss.png, gap.png).

Public: ``Arm``, ``Scale``, ``Study``, ``Verdict``, ``arm_configs``, ``run_study``,
``load_study``, ``write_report``.
"""

from __future__ import annotations

import dataclasses

import json
import math
import multiprocessing
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from ..train.corpus import CORPORA, default_dataset
from ..train.loop import TrainConfig, train
from ..train.report import gap_table, load_receipts, plots


@dataclass(frozen=True, kw_only=True)
class Arm:
    name: str
    recipe: str = "bf16"
    """A recipe preset (nn.recipe.PRESETS)."""
    recipe_overrides: dict = field(default_factory=dict)
    """Dotted recipe keys, e.g. {"wgrad.hadamard": "deterministic"}."""
    train: dict = field(default_factory=dict)
    """TrainConfig fields, e.g. {"expert_opt": "muon"}."""

    @property
    def bf16(self) -> bool:
        return self.recipe == "bf16" and not self.recipe_overrides


@dataclass(frozen=True, kw_only=True)
class Scale:
    name: str
    dense: dict
    """TrainConfig fields for dense-model studies."""
    moe: dict
    """TrainConfig fields for MoE studies."""
    seeds: tuple[int, ...] = (0,)
    where: str = "cpu"
    """What it is sized for (cpu, one H100, ...), for --list."""
    minutes_per_run: tuple[float, float] = (0.05, 0.1)
    """Rough minutes per run (dense, MoE) where it is sized for: --list multiplies it out."""


Verdict = tuple[str, str]
"""(what we measured, in words and numbers; "yes" / "no" / "partly")."""


@dataclass(frozen=True, kw_only=True)
class Study:
    name: str
    title: str
    claim: str
    """The published finding, with numbers."""
    source: str
    arms: tuple[Arm, ...]
    moe: bool = False
    """Runs on the MoE model of the scale."""
    train: dict = field(default_factory=dict)
    """TrainConfig fields every arm shares (e.g. stiction sampling)."""
    verdict: Callable[[dict[str, list[float]], dict[str, list[dict]]], Verdict]
    """{arm: final val losses over seeds}, {arm: receipts} -> Verdict."""

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)


def arm_configs(study: Study, scale: Scale, out: Path, *, seeds: tuple[int, ...] | None = None,
                **changes: Any) -> list[TrainConfig]:
    """One TrainConfig per (seed, arm), seed-major (``changes``: TrainConfig fields for all)."""
    owned = {"seed": "use --seeds", "out": "use --out", "recipe": "arms choose recipes",
             "recipe_overrides": "arms choose recipes", "progress": "the runner sets it"}
    for key in changes:
        if key in owned:
            raise ValueError(f"{key} is set by the study runner, not by --set ({owned[key]})")
        if key not in {f.name for f in dataclasses.fields(TrainConfig)}:
            raise ValueError(f"unknown training setting {key!r}; TrainConfig has: "
                             + ", ".join(sorted(f.name for f in dataclasses.fields(TrainConfig))))
    base = {**(scale.moe if study.moe else scale.dense), **study.train, **changes}
    configs = []
    for seed in seeds or scale.seeds:
        for arm in study.arms:
            overrides = {**arm.recipe_overrides, "seed": seed}
            configs.append(TrainConfig(**{**base, **arm.train}, out=str(Path(out) / f"{arm.name}-seed{seed}"),
                                       recipe=arm.recipe, recipe_overrides=overrides, seed=seed, progress=False))
    return configs


def _done(cfg: TrainConfig) -> bool:
    path = Path(cfg.out) / "receipt.json"
    if not path.is_file():
        return False
    receipt = json.loads(path.read_text())
    return receipt["status"] in ("ok", "diverged") and receipt["config"] == json.loads(json.dumps(cfg.to_dict()))


def _run_one(cfg: TrainConfig) -> str:
    receipt = train(cfg)
    return f"{cfg.out}: {receipt['status']}, final val {receipt['final']['val_loss']}"


def run_study(study: Study, scale: Scale, out: Path, *, seeds: tuple[int, ...] | None = None, jobs: int = 1,
              **changes: Any) -> list[TrainConfig]:
    """Train every missing (arm, seed) run -> all the study's configs."""
    configs = arm_configs(study, scale, out, seeds=seeds, **changes)
    todo = [c for c in configs if not _done(c)]
    for source, vocab, max_bytes in {(c.data, c.vocab_size, c.data_max_bytes) for c in todo if c.data in CORPORA}:
        default_dataset(source, vocab_size=vocab, max_bytes=max_bytes)  # built once, before any worker starts
    bar = tqdm(total=len(configs), initial=len(configs) - len(todo), desc=study.name, unit="run")
    if jobs > 1 and len(todo) > 1:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(todo))) as pool:
            for line in pool.imap_unordered(_run_one, todo):
                bar.write(line)
                bar.update(1)
    else:
        for cfg in todo:
            bar.write(_run_one(cfg))
            bar.update(1)
    bar.close()
    return configs


# settings that may differ between the runs of one study: the arm's own, the seed, the folder
_PER_RUN = {"seed", "out", "recipe", "recipe_overrides", "progress"}


def load_study(study: Study, out: Path) -> dict[str, list[dict]]:
    """{arm: receipts over the seeds found on disk} (arms with no finished run are left out).
    Runs made at another scale or with other --set values (left in the same folder) are refused
    with the settings that differ, never averaged in."""
    found = {}
    for arm in study.arms:
        runs = sorted(Path(out).glob(f"{arm.name}-seed*/receipt.json"))
        if runs:
            found[arm.name] = load_receipts(runs)
    shared = {}
    for arm in study.arms:
        for receipt in found.get(arm.name, []):
            config = {k: v for k, v in receipt["config"].items() if k not in _PER_RUN and k not in arm.train}
            for key, value in config.items():
                first = shared.setdefault(key, (value, receipt["name"]))
                if first[0] != value:
                    raise ValueError(f"{out}: runs of different settings in one folder: {key} is {first[0]!r} in "
                                     f"{first[1]} but {value!r} in {receipt['name']} (another --scale or --set?); "
                                     "use a fresh --out per scale")
    return found


def _finals(receipts: list[dict]) -> list[float]:
    """Final val loss per seed; a diverged run (or a non-finite loss) counts as +inf."""
    vals = [r["final"]["val_loss"] if r["status"] == "ok" else None for r in receipts]
    return [v if v is not None and math.isfinite(v) else float("inf") for v in vals]


def _mean_spread(values: list[float]) -> str:
    if any(v == float("inf") for v in values):
        return "diverged"
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def write_report(study: Study, out: Path) -> tuple[str, list[Path]]:
    """report.md (+ plots) from the receipts under ``out`` -> (the markdown, the files written)."""
    out = Path(out)
    runs = load_study(study, out)
    if not runs:
        raise FileNotFoundError(f"{out}: no finished runs of study {study.name!r}")
    finals = {arm: _finals(receipts) for arm, receipts in runs.items()}
    measured, reproduced = study.verdict(finals, runs)
    base = next((a.name for a in study.arms if a.bf16 and a.name in finals), None)
    first = next(iter(runs.values()))[0]
    lines = [f"# {study.name}: {study.title}", "",
             f"Scale: {first['model']['depth']} blocks, D = {first['model']['dim']}"
             + (f", MoE {first['model']['moe']['n_experts']} experts top-{first['model']['moe']['top_k']}"
                if first['model'].get('moe') else "")
             + f"; {first['final']['steps']} steps of {first['config']['batch_size']} x {first['config']['seq_len']}"
             f" tokens; data {first['data']['source']} ({first['data']['tokens']:,} tokens); device {first['device']};"
             f" git {first['git']['sha'][:12]}; seeds {sorted({r['seed'] for rs in runs.values() for r in rs})}.", "",
             "| claim | measured | reproduced? |", "|---|---|---|",
             f"| {study.claim} ({study.source}) | {measured} | {reproduced} |", "",
             "| arm | recipe | final val loss (mean ± sd over seeds) | gap to bf16 | runs |", "|---|---|---|---|---|"]
    for arm in study.arms:
        if arm.name not in finals:
            lines.append(f"| {arm.name} | - | not run | - | 0 |")
            continue
        vals = finals[arm.name]
        gap = "-"
        if base is not None and arm.name != base and float("inf") not in vals + finals[base]:
            gap = f"{statistics.fmean(vals) - statistics.fmean(finals[base]):+.4f}"
        diff = ", ".join(f"{k}={v}" for k, v in {**arm.recipe_overrides, **arm.train}.items())
        lines.append(f"| {arm.name} | {arm.recipe}{' (' + diff + ')' if diff else ''} | {_mean_spread(vals)} | "
                     f"{gap} | {len(vals)} |")
    seed0 = [rs[0] for rs in runs.values()]
    lines += ["", "Every run:", "", gap_table([r for rs in runs.values() for r in rs]), ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    (out / "headline.json").write_text(json.dumps({"study": study.name, "claim": study.claim, "source": study.source,
                                                   "measured": measured, "reproduced": reproduced,
                                                   "finals": finals}, indent=1))
    files = [out / "report.md", out / "headline.json"] + plots(seed0, out, f"{study.name} (seed {seed0[0]['seed']})")
    return text, files

