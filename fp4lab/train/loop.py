"""The training loop every study runs on: one config in, a run directory with a receipt out.

    run_dir/receipt.json     what ran and what came out (receipt.Receipt; report.py rebuilds tables from these)
    run_dir/metrics.jsonl    one line per log step (train loss, lr, grad norm, tokens/s, MFU),
                             per eval (val loss) and per stiction sample (code-flip rate by layer)
    run_dir/checkpoint/      the latest checkpoint (checkpoint.py), for --resume

``train`` runs in named sections: ``run.setup`` (ranks, data, model, recipe, optimizers: a
``Run``, fixed for the session), ``_resume`` (the checkpoint -> ``RunState``), ``_open_metrics`` (the
metrics file, cut back to the checkpoint), then per step ``_step``, ``_evaluate_if_due`` and
``_checkpoint_if_due``, and ``_receipt``. ``RunState`` is where the run stands (step, evals,
train curve, flip samples, wall seconds): exactly what a checkpoint's ``extra`` saves and what
``--resume`` restores.

Per step: ``grad_accum`` micro-batches (the QuantContext tick = step * accum + micro seeds every
stochastic choice of the FP4 layers, so a resumed run replays the same bits), bf16 autocast on
CUDA (fp32 on CPU), gradient clipping, the scheduled learning rate, the optimizer step(s), the
MoE bias update. Eval every ``eval_every`` steps (and at the end) on the fixed validation
batches (a spread sample of the held-out documents, data.split_documents); the final
evaluation covers the whole validation split. A non-finite loss, or one above ``diverge_loss``,
stops the run with status "diverged" and a clear message; the last checkpoint (from before the
divergence) is kept as it was. Under torchrun (WORLD_SIZE > 1) the model is wrapped in
DistributedDataParallel or sharded by FSDP2 (``parallel``; train.parallel) and each rank reads
its share of every global batch (data.TokenStream), so the global batch is the same as on one
GPU; MoE load counts are summed over ranks before the balancing-bias update, so every rank
moves the same bias as one GPU would. A non-finite gradient norm counts as divergence.

Public: ``TrainConfig`` (from config.py), ``RunState``, ``train``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..nn import StictionMeter
from ..nn.swap import coverage
from .checkpoint import load_checkpoint, recover_interrupted_save, save_checkpoint
from .graphed import GraphedStep
from .config import TrainConfig
from .lock import RunLock
from .optim import lr_multiplier
from .parallel import is_dtensor, is_sharded
from .receipt import Eval, Final, Git, Receipt, environment, kernels_backend
from .run import Run, setup

__all__ = ["TrainConfig", "RunState", "train"]


@dataclass(kw_only=True)
class RunState:
    """Where a run stands. Mutable: the loop advances it. The first five fields are what a
    checkpoint saves (``extra``) and ``from_checkpoint`` restores; the rest are this session's."""

    step: int = 0
    """Optimizer steps done."""
    evals: list[Eval] = field(default_factory=list)
    """Every evaluation so far."""
    train_curve: list[list] = field(default_factory=list)
    """[step, train loss] per step (checkpoint key "train")."""
    flips: list[list] = field(default_factory=list)
    """[step, code-flip rate] per stiction sample."""
    wall_before: float = 0.0
    """Wall seconds of the sessions before this one (checkpoint key "wall_s")."""
    status: str = "ok"
    """"ok" until the run stops short ("stopped") or diverges ("diverged")."""
    message: str = ""
    """Why it stopped or diverged."""
    last_ckpt: int | None = None
    """The step of the last checkpoint on disk (None: none yet)."""
    started: float = field(default_factory=time.perf_counter)
    """perf_counter when this session's steps began."""
    timed_tokens: int = 0
    """Tokens of the steps timed for tokens/s (the first two of a session compile kernels)."""
    timed_s: float = 0.0
    """Seconds of those steps."""
    bf16_forward_val: float | None = None
    """The last evaluation of an FP4 run's weights with every GEMM in BF16 (None: not an FP4
    forward, or not evaluated yet)."""
    fp4_forward_val: float | None = None
    """The last evaluation of a run that switched to a BF16 forward late (``bf16_after``), again
    with the FP4 forward it trained with before (None: no such switch, or not evaluated yet)."""

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def extra(self) -> dict[str, Any]:
        """The checkpoint's state.json entries (beside its step and identity)."""
        return {"evals": [dataclasses.asdict(e) for e in self.evals], "train": self.train_curve,
                "flips": self.flips, "wall_s": self.wall_s(), "bf16_forward_val": self.bf16_forward_val,
                "fp4_forward_val": self.fp4_forward_val}

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> "RunState":
        """A checkpoint's state.json (``extra`` plus its step) -> the state to continue from."""
        return cls(step=state["step"], evals=[Eval(**e) for e in state["evals"]], train_curve=state["train"],
                   flips=state.get("flips", []), wall_before=state["wall_s"], last_ckpt=state["step"] or None,
                   bf16_forward_val=state.get("bf16_forward_val"), fp4_forward_val=state.get("fp4_forward_val"))


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> Receipt:
    """Run ``cfg`` (resuming from its checkpoint if asked) -> the receipt (also written to disk).
    Rank 0 holds the run directory's lock (lock.RunLock) throughout: a second writer is refused.
    A folder that already holds a run is never replaced silently (``_claim_folder``)."""
    lock = RunLock(cfg.out).acquire() if int(os.environ.get("RANK", "0")) == 0 else None
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        if lock is not None:
            _claim_folder(Path(cfg.out), resume=resume, overwrite=overwrite)
        if not torch.cuda.is_available():
            torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
        if cfg.deterministic:  # cuBLAS reads the variable once: it holds where no GEMM ran before in the process
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        run = setup(cfg)
        state = _resume(run) if resume else RunState()
        metrics = _open_metrics(run, state)
        try:
            _steps(run, state, metrics)
        finally:
            if metrics is not None:
                metrics.close()
        receipt = _receipt(run, state)
        if run.rank == 0:
            receipt.save(run.out / "receipt.json")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        if lock is not None:
            lock.release()
    if state.status == "diverged" and run.rank == 0:
        print(state.message)
    if run.world > 1:
        dist.destroy_process_group()
    return receipt


# ---- resume and the metrics file -------------------------------------------------------------

RUN_FILES = ("receipt.json", "metrics.jsonl", "checkpoint")


def _claim_folder(out: Path, *, resume: bool, overwrite: bool) -> None:
    """What a start does to a folder that already holds a run: ``resume`` continues its
    checkpoint (a folder with none starts from step 0, saying so, unless it holds a finished or
    partial run); ``overwrite`` removes the old run first; anything else is refused."""
    if resume:
        recover_interrupted_save(out / "checkpoint")  # a save cut between its renames
    held = [name for name in RUN_FILES if (out / name).exists()]
    if resume and (out / "checkpoint").exists():
        return
    if held and not overwrite:
        what = ", ".join(held)
        if resume:
            raise ValueError(f"{out} holds a run ({what}) but no checkpoint to resume; --overwrite starts it over")
        raise ValueError(f"{out} already holds a run ({what}); --resume continues it, --overwrite replaces it, "
                         "or choose another --out")
    for name in held:
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    if resume and not held:
        print(f"note: no checkpoint in {out}: starting from step 0", flush=True)


def _resume(run: Run) -> RunState:
    """The checkpoint's model, optimizer and RNG states loaded -> its RunState (a fresh one if
    the run has no checkpoint yet)."""
    ckpt = run.out / "checkpoint"
    recover_interrupted_save(ckpt)
    if not ckpt.exists():
        return RunState()
    return RunState.from_checkpoint(load_checkpoint(ckpt, run.model, run.optimizers, identity=run.identity))


def _open_metrics(run: Run, state: RunState):
    """Rank 0's metrics.jsonl, open for appending -> the file (None on other ranks)."""
    if run.rank != 0:
        return None
    run.out.mkdir(parents=True, exist_ok=True)
    path = run.out / "metrics.jsonl"
    # a resumed run replays the steps after its checkpoint: drop the lines an interruption left there
    kept = [line for line in (path.read_text().splitlines() if state.step and path.exists() else [])
            if json.loads(line)["step"] <= state.step]
    metrics = open(path, "w")
    metrics.writelines(line + "\n" for line in kept)
    return metrics


def _log(fh, record: dict) -> None:
    if fh is not None:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


# ---- the steps -------------------------------------------------------------------------------

def _steps(run: Run, state: RunState, metrics) -> None:
    """From ``state.step`` to the end (or stop_at, or divergence), advancing ``state``."""
    cfg = run.cfg
    stiction = StictionMeter(run.model) if cfg.stiction_every and run.recipe.quantized else None
    bar = None
    if cfg.progress and run.rank == 0:
        bar = tqdm(total=cfg.steps, initial=state.step, desc=f"{run.recipe.name}", unit="step", leave=False)
    start, end = state.step, cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    state.started = time.perf_counter()
    graphs = {} if cfg.cuda_graph else None  # the captured step and the recipe it runs (_graphed_loss)
    for step in range(start, end):
        step_start = time.perf_counter()
        measured = _step(run, state, step, stiction, metrics, graphs)
        if measured is None:
            break
        train_loss, mult, norm = measured
        dt = time.perf_counter() - step_start
        if step >= start + 2:  # the first steps compile kernels
            state.timed_tokens, state.timed_s = state.timed_tokens + run.tokens_per_step, state.timed_s + dt
        state.train_curve.append([step + 1, train_loss])
        state.step = step + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}")
        if state.step % cfg.log_every == 0:
            tps = run.tokens_per_step / dt
            _log(metrics, {"step": state.step, "train_loss": train_loss, "lr_mult": mult, "grad_norm": norm,
                           "tokens_per_s": tps, "mfu": tps * run.flops_per_token / run.peak if run.peak else None})
        _evaluate_if_due(run, state, metrics)
        _checkpoint_if_due(run, state, end)
    if state.status == "ok" and state.step < cfg.steps:
        state.status, state.message = "stopped", f"stopped at step {state.step} of {cfg.steps} (stop_at); " \
                                                 "--resume continues it"
    if bar is not None:
        bar.close()


def _graphed_loss(run: Run, graphs: dict, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The step's forward and backward replayed from a CUDA graph (train.graphed), captured for
    the recipe in force at this step's progress: again after a late switch to BF16."""
    in_force = run.recipe.at_progress(run.context.progress)
    if graphs.get("recipe") != in_force:
        graphs.clear()  # the old graph's memory goes back before the new capture
        # the warm-up runs forward and backward only: it moves no weight
        graphs["step"] = GraphedStep(run.runner, run.optimizers, run.context, (x, y), warmup=2, step=False,
                                     autocast=torch.bfloat16)
        graphs["recipe"] = in_force
        for moe in run.model.moe_layers():  # the warm-up's routing was counted: the step's replay counts it once
            moe.load.zero_()
    return graphs["step"](step, x, y)


def _step(run: Run, state: RunState, step: int, stiction, metrics,
          graphs: dict | None = None) -> tuple[float, float, float] | None:
    """One optimizer step -> (train loss, lr multiplier, gradient norm); None if it diverged
    (``state`` says so, and no weight moved). With ``graphs`` (cuda_graph), the forward and
    backward replay from a CUDA graph and the gradients stay in its memory (never set to None)."""
    cfg, device = run.cfg, run.device
    mult = lr_multiplier(step, cfg.steps, warmup=cfg.warmup, schedule=cfg.schedule, final=cfg.final_lr)
    for opt in run.optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * mult
    loss_sum = torch.zeros((), device=device)
    for m in range(cfg.grad_accum):
        run.context.tick, run.context.progress = step * cfg.grad_accum + m, step / cfg.steps
        x, y = run.stream.batch(step * cfg.grad_accum + m)
        if graphs is not None:  # grad_accum is 1 (config)
            loss_sum += _graphed_loss(run, graphs, step, x.to(device), y.to(device))
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.autocast):
            loss = run.runner(x.to(device), y.to(device)) / cfg.grad_accum
        loss.backward()
        loss_sum += loss.detach()
    if run.world > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.clip if cfg.clip > 0 else float("inf"))
    if is_dtensor(grad_norm):  # FSDP: the norm over every rank's shards, replicated
        grad_norm = grad_norm.full_tensor()
    train_loss, norm = float(loss_sum), float(grad_norm)
    if not math.isfinite(train_loss) or not math.isfinite(norm) or train_loss > cfg.diverge_loss:
        state.status = "diverged"  # a non-finite gradient would turn every weight into NaN at the step
        state.message = (f"training diverged at step {step}: loss {train_loss:.4g} (limit {cfg.diverge_loss}), "
                         f"gradient norm {norm:.4g}; " + (f"the last checkpoint (step {state.last_ckpt}) is kept"
                                                          if state.last_ckpt else "no checkpoint was written"))
        for opt in run.optimizers:
            opt.zero_grad(set_to_none=True)
        return None
    meter = stiction if stiction is not None and (step + 1) % cfg.stiction_every == 0 else None
    if meter is not None:
        meter.before()
    for opt in run.optimizers:
        opt.step()
        if graphs is None:  # a graph's gradients are its own memory, overwritten at each replay
            opt.zero_grad(set_to_none=True)
    if meter is not None:
        rates = meter.after()
        state.flips.append([step + 1, rates["all"]])
        _log(metrics, {"step": step + 1, "flip_rate": rates})
    for moe in run.model.moe_layers():
        if run.world > 1:  # balance on the global batch's routing, the same bias on every rank
            dist.all_reduce(moe.load)
        moe.update_bias()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return train_loss, mult, norm


# ---- evaluation and checkpoints --------------------------------------------------------------

def _evaluate(run: Run, *, full: bool, bf16_forward: bool = False, fp4_forward: bool = False) -> float:
    """Mean validation loss per token: over ``eval_batches`` batches, or the whole split (full).
    ``bf16_forward``: the same weights with every GEMM in BF16; ``fp4_forward``: with the recipe
    as it was before a late switch to BF16 (both on the eager model: the compiled ops follow the
    recipe alone)."""
    cfg, device, model = run.cfg, run.device, (run.model if bf16_forward or fp4_forward else run.runner)
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    which = (None if full else cfg.eval_batches, cfg.batch_size // cfg.grad_accum)
    batches = 0
    progress = run.context.progress
    run.context.forward_bf16 = bf16_forward
    if fp4_forward:
        run.context.progress = 0.0  # the recipe in force before any late switch
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.autocast):
            for x, y in run.stream.val_batches(*which):
                n = float(y.numel())
                total += torch.stack([model(x.to(device), y.to(device)).double() * n,
                                      torch.full((), n, device=device, dtype=torch.float64)])
                batches += 1
            if is_sharded(run.model):  # each forward all-gathers: a rank with an empty last share runs an idle one
                for _ in range(run.stream.val_batch_count(*which) - batches):
                    model(torch.zeros(1, cfg.seq_len, dtype=torch.long, device=device))
    finally:  # a failed evaluation must not leave the model serving BF16 (or the old recipe)
        run.context.forward_bf16, run.context.progress = False, progress
        model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] else float("nan")


def _fp4_forward_at(run: Run, progress: float) -> bool:
    """Whether the model's forward runs any FP4 GEMM under the recipe in force at ``progress``."""
    return run.recipe.at_progress(progress).fprop.emulated and bool(coverage(run.model)["linears"]["fp4"])


def _serves_fp4(run: Run) -> bool:
    """Whether the trained model's forward runs any FP4 GEMM: the recipe in force at the last
    step's progress, which the final evaluation runs with (a ``bf16_after`` of 1.0 never switches)."""
    return _fp4_forward_at(run, run.context.progress)


def _switched_from_fp4(run: Run) -> bool:
    """Whether the run trained with an FP4 forward and switched it to BF16 late (``bf16_after``),
    so that its final evaluation runs a BF16 forward."""
    return _fp4_forward_at(run, 0.0) and not _serves_fp4(run)


def _evaluate_if_due(run: Run, state: RunState, metrics) -> None:
    last = state.step == run.cfg.steps
    due = run.cfg.eval_every > 0 and state.step % run.cfg.eval_every == 0  # 0: only the last
    if due or last:  # the last evaluation covers the whole split
        val = _evaluate(run, full=last)
        state.evals.append(Eval(step=state.step, tokens=state.step * run.tokens_per_step, val_loss=val))
        _log(metrics, {"step": state.step, "val_loss": val})
        if last and _serves_fp4(run):  # the same weights served in BF16: the gap's inference share
            state.bf16_forward_val = _evaluate(run, full=True, bf16_forward=True)
            _log(metrics, {"step": state.step, "val_loss_bf16_forward": state.bf16_forward_val})
        if last and _switched_from_fp4(run):  # the same weights served in FP4, as before the switch
            state.fp4_forward_val = _evaluate(run, full=True, fp4_forward=True)
            _log(metrics, {"step": state.step, "val_loss_fp4_forward": state.fp4_forward_val})


def _checkpoint_if_due(run: Run, state: RunState, end: int) -> None:
    if (run.cfg.ckpt_every and state.step % run.cfg.ckpt_every == 0) or state.step == end:
        # every rank: under FSDP the full tensors are gathered from all of them; rank 0 writes
        save_checkpoint(run.out / "checkpoint", run.model, run.optimizers, step=state.step,
                        identity=run.identity, extra=state.extra(), write=run.rank == 0)
        state.last_ckpt = state.step
        if run.world > 1:
            dist.barrier()


# ---- the receipt -----------------------------------------------------------------------------

def _receipt(run: Run, state: RunState) -> Receipt:
    cfg, model = run.cfg, run.model
    vals = [e.val_loss for e in state.evals]
    env = environment(run.device)
    tokens_per_s = state.timed_tokens / state.timed_s if state.timed_s else None
    return Receipt(
        name=run.out.name, status=state.status, message=state.message, config=cfg.to_dict(),
        recipe=run.recipe.to_dict(), recipe_text=run.recipe.describe(), model=run.mcfg.to_dict(),
        params=model.num_params(), active_params=model.num_params(active=True), data=run.data, seed=cfg.seed,
        world=run.world, coverage=coverage(model), git=Git(**env["git"]), device=env["device"],
        versions=env["versions"], backend=kernels_backend(run.device), evals=tuple(state.evals),
        train_curve=tuple(map(tuple, state.train_curve[:: max(1, len(state.train_curve) // 500)])),
        final=Final(val_loss=vals[-1] if vals else None, min_val_loss=min(vals) if vals else None,
                    train_loss=state.train_curve[-1][1] if state.train_curve else None, steps=state.step,
                    bf16_forward_val_loss=state.bf16_forward_val, fp4_forward_val_loss=state.fp4_forward_val),
        wall_s=state.wall_s(), tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * run.flops_per_token / run.peak if tokens_per_s and run.peak else None,
        flip_rate=tuple(map(tuple, state.flips)))
