"""The training loop every study runs on: one config in, a run directory with a receipt out.

    run_dir/receipt.json     what ran and what came out (report.py rebuilds tables from these)
    run_dir/metrics.jsonl    one line per log step (train loss, lr, grad norm, tokens/s, MFU),
                             per eval (val loss) and per stiction sample (code-flip rate by layer)
    run_dir/checkpoint/      the latest checkpoint (checkpoint.py), for --resume

Per step: ``grad_accum`` micro-batches (the QuantContext tick = step * accum + micro seeds every
stochastic choice of the FP4 layers, so a resumed run replays the same bits), bf16 autocast on
CUDA (fp32 on CPU), gradient clipping, the scheduled learning rate, the optimizer step(s), the
MoE bias update. Eval every ``eval_every`` steps (and at the end) on the fixed validation
batches (a spread sample of the held-out documents, data.split_documents); the final
evaluation covers the whole validation split. A non-finite loss, or one above ``diverge_loss``, stops the run with status "diverged"
and a clear message; the last checkpoint (from before the divergence) is kept as it was.
Under torchrun (WORLD_SIZE > 1) the model is wrapped in DistributedDataParallel and each rank
reads its share of every global batch (data.TokenStream), so the global batch is the same as
on one GPU; MoE load counts are summed over ranks before the balancing-bias update, so every
rank moves the same bias as one GPU would. A non-finite gradient norm counts as divergence.

Public: ``TrainConfig``, ``train``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..nn import GPT, StictionMeter, load_recipe, model_config, quantize_model
from ..nn.swap import coverage
from .checkpoint import load_checkpoint, recover_interrupted_save, save_checkpoint
from .corpus import CORPORA, default_dataset
from .data import TokenStream, dataset_meta, load_tokens
from .optim import build_optimizers, lr_multiplier
from .receipt import environment, peak_flops

RECEIPT_SCHEMA = 1


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
    """A built-in corpus ("python", "stdlib") or a directory / file of token shards."""
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
    compile: bool = False
    """torch.compile the model (CUDA; the FP4 layers' Triton calls run outside the graph)."""
    progress: bool = True
    stiction_every: int = 0
    """Every N steps, measure the fraction of FP4 weight codes each optimizer step flips
    (nn.diagnostics.StictionMeter; costs one weight quantization per layer). 0: never."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
            elif key in fields:
                direct[key] = value
            else:
                raise ValueError(f"unknown training setting {key!r}; fields: {', '.join(fields)}, "
                                 "or model.<field>, recipe.<dotted key>")
        return dataclasses.replace(self, **direct, model_overrides=model_o, recipe_overrides=recipe_o)


def _dist() -> tuple[int, int, int]:
    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # before NCCL starts, so that its collectives use this rank's GPU
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world, local_rank) if world > 1 else (0, 1, 0)


def _data(cfg: TrainConfig) -> tuple[Any, dict]:
    path = Path(cfg.data)
    if cfg.data in CORPORA:
        path = default_dataset(cfg.data, vocab_size=cfg.vocab_size, max_bytes=cfg.data_max_bytes)
    elif not path.exists():
        raise FileNotFoundError(f"data {cfg.data!r} is neither a built-in corpus {CORPORA} nor a path")
    meta = dataset_meta(path) if path.is_dir() else {}
    tokens = load_tokens(path)
    info = {"source": cfg.data, "path": str(path), "tokens": int(len(tokens)),
            "identity": meta.get("identity", {"sha256": None}), "vocab_size": meta.get("vocab_size"),
            "tokenizer_sha256": meta.get("tokenizer_sha256"), "eot_id": meta.get("eot_id")}
    return tokens, info


def _log(fh, record: dict) -> None:
    if fh is not None:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def _evaluate(model, stream: TokenStream, cfg: TrainConfig, device, autocast: bool, *, full: bool) -> float:
    """Mean validation loss per token: over ``eval_batches`` batches, or the whole split (full)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for x, y in stream.val_batches(None if full else cfg.eval_batches, cfg.batch_size // cfg.grad_accum):
            n = float(y.numel())
            total += torch.stack([model(x.to(device), y.to(device)).double() * n, torch.full((), n, device=device,
                                                                                           dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1]) if total[1] else float("nan")


def train(cfg: TrainConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run ``cfg`` (resuming from its checkpoint if asked) -> the receipt (also written to disk)."""
    rank, world, local_rank = _dist()
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(cfg.out)
    if cfg.batch_size % (cfg.grad_accum * world):
        raise ValueError(f"batch_size {cfg.batch_size} must divide by grad_accum x ranks = {cfg.grad_accum * world}")
    tokens, data_info = _data(cfg)
    vocab = data_info["vocab_size"] or int(tokens.max()) + 1
    mcfg = model_config(cfg.model, vocab_size=vocab, seq_len=cfg.seq_len, **cfg.model_overrides)
    recipe = load_recipe(cfg.recipe).override(cfg.recipe_overrides) if cfg.recipe_overrides else load_recipe(cfg.recipe)
    micro = cfg.batch_size // cfg.grad_accum
    stream = TokenStream(tokens, seq_len=cfg.seq_len, batch_size=micro, seed=cfg.seed, rank=rank, world=world,
                         val_fraction=cfg.val_fraction, eot=data_info["eot_id"])
    epochs = cfg.steps * cfg.batch_size / stream.n_train
    data_info = {**data_info, "split": stream.split_info, "epochs": epochs}
    if epochs > 1 and rank == 0:
        print(f"note: {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens make {epochs:.2f} epochs of the "
              f"{stream.split_info['train_tokens']:,} training tokens", flush=True)

    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    context = quantize_model(model, recipe)
    context.rank = rank
    model.to(device)
    optimizers = build_optimizers(model, lr=cfg.lr, weight_decay=cfg.weight_decay, dense=cfg.dense_opt,
                                  expert=cfg.expert_opt, muon_lr=cfg.muon_lr, embed_lr=cfg.embed_lr)
    runner = model
    if world > 1:
        # buffers stay per rank: the MoE load counts are summed over ranks explicitly, once a step
        runner = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None, broadcast_buffers=False)
    if cfg.compile:
        runner = torch.compile(runner)
    # what a checkpoint must match to be resumed; steps stays in: another budget is another schedule
    identity = {"config": {k: v for k, v in cfg.to_dict().items() if k not in ("out", "progress", "ckpt_every",
                                                                               "compile", "stop_at")},
                "model": mcfg.to_dict(), "recipe": recipe.to_dict(), "data": data_info["identity"], "world": world}

    start, evals, train_curve, flips, wall_before = 0, [], [], [], 0.0
    if resume:
        recover_interrupted_save(out / "checkpoint")
    if resume and (out / "checkpoint").exists():
        state = load_checkpoint(out / "checkpoint", model, optimizers, identity=identity)
        start, evals, train_curve, wall_before = state["step"], state["evals"], state["train"], state["wall_s"]
        flips = state["flips"]
    last_ckpt = start if start else None

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    metrics = None
    if rank == 0:
        path = out / "metrics.jsonl"
        # a resumed run replays the steps after its checkpoint: drop the lines an interruption left there
        kept = [line for line in (path.read_text().splitlines() if start and path.exists() else [])
                if json.loads(line)["step"] <= start]
        metrics = open(path, "w")
        metrics.writelines(line + "\n" for line in kept)
    autocast = device.type == "cuda"
    stiction = StictionMeter(model) if cfg.stiction_every and recipe.quantized else None
    n_active = model.num_params(active=True)
    flops_per_token = 6 * n_active + 12 * mcfg.depth * mcfg.dim * cfg.seq_len
    peak = peak_flops(device)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    status, message = "ok", ""
    bar = None
    if cfg.progress and rank == 0:
        bar = tqdm(total=cfg.steps, initial=start, desc=f"{recipe.name}", unit="step", leave=False)
    t0, timed_tokens, timed_s = time.perf_counter(), 0, 0.0
    done = start
    end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    for step in range(start, end):
        step_start = time.perf_counter()
        mult = lr_multiplier(step, cfg.steps, warmup=cfg.warmup, schedule=cfg.schedule, final=cfg.final_lr)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * mult
        loss_sum = torch.zeros((), device=device)
        for m in range(cfg.grad_accum):
            context.tick, context.progress = step * cfg.grad_accum + m, step / cfg.steps
            x, y = stream.batch(step * cfg.grad_accum + m)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = runner(x.to(device), y.to(device)) / cfg.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        if world > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip if cfg.clip > 0 else float("inf"))
        train_loss, norm = float(loss_sum), float(grad_norm)
        if not math.isfinite(train_loss) or not math.isfinite(norm) or train_loss > cfg.diverge_loss:
            status = "diverged"  # a non-finite gradient would turn every weight into NaN at the step
            message = (f"training diverged at step {step}: loss {train_loss:.4g} (limit {cfg.diverge_loss}), "
                       f"gradient norm {norm:.4g}; "
                       + (f"the last checkpoint (step {last_ckpt}) is kept" if last_ckpt else "no checkpoint was written"))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            break
        meter = stiction if stiction is not None and (step + 1) % cfg.stiction_every == 0 else None
        if meter is not None:
            meter.before()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if meter is not None:
            rates = meter.after()
            flips.append([step + 1, rates["all"]])
            _log(metrics, {"step": step + 1, "flip_rate": rates})
        for moe in model.moe_layers():
            if world > 1:  # balance on the global batch's routing, the same bias on every rank
                dist.all_reduce(moe.load)
            moe.update_bias()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - step_start
        if step >= start + 2:  # the first steps compile kernels
            timed_tokens, timed_s = timed_tokens + tokens_per_step, timed_s + dt
        train_curve.append([step + 1, train_loss])
        done = step + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}")
        if (step + 1) % cfg.log_every == 0:
            tps = tokens_per_step / dt
            _log(metrics, {"step": step + 1, "train_loss": train_loss, "lr_mult": mult, "grad_norm": norm,
                           "tokens_per_s": tps, "mfu": tps * flops_per_token / peak if peak else None})
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.eval_every == 0 or last:  # the last evaluation covers the whole split
            val = _evaluate(runner, stream, cfg, device, autocast, full=last)
            evals.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "val_loss": val})
            _log(metrics, {"step": step + 1, "val_loss": val})
        if (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or step + 1 == end:
            if rank == 0:
                save_checkpoint(out / "checkpoint", model, optimizers, step=step + 1, identity=identity,
                                extra={"evals": evals, "train": train_curve, "flips": flips,
                                       "wall_s": wall_before + time.perf_counter() - t0})
            last_ckpt = step + 1
            if world > 1:
                dist.barrier()
    if status == "ok" and done < cfg.steps:
        status, message = "stopped", f"stopped at step {done} of {cfg.steps} (stop_at); --resume continues it"
    if bar is not None:
        bar.close()
    if metrics is not None:
        metrics.close()
    wall = wall_before + time.perf_counter() - t0
    vals = [e["val_loss"] for e in evals]
    receipt = {
        "schema": RECEIPT_SCHEMA, "name": out.name, "status": status, "message": message,
        "config": cfg.to_dict(), "recipe": recipe.to_dict(), "recipe_text": recipe.describe(),
        "model": mcfg.to_dict(), "params": model.num_params(), "active_params": n_active,
        "data": data_info, "seed": cfg.seed, "world": world, "coverage": coverage(model), **environment(device),
        "evals": evals, "train_curve": train_curve[:: max(1, len(train_curve) // 500)],
        "final": {"val_loss": vals[-1] if vals else None, "min_val_loss": min(vals) if vals else None,
                  "train_loss": train_curve[-1][1] if train_curve else None, "steps": done},
        "wall_s": wall, "tokens_per_s": timed_tokens / timed_s if timed_s else None,
        "mfu": (timed_tokens / timed_s * flops_per_token / peak) if timed_s and peak else None,
        "flip_rate": flips,
    }
    if rank == 0:
        tmp = out / f".receipt.json.tmp-{os.getpid()}"  # atomic: a reader never sees half a receipt
        tmp.write_text(json.dumps(receipt, indent=1))
        os.replace(tmp, out / "receipt.json")
    if status == "diverged" and rank == 0:
        print(message)
    if world > 1:
        dist.destroy_process_group()
    return receipt
