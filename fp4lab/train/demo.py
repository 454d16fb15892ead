"""``fp4lab demo``: BF16, NVFP4 and MXFP4 side by side on the built-in corpus, with the noise band.

Four runs: BF16 with seeds 0 and 1, NVFP4 (NVIDIA's recipe) and MXFP4 with seed 0. The FP4 arms
keep the same BF16 blocks (NVIDIA's proportion, 2 first and 8 last of 62, resolved against the
model's depth), so the formats are compared at equal BF16 coverage. The second BF16 seed
measures the **noise band** at this budget: |val(bf16, seed 1) - val(bf16, seed 0)|. An FP4
arm's gap to BF16 (same seed) inside that band is "not resolved"; only a gap beyond it says
which way the format pushed. A demo this short resolves little: the studies (``fp4lab study
fidelity``) are where 3 seeds and 95% intervals answer the question.

On a CPU (about 4 minutes on 2 idle cores; the runs go two at a time, one thread each, which
measured faster than one after another with two threads): the "tiny" GPT (2 blocks, D = 128,
too shallow for a BF16 block) on a 4 MB prefix of the standard-library corpus with a 4096-entry
BPE, 80 steps of 16 x 128 tokens. On a GPU: the "d6"
GPT on the ``code`` corpus, 400 steps of 32 x 512 tokens (its last block in BF16 on the FP4 arms).
Writes one run directory per run, report.md, loss.png and gap.png under ``out``.

Public: ``ARMS``, ``demo_configs``, ``noise_verdicts``, ``run_demo``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from pathlib import Path

import torch

from ..nn.recipe import NVIDIA_KEEP
from .loop import TrainConfig, train
from .receipt import Receipt
from .report import final_loss, load_receipts, report

ARMS = ("bf16", "nvfp4", "mxfp4")
NOISE_SEED = 1
"""The second BF16 seed, whose distance from seed 0 is the noise band."""
CPU = TrainConfig(model="tiny", data="stdlib", data_max_bytes=4_000_000, vocab_size=4096, steps=80,
                  batch_size=16, seq_len=128, lr=3e-3, warmup=10, eval_every=20, eval_batches=8)
CPU_MINUTES = 4
"""The CPU demo's wall time on 2 idle cores, corpus build included (239 s, 2026-11-23)."""
GPU = TrainConfig(model="d6", data="code", vocab_size=8192, steps=400, batch_size=32, seq_len=512,
                  lr=2e-3, warmup=40, eval_every=50, eval_batches=16)


def demo_configs(out: Path, *, arms=ARMS, gpu: bool | None = None, **changes) -> list[TrainConfig]:
    """The runs: every arm at seed 0, then BF16 at seed 1 (``changes``: TrainConfig fields)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    base = dataclasses.replace(GPU if gpu else CPU, **changes)
    runs = [(arm, 0) for arm in arms] + ([("bf16", NOISE_SEED)] if "bf16" in arms else [])
    configs = []
    for arm, seed in runs:
        keep = {} if arm == "bf16" else {"keep_fraction": list(NVIDIA_KEEP)}  # equal BF16 coverage
        configs.append(dataclasses.replace(base, out=str(Path(out) / f"{arm}-seed{seed}"), recipe=arm, seed=seed,
                                           recipe_overrides={**keep, "seed": seed}))
    return configs


def noise_verdicts(receipts: list[Receipt]) -> list[str]:
    """One line per FP4 arm: its gap to BF16 (seed 0) against the BF16 seed-to-seed band."""
    by_name = {r.name: r for r in receipts}
    base, other = by_name.get("bf16-seed0"), by_name.get(f"bf16-seed{NOISE_SEED}")
    if base is None or other is None:
        return ["no noise band: the demo needs BF16 at seeds 0 and 1"]
    band = abs(final_loss(other) - final_loss(base))
    lines = [f"noise band (BF16 seed {NOISE_SEED} vs seed 0): {band:.4f}"]
    for r in receipts:
        if r.name.startswith("bf16"):
            continue
        gap = final_loss(r) - final_loss(base)
        if gap != gap or abs(gap) == float("inf"):
            lines.append(f"{r.name}: {r.status}")
            continue
        word = "not resolved (inside the noise band)" if abs(gap) <= band else \
            ("worse than BF16, beyond the noise band" if gap > 0 else "better than BF16, beyond the noise band")
        lines.append(f"{r.name}: gap to BF16 {gap:+.4f} ({100 * gap / final_loss(base):+.2f}%): {word}")
    return lines


def _train_quietly(cfg: TrainConfig) -> str:
    torch.set_num_threads(1)  # two runs share two cores: one thread each beats two fighting threads
    receipt = train(dataclasses.replace(cfg, progress=False), overwrite=True)  # the demo owns its folders
    return f"{cfg.out}: {receipt.status}, final val {receipt.final.val_loss:.4f}"


def run_demo(out: Path, *, arms=ARMS, gpu: bool | None = None, **changes) -> tuple[str, list[Path]]:
    """Train every run, then write the report -> (the gap table and verdicts, the files written)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    configs = demo_configs(out, arms=arms, gpu=gpu, **changes)
    for cfg in configs:
        print(f"training {cfg.recipe} seed {cfg.seed} ({cfg.model}, {cfg.steps} steps of {cfg.batch_size} x "
              f"{cfg.seq_len} tokens)", flush=True)
    if not gpu and configs[0].steps == CPU.steps:  # the measured default (README, 2026-11-23)
        print(f"expected: about {CPU_MINUTES} minutes on 2 idle CPU cores, the first time with the corpus build; "
              "longer on a busy machine", flush=True)
    if gpu or (os.cpu_count() or 1) < 2:
        for cfg in configs:
            train(cfg, overwrite=True)
    else:
        from .corpus import default_dataset
        default_dataset(configs[0].data, vocab_size=configs[0].vocab_size, max_bytes=configs[0].data_max_bytes)
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            for line in pool.imap_unordered(_train_quietly, configs):
                print(line, flush=True)
    text, files = report([c.out for c in configs], out, title="fp4lab demo", baseline="bf16")
    verdicts = noise_verdicts(load_receipts([c.out for c in configs]))
    with open(Path(out) / "report.md", "a") as f:
        f.write("\n" + "\n".join(f"- {line}" for line in verdicts) + "\n")
    return text + "\n" + "\n".join(verdicts), files
