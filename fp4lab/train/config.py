"""``TrainConfig``: every setting of one training run, checked when it is made.

A config comes from Python, a TOML file (``fp4lab train --config``) or ``--set key=value``
pairs (``with_overrides``), so a value may arrive with the wrong type (``--set steps=abc``).
Each field is checked against its annotation and its range when the config is built: a wrong
type or value is a ValueError naming the setting and what it must be, before any data is read
(an int is taken where a float is due; a bool is never taken as a number). ``model`` must name
a preset, ``model_overrides`` are checked the same way against nn.ModelConfig's fields, the
optimizers and schedule against train.optim's, and ``parallel`` against train.parallel's.

Public: ``TrainConfig``, ``config_identity``, ``check_types``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..typecheck import field_types, fits, type_name


_NOT_IDENTITY = ("out", "progress", "ckpt_every", "compile", "cpp_wrapper", "cuda_graph", "deterministic", "stop_at",
                 "threads", "parallel")


def config_identity(values: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig.identity of a config as plain data (e.g. a receipt's)."""
    return {k: v for k, v in values.items() if k not in _NOT_IDENTITY}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    out: str = "runs/run"
    """Run directory (receipt, metrics, checkpoint)."""
    model: str = "tiny"
    """nn.MODEL_PRESETS name."""
    model_overrides: dict = field(default_factory=dict)
    """ModelConfig fields to replace, e.g. {"depth": 4}."""
    recipe: str = "bf16"
    """nn.recipe preset name or a .toml / .json recipe file."""
    recipe_overrides: dict = field(default_factory=dict)
    """Dotted recipe keys to replace, e.g. {"wgrad.hadamard": "random"}."""
    data: str = "stdlib"
    """A built-in corpus ("python", "stdlib", "code"), a directory / file of token shards, or text to
    tokenize: a .txt / .md / .jsonl / .py / .rst file or a directory of them (cached by identity)."""
    data_max_bytes: int | None = None
    """Built-in corpora only: use the first files holding this many bytes (CPU runs)."""
    vocab_size: int = 8192
    """BPE size when the built-in corpus is tokenized."""
    steps: int = 200
    batch_size: int = 16
    """Sequences per optimizer step (global: over ranks and micro-batches)."""
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 3e-3
    """AdamW learning rate (dense lane and embeddings unless set apart)."""
    embed_lr: float | None = None
    muon_lr: float = 0.02
    dense_opt: str = "adamw"
    expert_opt: str = "adamw"
    weight_decay: float = 0.0
    warmup: int = 20
    schedule: str = "cosine"
    final_lr: float = 0.1
    """Final learning rate as a fraction of the peak."""
    clip: float = 1.0
    threads: int = 1
    """CPU runs: torch's intra-op threads (0: every core). One by default: on a 2-core machine two
    threads are 1.7x faster idle but 5.4x slower beside a second job on the FP4 reference path
    (benchmarks/results/cpu_threads.json), and one thread gives the same bits under any load.
    Restored when the run ends; GPU runs leave it alone."""
    eval_every: int = 50
    eval_batches: int = 8
    """Batches of each evaluation before the last; the final one covers the whole split."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (data.split_documents)."""
    log_every: int = 10
    ckpt_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    stop_at: int | None = None
    """Stop after this step with a checkpoint, as a preempted or time-boxed job would; the
    schedule still spans ``steps``, so ``--resume`` continues the same run."""
    diverge_loss: float = 20.0
    seed: int = 0
    parallel: str = "ddp"
    """Under torchrun: "ddp" replicates the model on every rank (DistributedDataParallel), "fsdp"
    shards parameters, gradients and optimizer state per block (FSDP2; train.parallel). One
    process trains the whole model: "fsdp" there is an error."""
    compile: bool = False
    """torch.compile the model: the FP4 GEMMs are custom ops (nn.ops), so a dense model is one graph
    that serves every step without recompiling. An MoE model is one graph too where its experts keep
    the routing's counts on the device (BF16 experts on torch._grouped_mm; FP4 experts on CUDA,
    under a recipe nn.gemms.counts_stay_on_device admits); elsewhere reading the counts on the host
    breaks the graph at each MoE block. On CUDA the run's seeds go in a SeedTable
    (train.run.seeds_on_device), so a dense FP4 layer takes the traced ops where nn.ops.traceable
    allows (Inductor makes their kernel launches)."""
    cpp_wrapper: bool = False
    """With compile: Inductor's C++ wrapper launches the compiled graph's kernels from C++ rather than
    from its generated Python, which a compiled FP4 step's thousand launches wait on (d12 on an
    H100: 1.41x of compiled BF16 with the Python wrapper, 1.33x with this; benchmarks/NOTES.md,
    twenty-ninth session). The first steps compile for several minutes longer. Same math."""
    cuda_graph: bool = False
    """Replay each step's forward and backward from one CUDA graph (train.graphed), the step's seeds
    read from device memory (nn.seeds); clipping, the divergence check and the optimizers stay
    eager, so the bits are the eager run's. One CUDA process, grad_accum 1, a dense model or experts
    that keep the routing's counts on the device (BF16 ones on torch._grouped_mm, FP4 ones under a
    recipe nn.gemms.counts_stay_on_device admits, compiled or not; train.run.graph_refusal);
    captured again after a late switch to BF16."""
    deterministic: bool = False
    """Same bits on every rerun of a GPU run: torch.use_deterministic_algorithms for the run
    (restored when it ends) and cuBLAS's fixed workspaces (CUBLAS_WORKSPACE_CONFIG, set for the
    process if unset; cuBLAS reads it once, so it holds where the process ran no GEMM before, as
    in `fp4lab train` and the study runner's processes). By default two runs of one config on a
    GPU part within a few steps: the attention backward PyTorch picks on an H100 (cuDNN's)
    accumulates in an order that varies at large batches. Slower; the math is the same, so not
    part of a run's identity. CPU runs are deterministic either way."""
    progress: bool = True
    stiction_every: int = 0
    """Every N steps, measure the fraction of FP4 weight codes each optimizer step flips
    (nn.diagnostics.StictionMeter; costs one weight quantization per layer). 0: never."""

    def __post_init__(self) -> None:
        check_types({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, TrainConfig,
                    what="training setting")
        for name, (allowed, rule) in _RANGES.items():
            value = getattr(self, name)
            if value is not None and not allowed(value):
                raise ValueError(f"training setting {name}={value!r} must be {rule}")
        # imported here (torch): what a config names is checked where it is made, so a file's error names the file
        from ..nn.model import MODEL_PRESETS, ModelConfig
        from .optim import OPTIMIZERS, SCHEDULES
        from .parallel import PARALLEL
        if self.dense_opt not in OPTIMIZERS or self.expert_opt not in OPTIMIZERS:
            raise ValueError(f"dense_opt and expert_opt must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.dense_opt!r}, {self.expert_opt!r}")
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"training setting model={self.model!r} must be one of {', '.join(MODEL_PRESETS)}")
        unknown = set(self.model_overrides) - set(field_types(ModelConfig))
        if unknown:
            raise ValueError(f"unknown model setting {', '.join(sorted(unknown))}; "
                             f"fields: {', '.join(field_types(ModelConfig))}")
        check_types(self.model_overrides, ModelConfig, what="model setting")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"training setting schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"training setting parallel={self.parallel!r} must be one of {', '.join(PARALLEL)}")
        if self.cpp_wrapper and not self.compile:
            raise ValueError("training setting cpp_wrapper=true is how a compiled step launches its kernels: it "
                             "needs compile=true (turning compile off, set cpp_wrapper=false too)")
        if self.cuda_graph and self.grad_accum != 1:
            raise ValueError(f"training setting cuda_graph=true replays one micro-batch per step: grad_accum must be 1, "
                             f"got {self.grad_accum}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> dict[str, Any]:
        """The settings that make the run what it is: to_dict without where it is written and how it
        is driven (progress bars, checkpoint cadence, compile and its wrapper, a stop, threads, DDP or
        FSDP). A checkpoint resumes, and a study reuses a finished run, only when these match."""
        return config_identity(self.to_dict())

    def with_overrides(self, changes: dict[str, Any]) -> "TrainConfig":
        """Apply "key=value"-style changes: TrainConfig fields, "model.<field>", "recipe.<dotted>"
        (or "model_overrides.<field>", "recipe_overrides.<dotted>": the spelling of TOML tables)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        direct, model_o, recipe_o = {}, dict(self.model_overrides), dict(self.recipe_overrides)
        for key, value in changes.items():
            head, _, rest = key.partition(".")
            if head in ("model", "model_overrides") and rest:
                model_o[rest] = value
            elif head in ("recipe", "recipe_overrides") and rest:
                recipe_o[rest] = value
            elif key == "model_overrides":  # a whole table replaces the one before
                model_o = value
            elif key == "recipe_overrides":
                recipe_o = value
            elif key in fields:
                direct[key] = value
            else:
                raise ValueError(f"unknown training setting {key!r}; fields: {', '.join(fields)}, "
                                 "or model.<field>, recipe.<dotted key>")
        return dataclasses.replace(self, **direct, model_overrides=model_o, recipe_overrides=recipe_o)


def _at_least(low: float):
    return lambda v: math.isfinite(v) and v >= low


_positive = (lambda v: math.isfinite(v) and v > 0, "positive and finite")
_counts = (_at_least(1), "at least 1")
_off_or_count = (_at_least(0), "0 (off) or more")
# checked when a config is made, so a bad value is refused before any data is read; a None
# (where the field allows it) means "not set"
_RANGES = {"steps": _counts, "batch_size": _counts, "grad_accum": _counts, "seq_len": _counts,
           "vocab_size": _counts, "data_max_bytes": _counts, "eval_batches": _counts, "log_every": _counts,
           "stop_at": _counts, "lr": _positive, "embed_lr": _positive, "muon_lr": _positive,
           "diverge_loss": _positive, "weight_decay": _off_or_count, "final_lr": _off_or_count,
           "clip": _off_or_count, "warmup": (_at_least(0), "0 or more"),
           "threads": (_at_least(0), "0 (all cores) or more"),
           "eval_every": (_at_least(0), "0 (only at the end) or more"),
           "ckpt_every": (_at_least(0), "0 (only at the end) or more"),
           "stiction_every": _off_or_count, "seed": (lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
           "val_fraction": (lambda v: 0 < v < 1, "between 0 and 1 (exclusive)")}


def check_types(values: dict[str, Any], cls: type, *, what: str) -> None:
    """ValueError naming the first of ``values`` whose type does not fit the field of dataclass
    ``cls`` it sets (fields of other types, e.g. nested configs, are left to ``cls``)."""
    hints = field_types(cls)
    for name, value in values.items():
        if name in hints and fits(value, hints[name]) is False:
            raise ValueError(f"{what} {name}={value!r} must be {type_name(hints[name])}, not {type(value).__name__}")
