"""A GPT training step (forward, backward, AdamW) in BF16 and under FP4 recipes, side by side.

    python benchmarks/bench_model.py [--model d12] [--batch 16] [--seq 1024] [--modes eager compiled] [--rounds 3]

Each arm: the same model and batch under bf16 autocast; fp4lab.nn.quantize_model applies the
recipe (Triton quantizers writing BF16 block values and kernels.matmul's GEMMs on CUDA). Reports tokens/s and the step
time over BF16's (lower is better), median of timed steps after warmup (host time included:
this is what a training run sees). Host-bound FP4 steps move ~30% between runs of the same code
(benchmarks/NOTES.md, 2026-11-25), so every arm is built once and timed in ``--rounds`` rounds
that alternate the arms; a ratio is the median over rounds of the round's step over the same
round's BF16 step, with the rounds' range beside it. Each arm runs eager and under torch.compile (the FP4 GEMMs
as nn.ops custom ops); a compiled FP4 arm is compared with compiled BF16, as users run it. ``--modes graphed``
adds the eager step captured in one CUDA graph (train.graphed; MoE models too where the experts keep the
routing's counts on the device: nn.moe.steps_keep_counts, e.g. BF16 experts and NVIDIA's recipe),
against graphed BF16, and ``compiled_graphed`` the compiled one. An arm ``NAME:single`` is NAME
with x and dy quantized one copy at a time (no pair kernel), timed beside NAME.
Writes benchmarks/results/model.json (d12; other models model_<name>.json) and the matching keys
of latest.json: <name>_<arm>_step_over_bf16 (eager), <name>_<arm>_step_over_bf16_compiled (and _graphed),
and BF16's tokens/s in each mode, <name>_bf16_tokens_per_s[_<mode>].
Each row also has the arm's peak memory while it was built and warmed (weights, optimizer state,
activations or a graph's pool), e.g. to see what the pair kernel's kept wgrad copy of x costs, and
the seconds that took (``warm_s``: in the compiled modes mostly compiling, the wait a user sees).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, environment, one_copy_at_a_time, opaque_ops, save  # noqa: E402
from fp4lab.nn import GPT, model_config, quantize_model  # noqa: E402
from fp4lab.nn.recipe import preset  # noqa: E402
from fp4lab.nn.seeds import SeedTable  # noqa: E402
from fp4lab.train.graphed import GraphedStep  # noqa: E402
from fp4lab.train.run import seeds_on_device  # noqa: E402

ARMS = ("bf16", "nvfp4", "nvfp4_plain", "mxfp4")


def _cpp_wrapper():
    """Inductor's C++ wrapper: the compiled graph's launches made from C++ rather than its Python
    wrapper (a probe of the compiled row's host time; compiles take longer)."""
    import torch._inductor.config as inductor_config
    return inductor_config.patch(cpp_wrapper=True)


_VARIANTS = {"": lambda: contextlib.nullcontext(), "single": one_copy_at_a_time, "opaque": opaque_ops,
             "cpp": _cpp_wrapper}


def make_step(arm: str, mode: str, args):
    """-> step(i): one training step (forward, backward, AdamW) of ``args.model`` under the arm's
    recipe (``name:single``: quantizing x and dy one copy at a time; ``name:opaque``: compiled, the
    FP4 layers on the opaque custom ops, as before the traced ones; ``name:cpp``: compiled with
    Inductor's C++ wrapper); ``graphed`` /
    ``compiled_graphed``: the eager / compiled step captured in a CUDA graph (train.graphed),
    replayed per step (the choice made at capture)."""
    recipe_name, _, variant = arm.partition(":")
    if variant not in _VARIANTS:
        raise SystemExit(f"unknown arm variant {arm!r} (NAME, NAME:single, NAME:opaque or NAME:cpp)")
    if variant == "cpp" and not mode.startswith("compiled"):
        raise SystemExit(f"{arm}: Inductor's C++ wrapper is for the compiled modes, not {mode}")
    with _VARIANTS[variant]():
        step = _make_step(recipe_name, mode, args)

    def run(i: int) -> None:
        with _VARIANTS[variant]():  # (compiled: the first steps trace the graphs)
            step(i)
    return run


def _make_step(recipe_name: str, mode: str, args):
    torch.manual_seed(0)
    model = GPT(model_config(args.model, seq_len=args.seq)).cuda()
    context = quantize_model(model, preset(recipe_name))
    runner = torch.compile(model) if mode.startswith("compiled") else model
    graphed = mode.endswith("graphed")
    # the seeds in device memory where the trainer puts them (compiled: nn.ops.traceable; eager FP4
    # experts: the routing's counts kept on the device); a graphed step makes its own table
    if not graphed and seeds_on_device(model, torch.device("cuda"), compiled=mode == "compiled"):
        context.seeds = SeedTable("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graphed)
    idx = torch.randint(0, model.cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")
    if graphed:
        captured = GraphedStep(lambda batch: runner(batch[:, :-1], batch[:, 1:]), opt, context, (idx,),
                               autocast=torch.bfloat16)
        return lambda i: captured(i, idx)

    def step(i: int) -> None:
        context.tick = i
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = runner(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed_median(step, start: int, steps: int) -> float:
    """Median seconds of ``steps`` calls of step(i), i counting on from ``start``."""
    times = []
    for i in range(start, start + steps):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def step_arguments(parser: argparse.ArgumentParser, *, warmup: int, steps: int) -> None:
    """The model, batch and step counts make_step reads (shared with profile_model.py)."""
    parser.add_argument("--model", default="d12")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=int, default=steps)


def time_mode(mode: str, args, tokens: int) -> dict[str, dict]:
    """Every arm's step in ``mode``, built and warmed once (compiling, capturing included), then
    timed in alternating rounds so that a slow spell of the host hits them all; the steps (and
    their graphs' pools) are released before the next mode is built, and dynamo's cache emptied
    (a mode's frames would count toward the next one's recompile limit)."""
    torch.compiler.reset()
    steps, peak_mib, warm_s = {}, {}, {}
    for arm in args.arms:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        steps[arm] = make_step(arm, mode, args)
        timed_median(steps[arm], 0, args.warmup)
        warm_s[arm] = time.perf_counter() - begin  # (compiled modes: mostly compiling; what a user waits)
        if args.compile_times and mode.startswith("compiled"):  # where the compile's seconds went, this arm's
            print(f"{arm} {mode} compile times (s):\n{torch._dynamo.utils.compile_times(aggregate=True)}", flush=True)
            torch._dynamo.utils.compilation_time_metrics.clear()
        # what this arm holds at its peak: weights, optimizer state, activations (a graph's pool)
        peak_mib[arm] = (torch.cuda.max_memory_allocated() - before) / 2**20
    medians: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for r in range(args.rounds):
        for arm in args.arms:
            medians[arm].append(timed_median(steps[arm], args.warmup + r * args.steps, args.steps) * 1e3)
    steps.clear()
    gc.collect()
    torch.cuda.empty_cache()
    print(f"{mode}: released, {torch.cuda.memory_allocated() / 2**20:.0f} MiB still allocated", flush=True)
    rows = {}
    for arm in args.arms:
        ms = statistics.median(medians[arm])
        base = medians.get("bf16")
        ratios = [m / b for m, b in zip(medians[arm], base)] if base else None
        row = rows[f"{arm}/{mode}"] = {
            "arm": arm, "mode": mode, "step_ms": ms, "round_ms": medians[arm],
            "tokens_per_s": tokens / ms * 1e3, "peak_mib": peak_mib[arm], "warm_s": warm_s[arm],
            "over_bf16": statistics.median(ratios) if ratios else None,
            "over_bf16_range": [min(ratios), max(ratios)] if ratios else None}
        spread = f" (rounds {min(ratios):.2f}-{max(ratios):.2f})" if ratios and arm != "bf16" else ""
        print(f"{args.model} {arm:12s} {mode:8s} {ms:8.1f} ms/step  {row['tokens_per_s']:9.0f} tok/s  "
              f"peak {row['peak_mib']:7.0f} MiB  built+warmed in {warm_s[arm]:4.0f} s  "
              f"x{row['over_bf16'] or 1:.2f} of bf16 {mode}{spread}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    step_arguments(parser, warmup=5, steps=20)
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--modes", nargs="*", default=["eager", "compiled"], choices=["eager", "compiled", "graphed", "compiled_graphed"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-times", action="store_true",
                        help="print dynamo's and Inductor's compile seconds by phase, per compiled arm")
    args = parser.parse_args()
    tokens = args.batch * args.seq
    rows: dict[str, dict] = {}
    for mode in args.modes:  # one mode's arms at a time: ratios are within a mode, and six graphed
        rows.update(time_mode(mode, args, tokens))  # d12 steps' pools do not fit one H100 together
        save_rows(args, rows)  # after each mode: a later mode that fails loses only its own figures


def save_rows(args, rows: dict[str, dict]) -> None:
    """Write the run's rows, keeping the file's rows of the modes this run did not measure when it
    is the same commit's run of the same model and batch on the same device (a table split over
    several calls of a time-limited machine stays one commit's). A mode is kept or replaced whole:
    its ratios are within one run."""
    payload = {**environment(), "model": args.model, "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
               "steps_per_round": args.steps, "arms": rows}
    name = "model" if args.model == "d12" else f"model_{args.model.replace('-', '_')}"
    path = RESULTS / f"{name}.json"
    same = ("git", "device", "model", "batch", "seq", "rounds", "steps_per_round")
    old = json.loads(path.read_text()) if path.exists() else {}
    if payload["git"] != "unknown" and all(old.get(k) == payload[k] for k in same):
        modes = {r["mode"] for r in rows.values()}
        rows = {**{k: r for k, r in old.get("arms", {}).items() if r["mode"] not in modes}, **rows}
        payload["arms"] = rows
    keys = {f"{name}_{r['arm'].replace(':', '_')}_step_over_bf16{'' if r['mode'] == 'eager' else '_' + r['mode']}":
            r["over_bf16"]
            for r in rows.values() if r["arm"] != "bf16" and r["over_bf16"] is not None}
    for r in rows.values():  # BF16's own speed in each mode: the baseline as users run it
        if r["arm"] == "bf16":
            keys[f"{name}_bf16_tokens_per_s{'' if r['mode'] == 'eager' else '_' + r['mode']}"] = r["tokens_per_s"]
    save(name, payload, keys)


if __name__ == "__main__":
    main()
