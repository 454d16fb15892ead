"""A study: a published FP4 finding as data (arms = recipe diffs), run on one data stream, judged.

    Arm      a name, a recipe preset, dotted recipe overrides, TrainConfig overrides, and the arm
             it is compared with (its baseline: by default the study's plain BF16 arm)
    Scale    the budget: TrainConfig fields per model size (dense, deep, moe), and the seeds
    Study    the claim (with its source), the arms, the model size, extra comparisons, and the
             verdict: a function of the runs (``StudyRuns``) -> (what we measured, verdict)

Every comparison is paired: the arms of one seed share the initial weights, the data order and
the recipe's random bits, so a gap is the mean over seeds of per-seed differences, reported
with its 95% t-interval (train.stats). A verdict is "reproduced" only when the interval lies
on the side the claim predicts, "contradicted" when it lies on the other, and "not resolved"
otherwise (including a single seed); "not run" while arms are missing.

``run_study(study, scale, out)`` trains every (arm, seed) into ``out/<arm>-seed<k>``: a run whose
receipt already exists with the same configuration is kept, a run stopped part-way resumes
from its checkpoint, so an interrupted study continues where it stopped and can be spread
over several sessions; a finished run of other settings is refused unless ``replace`` (another
scale's results are not overwritten by mistake); ``jobs`` runs at a time on each visible GPU, in
subprocesses (small models leave a GPU mostly idle; on a host of several GPUs each run is pinned
to one card). ``write_report(study, out)`` rebuilds, from the receipts alone, report.md (the verdict,
the arms with their paired gaps, the extra comparisons, every run), headline.json and the plots.

Public: ``Arm``, ``Scale``, ``Study``, ``StudyRuns``, ``Verdict``, ``arm_configs``, ``run_study``,
``load_study``, ``write_report``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import re
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..nn import model_config
from ..nn.moe import steps_keep_counts
from ..nn.recipe import HadamardMode, Recipe
from ..train.checkpoint import CheckpointError
from ..train.corpus import CORPORA, default_dataset
from ..train.config import config_identity
from ..train.loop import TrainConfig, train
from ..train.receipt import Receipt
from ..train.run import graph_refusal, recipe_of
from ..train.report import (arm_table, final_loss, gap_table, load_receipts, paired_gap, plots, provenance,
                            resolution_lines, runs_by_arm, served_lines)
from ..train.stats import Interval, interval

SIZES = ("dense", "deep", "moe")


@dataclass(frozen=True, kw_only=True)
class Arm:
    name: str
    recipe: str = "bf16"
    """A recipe preset (nn.recipe.PRESETS)."""
    recipe_overrides: dict = field(default_factory=dict)
    """Dotted recipe keys, e.g. {"wgrad.hadamard": "deterministic"}."""
    train: dict = field(default_factory=dict)
    """TrainConfig fields, e.g. {"expert_opt": "muon"}."""
    baseline: str | None = None
    """The arm this one's gap is taken to (None: the study's plain BF16 arm)."""

    @property
    def bf16(self) -> bool:
        """The plain BF16 baseline: no quantization and no training change."""
        return self.recipe == "bf16" and not self.recipe_overrides


@dataclass(frozen=True, kw_only=True)
class Scale:
    name: str
    dense: dict
    """TrainConfig fields for dense-model studies (d6 at GPU scales)."""
    moe: dict
    """TrainConfig fields for MoE studies."""
    deep: dict | None = None
    """TrainConfig fields for the deeper dense model (d12 at GPU scales); None: as ``dense``."""
    seeds: tuple[int, ...] = (0,)
    where: str = "cpu"
    """What it is sized for (cpu, one H100, ...), for --list."""
    minutes_per_run: dict = field(default_factory=lambda: {"dense": 0.05, "deep": 0.05, "moe": 0.1})
    """Rough minutes per run by model size where it is sized for: --list multiplies it out."""
    graph: bool = False
    """On a CUDA device, replay each run's steps from a CUDA graph where the run allows it
    (train.run.graph_refusal: one process, no FP4 experts): the same steps at about twice a small
    model's tokens/s. Not part of a run's identity, so graphed and eager runs pair and skip alike;
    ``--set cuda_graph=false`` keeps every run eager, ``--set cuda_graph=true`` graphs the runs
    that allow it at any scale."""

    def config(self, size: str) -> dict:
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; expected one of {SIZES}")
        if size == "moe":
            return self.moe
        return self.deep if size == "deep" and self.deep is not None else self.dense


Verdict = tuple[str, str]
"""(what we measured, in words and numbers; "reproduced" / "not resolved" / "contradicted" / "not run")."""


class StudyRuns:
    """The finished runs of a study, {arm: {seed: receipt}}, with paired comparisons."""

    def __init__(self, runs: dict[str, dict[int, Receipt]]):
        self.runs = runs

    def has(self, *arms: str) -> bool:
        return all(a in self.runs for a in arms)

    def missing(self, *arms: str) -> Verdict:
        gone = [a for a in arms if a not in self.runs]
        return f"incomplete: needs finished runs of {', '.join(gone)}", "not run"

    def gap(self, arm: str, base: str) -> Interval | None:
        """Paired final-loss gap arm - base over their shared seeds (None: no finite pair)."""
        return paired_gap(self.runs[arm], self.runs[base])

    def contrast(self, weights: dict[str, float], value: Callable[[Receipt], float] = final_loss) -> Interval | None:
        """Mean over seeds of sum_a weights[a] * value(run of a), with its interval; seeds missing
        an arm or holding a diverged run are left out."""
        seeds = set.intersection(*(set(self.runs[a]) for a in weights))
        per_seed = {s: sum(w * value(self.runs[a][s]) for a, w in weights.items()) for s in sorted(seeds)}
        per_seed = {s: v for s, v in per_seed.items() if math.isfinite(v)}
        return interval(per_seed) if per_seed else None

    def diverged(self) -> list[str]:
        """Arms with at least one diverged (or non-finite) run."""
        return [a for a, seeds in self.runs.items() if any(not math.isfinite(final_loss(r)) for r in seeds.values())]

    def finals(self) -> dict[str, list[float]]:
        return {arm: [final_loss(seeds[s]) for s in sorted(seeds)] for arm, seeds in self.runs.items()}


@dataclass(frozen=True, kw_only=True)
class Study:
    name: str
    title: str
    claim: str
    """The published finding, with numbers."""
    source: str
    arms: tuple[Arm, ...]
    size: str = "dense"
    """Which model of the scale the study trains: dense, deep or moe."""
    train: dict = field(default_factory=dict)
    """TrainConfig fields every arm shares (e.g. stiction sampling)."""
    comparisons: tuple[tuple[str, str], ...] = ()
    """(arm, baseline) pairs reported beside each arm's own baseline, e.g. an FP4 arm with a gain
    against plain BF16 as well as against BF16 with the same gain."""
    verdict: Callable[[StudyRuns], Verdict]
    """The runs -> Verdict (paired intervals; see the module doc)."""
    effects: dict[str, float] = field(default_factory=dict)
    """{'arm - base': the gap in nats the claim reports} for claims that give one: the report says
    how many seeds would resolve that effect at the measured paired spread (how a rerun's scale and
    seed count are chosen; the source's effect at its own scale, a target rather than a prediction)."""

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        if self.size not in SIZES:
            raise ValueError(f"study {self.name}: size must be one of {SIZES}, got {self.size!r}")
        for arm in self.arms:
            if arm.baseline is not None and arm.baseline not in names:
                raise ValueError(f"study {self.name}: arm {arm.name}'s baseline {arm.baseline!r} is not an arm")
        for pair in self.comparisons:
            if not set(pair) <= set(names):
                raise ValueError(f"study {self.name}: comparison {pair} names an unknown arm")
        for label in self.effects:
            pair = label.split(" - ")
            if len(pair) != 2 or not set(pair) <= set(names):
                raise ValueError(f"study {self.name}: effect {label!r} is not an 'arm - base' pair of its arms")

    @property
    def moe(self) -> bool:
        return self.size == "moe"

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def baselines(self) -> dict[str, str | None]:
        """{arm: the arm its gap is taken to}; plain BF16 arms are their own (no gap)."""
        plain = next((a.name for a in self.arms if a.bf16), None)
        return {a.name: a.baseline or (a.name if a.bf16 else plain) for a in self.arms}


def arm_configs(study: Study, scale: Scale, out: Path, *, seeds: tuple[int, ...] | None = None,
                arms: tuple[str, ...] | None = None, **changes: Any) -> list[TrainConfig]:
    """One TrainConfig per (seed, arm), seed-major (``arms``: a subset, e.g. the baseline and one
    FP4 arm first; ``changes``: TrainConfig fields for all)."""
    unknown = set(arms or ()) - {a.name for a in study.arms}
    if unknown:
        raise ValueError(f"study {study.name} has no arm {sorted(unknown)}; arms: "
                         + ", ".join(a.name for a in study.arms))
    owned = {"seed": "use --seeds", "out": "use --out", "recipe": "arms choose recipes",
             "recipe_overrides": "arms choose recipes", "progress": "the runner sets it"}
    for key in changes:
        if key in owned:
            raise ValueError(f"{key} is set by the study runner, not by --set ({owned[key]})")
        if key not in {f.name for f in dataclasses.fields(TrainConfig)}:
            raise ValueError(f"unknown training setting {key!r}; TrainConfig has: "
                             + ", ".join(sorted(f.name for f in dataclasses.fields(TrainConfig))))
    changes = dict(changes)
    asked = changes.pop("cuda_graph", None)  # True or the scale's default: only where a run allows it
    graph = asked if asked is not None else scale.graph and torch.cuda.is_available()
    base = {**scale.config(study.size), **study.train, **changes}
    configs = []
    for seed in seeds or scale.seeds:
        for arm in study.arms:
            if arms and arm.name not in arms:
                continue
            overrides = {**arm.recipe_overrides, "seed": seed}
            cfg = TrainConfig(**{**base, **arm.train}, out=str(Path(out) / f"{arm.name}-seed{seed}"),
                              recipe=arm.recipe, recipe_overrides=overrides, seed=seed, progress=False)
            configs.append(dataclasses.replace(cfg, cuda_graph=True) if graph and _graphable(cfg) else cfg)
    return configs


def _graphable(cfg: TrainConfig) -> bool:
    # the trainer's rule (train.run.setup), before a model exists: an MoE model's experts run the
    # recipe unless it quantizes nothing (nn.swap); BF16 experts keep their counts on the device
    # where torch._grouped_mm runs, FP4 experts where nn.gemms.counts_stay_on_device allows it,
    # before and after any late switch (GroupedExperts.counts_on_device). An FP4 recipe may keep
    # some blocks' experts in BF16, so those need torch._grouped_mm as well
    mcfg, recipe = model_config(cfg.model, **cfg.model_overrides), recipe_of(cfg)
    dims = (torch.device("cuda"), mcfg.dim, mcfg.moe.expert_hidden) if mcfg.moe else ()
    host_counts = mcfg.moe is not None and not (steps_keep_counts(None, *dims) and (
        not recipe.quantized or steps_keep_counts(recipe, *dims)))
    return cfg.grad_accum == 1 and graph_refusal(host_counts=host_counts) is None


def _identities(receipt: Receipt, cfg: TrainConfig) -> tuple[dict, dict]:
    """(the settings the run was made with, the settings cfg asks for), comparable as JSON."""
    # a field added to TrainConfig after the run was made reads as its default; where a run was
    # written (and how it was driven) is not part of it, so a study can reuse another's runs
    ran = config_identity({**TrainConfig().to_dict(), **receipt.config})
    return json.loads(json.dumps(ran)), json.loads(json.dumps(cfg.identity()))


def _same_config(receipt: Receipt, cfg: TrainConfig) -> bool:
    """Made with cfg's settings: the same recipe name and overrides, or another arm's run of the
    same arithmetic (fidelity's mxfp4_hadamard serves as wgrad-interventions' det_hadamard,
    gap-closers' late_bf16_all as nvidia-ablation's bf16_late), the other settings equal."""
    ran, wanted = _identities(receipt, cfg)
    if ran == wanted:
        return True
    named = ("recipe", "recipe_overrides")
    rest = [{k: v for k, v in d.items() if k not in named} for d in (ran, wanted)]
    return rest[0] == rest[1] and _trains_as(receipt, recipe_of(cfg))


def _trains_as(receipt: Receipt, recipe: Recipe) -> bool:
    """The receipt's run trained with this recipe's arithmetic, whatever either is named (the receipt
    stores the recipe it resolved; fields added since read as their defaults)."""
    try:
        ran = Recipe.from_dict(receipt.recipe)
    except (TypeError, ValueError):  # a recipe of fields since renamed: not provably the same
        return False
    return _arithmetic(ran) == _arithmetic(recipe)


def _arithmetic(recipe: Recipe) -> dict:
    """What a run of the recipe computes: its fields less the name, and less the Hadamard size of a
    GEMM that rotates nothing (fidelity's mxfp4 and gemm-progression's fprop_dgrad_wgrad differ only
    there)."""
    data = {**recipe.to_dict(), "name": None}
    for gemm in ("fprop", "dgrad", "wgrad"):
        if data[gemm]["hadamard"] == HadamardMode.NONE.value:
            data[gemm] = {**data[gemm], "hadamard_size": None}
    return data


def _finished(cfg: TrainConfig) -> Receipt | None:
    """The finished run (ok or diverged) in cfg.out, whatever its settings; None if there is none."""
    path = Path(cfg.out) / "receipt.json"
    if not path.is_file():
        return None
    receipt = Receipt.load(path)
    return receipt if receipt.status in ("ok", "diverged") else None


def _done(cfg: TrainConfig) -> bool:
    receipt = _finished(cfg)
    return receipt is not None and _same_config(receipt, cfg)


def _refuse_replacing(clashes: list[tuple[TrainConfig, Receipt]]) -> None:
    """Finished runs of other settings where runs are to go (another scale's, a committed result)
    are not overwritten unless asked: a clear error naming the first difference, nothing lost."""
    if not clashes:
        return
    cfg, receipt = clashes[0]
    ran, wanted = _identities(receipt, cfg)
    diff = next((k for k in sorted(set(ran) | set(wanted)) if ran.get(k) != wanted.get(k)), "?")
    raise ValueError(f"{cfg.out} holds a finished run of other settings ({diff} {ran.get(diff)!r}, "
                     f"wanted {wanted.get(diff)!r}; {len(clashes)} such runs in all): pass another --out, "
                     "or --replace to rerun them over it")


def _failed(cfg: TrainConfig, err: BaseException) -> str:
    return f"{cfg.out}: FAILED ({type(err).__name__}: {err})"


def _run_one(cfg: TrainConfig) -> str:
    # a run cut off part-way (a stopped call, a lost machine) continues from its checkpoint; the
    # checkpoint's identity check refuses one of another configuration, which then starts over
    ckpt = Path(cfg.out) / "checkpoint"
    try:  # one failed run (out of memory, bad data), resuming or not, must not stop the others
        receipt = None
        if ckpt.exists():
            try:
                receipt = train(cfg, resume=True)
            except CheckpointError as err:
                print(f"{cfg.out}: not resuming ({err}); starting over", flush=True)
        receipt = receipt or train(cfg, overwrite=True)  # a run of another config, or one that failed
    except Exception as err:  # noqa: BLE001
        return _failed(cfg, err)
    return f"{cfg.out}: {receipt.status}, final val {receipt.final.val_loss}"


# how a run that could not get GPU memory fails: torch's allocator, a CUDA call, cuBLAS's handle
_NO_MEMORY = ("OutOfMemoryError", "out of memory", "ALLOC_FAILED")


def _out_of_memory(line: str) -> bool:
    return ": FAILED (" in line and any(sign in line for sign in _NO_MEMORY)


_BYTES = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"([\d.]+) (bytes|KiB|MiB|GiB)"  # torch's format_size


def _crowded_by_others(line: str) -> bool:
    """Out of memory while other processes held at least what the run asked for: torch's message
    names this process ("this process has ...") and each other one ("Process 1964 has 19.77 GiB
    memory in use"), e.g. another study's runs on the same GPU. A message that cannot tell this
    process from the others (a container whose process ids differ from the driver's) is not
    counted as crowded: such a run fails as before instead of waiting."""
    asked = re.search(r"Tried to allocate " + _SIZE, line)
    if not (_out_of_memory(line) and asked and "this process has" in line):
        return False
    others = sum(float(n) * _BYTES[unit] for n, unit in re.findall(r"Process \d+ has " + _SIZE + " memory in use", line))
    return others >= float(asked[1]) * _BYTES[asked[2]]


# a run that met other processes' memory waits for them, this long between tries, this many times
CROWD_WAIT_S, CROWD_TRIES = 60.0, 20


def _run_alone(cfg: TrainConfig, note: Callable[[str], None]) -> str:
    """One run, the only one this runner has going. Out of memory beside another process's runs
    (which this runner cannot make fewer), it waits for them and tries again: a run is lost only
    when the card stays full for CROWD_TRIES x CROWD_WAIT_S, or when it runs out of memory alone."""
    line = _run_one(cfg)
    for _ in range(CROWD_TRIES):
        if not _crowded_by_others(line):
            break
        note(f"{cfg.out}: out of memory beside other processes' runs; trying again in {CROWD_WAIT_S:.0f} s")
        time.sleep(CROWD_WAIT_S)
        line = _run_one(cfg)
    return line


def _gpu_slots(jobs: int) -> list[str | None]:
    """One entry per worker: the card it trains on, as a CUDA_VISIBLE_DEVICES value, ``jobs`` per
    visible GPU, interleaved so that the first runs spread over the cards; with fewer than two GPUs,
    ``jobs`` unpinned workers (None). A parent's CUDA_VISIBLE_DEVICES list is kept: its entries
    (indices or UUIDs) are what the workers are pinned to."""
    count = torch.cuda.device_count()
    if count < 2:
        return [None] * jobs
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cards = [c.strip() for c in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
    return [card for _ in range(jobs) for card in cards]


def _run_on(cfg: TrainConfig, card: str | None) -> str:
    if card is not None:  # a fresh worker process: pinned before its first CUDA call
        os.environ["CUDA_VISIBLE_DEVICES"] = card
        # any CUDA call before this one (is_available() too) fixed the cards this process sees:
        # then it sees them all, and the run would land on the first
        if torch.cuda.device_count() != 1:
            return _failed(cfg, RuntimeError(f"the worker saw {torch.cuda.device_count()} cards when pinned to "
                                             f"card {card}: CUDA was set up before the pin"))
    return _run_one(cfg)


def _run_pooled(todo: list[TrainConfig], slots: list[str | None], done: Callable[[str], None],
                note: Callable[[str], None]) -> list[TrainConfig]:
    """Train ``todo``, one run per slot at once (``_gpu_slots``), each in a process of its own (it
    exits with its run and hands its GPU memory back; a worker that crashes breaks its own pool,
    not the other runs'); a run starts on the card whose run just ended -> the runs that ran out
    of memory beside the others, for another round with fewer at once."""
    if not slots:
        raise ValueError("_run_pooled needs at least one slot")
    crowded, queue, free, running = [], list(todo), list(slots), {}
    spawn = multiprocessing.get_context("spawn")
    try:
        while queue or running:
            while queue and free:
                cfg, card = queue.pop(0), free.pop(0)
                pool = ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1)
                running[pool.submit(_run_on, cfg, card)] = cfg, card, pool
            for future in wait(running, return_when=FIRST_COMPLETED).done:
                cfg, card, pool = running.pop(future)
                pool.shutdown(wait=True)  # its one task is done: the worker exits, its GPU memory with it
                free.append(card)
                try:
                    line = future.result()
                except Exception as err:  # noqa: BLE001 -- the worker died (killed, crashed): report, don't hang
                    line = _failed(cfg, err)
                if _out_of_memory(line):
                    crowded.append(cfg)
                    note(f"{cfg.out}: out of memory beside other runs; tried again with fewer at once")
                else:
                    done(line)
    finally:  # interrupted: let go of the runs still going (each resumes from its checkpoint later)
        for _, _, pool in running.values():
            pool.shutdown(wait=False, cancel_futures=True)
    return crowded


def run_study(study: Study, scale: Scale, out: Path, *, seeds: tuple[int, ...] | None = None,
              arms: tuple[str, ...] | None = None, jobs: int = 1, replace: bool = False,
              **changes: Any) -> list[TrainConfig]:
    """Train every missing (arm, seed) run, ``jobs`` at once on each visible GPU -> the configs
    asked for. A run that fails is reported (a FAILED line) and the others go on; runs that ran
    out of memory beside others get further rounds with half as many at once per card, and one at
    a time, a run crowded out by another process's runs waits for them (_run_alone); raises
    RuntimeError at the end naming the failures.
    A finished run of other settings in a run's folder is refused (ValueError) unless ``replace``."""
    configs = arm_configs(study, scale, out, seeds=seeds, arms=arms, **changes)
    finished = {c.out: _finished(c) for c in configs}  # each receipt read once
    todo = [c for c in configs if finished[c.out] is None or not _same_config(finished[c.out], c)]
    if not replace:
        _refuse_replacing([(c, finished[c.out]) for c in todo if finished[c.out] is not None])
    for source, vocab, max_bytes in {(c.data, c.vocab_size, c.data_max_bytes) for c in todo if c.data in CORPORA}:
        default_dataset(source, vocab_size=vocab, max_bytes=max_bytes)  # built once, before any worker starts
    bar = tqdm(total=len(configs), initial=len(configs) - len(todo), desc=study.name, unit="run")
    failed = []

    def done(line: str) -> None:
        bar.write(line)
        bar.update(1)
        if ": FAILED (" in line:
            failed.append(line)
    pending, alone = todo, False
    while pending:
        slots = _gpu_slots(jobs)
        if not alone and len(slots) > 1 and len(pending) > 1:
            pending = _run_pooled(pending, slots, done, bar.write)
            alone = jobs == 1  # one run per card met the crowd too: one at a time from here
            jobs = max(1, jobs // 2)  # a run that failed fast freed its slot for the next, which met
            # the same crowd: each round halves the runs at once per card, down to one at a time
        else:
            for cfg in pending:
                done(_run_alone(cfg, bar.write))
            pending = []
    bar.close()
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(todo)} runs failed:\n" + "\n".join(failed))
    return configs


# settings that may differ between the runs of one study: the arm's own, the seed, the folder
_PER_RUN = {"seed", "out", "recipe", "recipe_overrides", "progress"}


def load_study(study: Study, out: Path) -> dict[str, dict[int, Receipt]]:
    """{arm: {seed: receipt}} of the runs found on disk (arms with no finished run are left out).
    Runs made at another scale or with other --set values (left in the same folder) are refused
    with the settings that differ, never averaged in."""
    found = {}
    for arm in study.arms:
        runs = sorted(Path(out).glob(f"{arm.name}-seed*/receipt.json"))
        finished = [r for r in load_receipts(runs) if r.status != "stopped"]  # a stopped run is no result yet
        if finished:
            found.update(runs_by_arm(finished))
    for arm in study.arms:  # a folder named after an arm must hold that arm's recipe (or its arithmetic)
        for receipt in found.get(arm.name, {}).values():
            ran = (receipt.config["recipe"],
                   {k: v for k, v in receipt.config["recipe_overrides"].items() if k != "seed"})
            if ran != (arm.recipe, arm.recipe_overrides) and not _trains_as(receipt, recipe_of(TrainConfig(
                    recipe=arm.recipe, recipe_overrides={**arm.recipe_overrides, "seed": receipt.seed}))):
                raise ValueError(f"{out}: {receipt.name} ran recipe {ran[0]} with {ran[1]}, but arm {arm.name} "
                                 f"is {arm.recipe} with {arm.recipe_overrides} (a run of an older definition?)")
    shared = {}
    for arm in study.arms:
        for receipt in found.get(arm.name, {}).values():
            # how a run was driven (graphed, compiled, deterministic, ...) is not what it is
            config = {k: v for k, v in config_identity(receipt.config).items()
                      if k not in _PER_RUN and k not in arm.train}
            for key, value in config.items():
                first = shared.setdefault(key, (value, receipt.name))
                if first[0] != value:
                    raise ValueError(f"{out}: runs of different settings in one folder: {key} is {first[0]!r} in "
                                     f"{first[1]} but {value!r} in {receipt.name} (another --scale or --set?); "
                                     "use a fresh --out per scale")
    return {a.name: found[a.name] for a in study.arms if a.name in found}


def _scale_line(runs: dict[str, dict[int, Receipt]]) -> str:
    first = next(iter(next(iter(runs.values())).values()))
    model, cfg, data = first.model, first.config, first.data
    tokens = first.final.steps * cfg["batch_size"] * cfg["seq_len"]
    split = data.split
    moe = (f", MoE {model['moe']['n_experts']} experts top-{model['moe']['top_k']}" if model.get("moe") else "")
    val = (f"; validation {split['val_tokens']:,} tokens in {split['val_docs']} held-out documents" if split
           else "; validation: the corpus tail (receipts before the document split)")
    epochs = f", {data.epochs:.2f} epochs" if data.epochs is not None else ""
    seeds = sorted({s for seeds in runs.values() for s in seeds})
    return (f"Scale: {model['depth']} blocks, D = {model['dim']}{moe}, {first.params:,} parameters; "
            f"{first.final.steps} steps of {cfg['batch_size']} x {cfg['seq_len']} = {tokens:,} tokens{epochs}; "
            f"data {data.source} ({data.tokens:,} tokens){val}; "
            f"{provenance([r for arm in runs.values() for r in arm.values()])}; seeds {seeds}.")


def _pairs(study: Study, baselines: dict, runs: dict) -> list[tuple[str, tuple[str, str]]]:
    pairs = [(a, b) for a, b in baselines.items() if b not in (None, a)] + list(study.comparisons)
    return [(f"{a} - {b}", (a, b)) for a, b in dict.fromkeys(pairs) if a in runs and b in runs]


def write_report(study: Study, out: Path) -> tuple[str, list[Path]]:
    """report.md (+ plots, headline.json) from the receipts under ``out`` -> (the markdown, files)."""
    out = Path(out)
    runs = load_study(study, out)
    if not runs:
        raise FileNotFoundError(f"{out}: no finished runs of study {study.name!r}")
    measured, verdict = study.verdict(StudyRuns(runs))
    baselines = study.baselines()
    lines = [f"# {study.name}: {study.title}", "", _scale_line(runs), "",
             "Gaps are paired by seed (mean of per-seed differences, 95% t-interval; % of the baseline's loss). "
             "A verdict is 'reproduced' only when the interval lies on the claimed side.", "",
             "| claim | measured | verdict |", "|---|---|---|",
             f"| {study.claim} ({study.source}) | {measured} | {verdict} |", "",
             arm_table(runs, baselines)]
    for arm in study.arms:
        if arm.name not in runs:
            lines.append(f"| {arm.name} | {arm.recipe} | 0 | not run | {baselines[arm.name]} | - | - |")
    intervals = {}
    for arm, base in [(a, b) for a, b in baselines.items() if b not in (None, a)] + list(study.comparisons):
        if arm in runs and base in runs:
            iv = paired_gap(runs[arm], runs[base])
            intervals[f"{arm} - {base}"] = iv.to_dict() if iv is not None else None
    if study.comparisons:
        lines += ["", "| comparison | paired gap, nats [95% CI] (%) |", "|---|---|"]
        for arm, base in study.comparisons:
            iv = paired_gap(runs[arm], runs[base]) if arm in runs and base in runs else None
            lines.append(f"| {arm} - {base} | {iv.text() if iv is not None else 'not run'} |")
    lines += resolution_lines({k: paired_gap(runs[a], runs[b]) for k, (a, b) in _pairs(study, baselines, runs)},
                              study.effects)
    lines += served_lines(runs, baselines)
    receipts = [r for seeds in runs.values() for r in seeds.values()]
    # a campaign runs several at once on a card, and one alone at the end runs faster: the x
    # column is a speed ratio only between runs that shared their cards alike
    lines += ["", "Every run (tokens/s as each ran, beside the others sharing its card):", "",
              gap_table(receipts, baselines), ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    finals = StudyRuns(runs).finals()
    (out / "headline.json").write_text(json.dumps({
        "study": study.name, "claim": study.claim, "source": study.source, "measured": measured,
        "verdict": verdict, "gaps": intervals,
        "finals": {a: [v if math.isfinite(v) else None for v in vals] for a, vals in finals.items()},
        "mean_finals": {a: statistics.fmean(v) if all(map(math.isfinite, v)) else None for a, v in finals.items()}},
        indent=1))
    files = [out / "report.md", out / "headline.json"] + plots(receipts, out, study.name, baselines)
    return text, files
