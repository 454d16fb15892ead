"""A run's setup: ranks, data, model, recipe and optimizers, built in one fixed order.

``setup(cfg)`` -> ``Run``, what a training session holds fixed from its first step to its last
(train.loop advances a RunState against it). The order matters: torch.manual_seed(cfg.seed)
comes after the data (tokenizing may draw random numbers) and before the model, so the
initial weights depend on the seed alone. A setting of the wrong type (a model override; a
recipe file or override of the wrong shape) is a ValueError before the model is built.
Under torchrun (WORLD_SIZE > 1) the process group starts here, and the model is wrapped in
DistributedDataParallel or sharded by FSDP2 (``cfg.parallel``, train.parallel) before the
optimizers are built over its parameters. The data entry of the receipt (receipt.Data) is filled here, with the
document split and the epochs the budget makes.

Public: ``Run``, ``setup``, ``recipe_of``, ``graph_refusal``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..nn import GPT, ModelConfig, QuantContext, Recipe, load_recipe, model_config, quantize_model
from ..nn.seeds import SeedTable
from .config import TrainConfig
from .corpus import CORPORA, TEXT_SUFFIXES, default_dataset, text_dataset
from .data import TokenStream, dataset_meta, load_tokens
from .optim import build_optimizers
from .parallel import check, wrap
from .receipt import Data, peak_flops


@dataclass(frozen=True, kw_only=True)
class Run:
    """What ``_setup`` builds for one session of a run; nothing in it changes while it trains."""

    cfg: TrainConfig
    """The run's settings."""
    out: Path
    """The run directory."""
    rank: int
    """This process's rank (0 on one GPU)."""
    world: int
    """Ranks in all."""
    device: torch.device
    """This rank's GPU, or the CPU."""
    data: Data
    """The receipt's data entry (split and epochs included)."""
    stream: TokenStream
    """This rank's share of every batch, and the validation windows."""
    mcfg: ModelConfig
    """The model preset with the run's vocabulary, sequence length and overrides."""
    recipe: Recipe
    """The recipe preset (or file) with the run's overrides."""
    model: GPT
    """The model itself, its linears swapped for FP4 layers as the recipe says."""
    runner: torch.nn.Module
    """The model as called for training: wrapped in DDP or sharded by FSDP2 (several ranks), and
    torch.compile'd (if asked). Under FSDP ``model`` is the same module, its parameters DTensors."""
    context: QuantContext
    """The FP4 layers' QuantContext (tick and progress are set per micro-batch)."""
    optimizers: list
    """optim.build_optimizers' optimizers (one per parameter lane)."""
    identity: dict
    """What a checkpoint must match to be resumed."""
    flops_per_token: float
    """6 x active parameters + attention, for MFU."""
    peak: float | None
    """The device's dense BF16 peak, FLOP/s (None: unknown)."""

    @property
    def autocast(self) -> bool:
        return self.device.type == "cuda"

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len


def _dist() -> tuple[int, int, int]:
    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # before NCCL starts, so that its collectives use this rank's GPU
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world, local_rank) if world > 1 else (0, 1, 0)


def _tokens(cfg: TrainConfig) -> tuple[Any, Path, dict]:
    path = Path(cfg.data)
    if cfg.data in CORPORA:
        path = default_dataset(cfg.data, vocab_size=cfg.vocab_size, max_bytes=cfg.data_max_bytes)
    elif not path.exists():
        raise FileNotFoundError(f"data {cfg.data!r} is neither a built-in corpus {CORPORA} nor a path")
    elif _is_text(path):  # tokenized like the built-in corpora, and cached
        path = text_dataset(path, vocab_size=cfg.vocab_size)
    return load_tokens(path), path, dataset_meta(path) if path.is_dir() else {}


def _is_text(path: Path) -> bool:
    """Text to tokenize: a .txt/.md/.jsonl/.py/.rst file, or a directory of them with no token shards."""
    if path.is_file():
        return path.suffix in TEXT_SUFFIXES
    return not any(p.suffix in (".bin", ".npy") for p in path.iterdir()) and not (path / "meta.json").is_file()


def recipe_of(cfg: TrainConfig) -> Recipe:
    """The recipe a run trains with: its preset or file, with the config's overrides."""
    try:
        recipe = load_recipe(cfg.recipe)
        return recipe.override(cfg.recipe_overrides) if cfg.recipe_overrides else recipe
    except TypeError as err:  # a recipe file or override of the wrong shape: the user's input, said as such
        raise ValueError(f"recipe {cfg.recipe!r} with {cfg.recipe_overrides}: {err}") from err


def graph_refusal(*, host_counts: bool, device_type: str = "cuda", world: int = 1) -> str | None:
    """Why a run cannot replay its steps from a CUDA graph (train.graphed), or None when it can:
    a CUDA device, one process, and no experts that read the routing's counts on the host
    (``host_counts``: FP4 experts whose recipe quantizes some GEMM's activations expert by expert,
    and BF16 experts where torch._grouped_mm does not run; nn.moe.steps_keep_counts)."""
    return ("it needs a CUDA device" if device_type != "cuda" else
            "one process only (DDP's collectives are not captured)" if world > 1 else
            "MoE experts read the routing's counts on the host (FP4 experts whose recipe quantizes some "
            "GEMM's activations expert by expert, or BF16 experts without torch._grouped_mm: CUDA before "
            "sm_90)" if host_counts else None)


def seeds_on_device(model: GPT, device: torch.device, *, compiled: bool) -> bool:
    """Whether a run's steps read their seeds from a SeedTable on ``device`` (nn.seeds), which the
    trainer then makes: on CUDA, compiled (Inductor launches the FP4 kernels itself: nn.ops.traceable),
    or eager with FP4 experts that keep the routing's counts on the device (nn.moe), which they do
    only where the seeds live there. Without it each FP4 MoE projection reads the counts on the
    host, a wait for the GPU at every MoE layer, and works per expert in Python. The same bits
    either way (a graphed step's eager warm-up runs this path); a graphed step makes its own table."""
    if device.type != "cuda":
        return False
    return compiled or any(moe.experts.recipe is not None and moe.experts.counts_on_device()
                           for moe in model.moe_layers())


def setup(cfg: TrainConfig) -> Run:
    """Ranks, data, model, recipe and optimizers -> the Run (the order fixes the random streams)."""
    rank, world, local_rank = _dist()
    check(cfg.parallel, world)
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.batch_size % (cfg.grad_accum * world):
        raise ValueError(f"batch_size {cfg.batch_size} must divide by grad_accum x ranks = {cfg.grad_accum * world}")
    recipe = recipe_of(cfg)  # a bad recipe is refused before the data is read
    tokens, path, meta = _tokens(cfg)
    vocab = meta.get("vocab_size") or int(tokens.max()) + 1
    mcfg = model_config(cfg.model, vocab_size=vocab, seq_len=cfg.seq_len, **cfg.model_overrides)
    stream = TokenStream(tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size // cfg.grad_accum, seed=cfg.seed,
                         rank=rank, world=world, val_fraction=cfg.val_fraction, eot=meta.get("eot_id"))
    epochs = cfg.steps * cfg.batch_size / stream.n_train
    data = Data(source=cfg.data, path=str(path), tokens=int(len(tokens)),
                identity=meta.get("identity", {"sha256": None}), vocab_size=meta.get("vocab_size"),
                tokenizer_sha256=meta.get("tokenizer_sha256"), eot_id=meta.get("eot_id"), split=stream.split_info,
                epochs=epochs)
    if epochs > 1 and rank == 0:
        print(f"note: {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens make {epochs:.2f} epochs of the "
              f"{stream.split_info['train_tokens']:,} training tokens", flush=True)

    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    context = quantize_model(model, recipe)
    context.rank = rank
    model.to(device)
    runner = wrap(model, cfg.parallel, world=world, device=device)
    optimizers = build_optimizers(model, lr=cfg.lr, weight_decay=cfg.weight_decay, dense=cfg.dense_opt,
                                  expert=cfg.expert_opt, muon_lr=cfg.muon_lr, embed_lr=cfg.embed_lr)
    if cfg.cuda_graph:  # what a graph cannot replay is refused before training starts
        host_counts = any(not moe.experts.counts_on_device() for moe in model.moe_layers())
        why = graph_refusal(host_counts=host_counts, device_type=device.type, world=world)
        if why:
            raise ValueError(f"training setting cuda_graph=true: {why}")
    if cfg.compile:
        # a run compiles its own graphs: frames an earlier run of the process compiled (under other
        # seeds, autocast's cast cache, evaluation) would count toward dynamo's recompile limit,
        # past which a frame runs eager, a graphed step's capture included
        torch.compiler.reset()
        runner = torch.compile(runner, options={"cpp_wrapper": True} if cfg.cpp_wrapper else None)
    if context.seeds is None and seeds_on_device(model, device, compiled=cfg.compile):
        context.seeds = SeedTable(device)
    # what a checkpoint must match to be resumed; steps stays in: another budget is another schedule.
    # parallel is out (TrainConfig.identity): DDP and FSDP checkpoints are the same files (train.parallel)
    identity = {"config": cfg.identity(), "model": mcfg.to_dict(), "recipe": recipe.to_dict(), "data": data.identity,
                "world": world}
    flops_per_token = 6 * model.num_params(active=True) + 12 * mcfg.depth * mcfg.dim * cfg.seq_len
    return Run(cfg=cfg, out=Path(cfg.out), rank=rank, world=world, device=device, data=data, stream=stream,
               mcfg=mcfg, recipe=recipe, model=model, runner=runner, context=context, optimizers=optimizers,
               identity=identity, flops_per_token=flops_per_token, peak=peak_flops(device))
