"""``fp4lab demo``: BF16, NVFP4 and MXFP4 side by side on the built-in corpus, then the gap table.

On a CPU (about 4 minutes on 2 cores): the "tiny" GPT (2 blocks, D = 128) on a 4 MB prefix of
the standard-library corpus with a 4096-entry BPE, 100 steps of 16 x 128 tokens; every linear
in the blocks quantized (the tiny model has no blocks to spare for NVIDIA's BF16 layers). On a
GPU: the "d6" GPT (16.9M parameters with this vocabulary) on the full Python corpus, 400 steps of
32 x 512 tokens, NVIDIA's recipe as published (first and last block BF16). Writes one run
directory per arm, report.md, loss.png and gap.png under ``out``.

Public: ``ARMS``, ``demo_configs``, ``run_demo``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .loop import TrainConfig, train
from .report import report

ARMS = ("bf16", "nvfp4", "mxfp4")
CPU = TrainConfig(model="tiny", data="stdlib", data_max_bytes=4_000_000, vocab_size=4096, steps=100,
                  batch_size=16, seq_len=128, lr=3e-3, warmup=10, eval_every=20, eval_batches=8)
GPU = TrainConfig(model="d6", data="python", vocab_size=8192, steps=400, batch_size=32, seq_len=512,
                  lr=2e-3, warmup=40, eval_every=50, eval_batches=16)


def demo_configs(out: Path, *, arms=ARMS, gpu: bool | None = None, **changes) -> list[TrainConfig]:
    """One TrainConfig per arm (``changes``: TrainConfig fields, e.g. steps=20)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    base = dataclasses.replace(GPU if gpu else CPU, **changes)
    # the 2-block CPU model has no blocks to spare: NVIDIA's BF16 first/last blocks would leave none in FP4
    keep = {} if gpu else {"keep_first": 0, "keep_last": 0}
    return [dataclasses.replace(base, out=str(Path(out) / arm), recipe=arm, recipe_overrides=keep) for arm in arms]


def run_demo(out: Path, *, arms=ARMS, gpu: bool | None = None, **changes) -> tuple[str, list[Path]]:
    """Train every arm, then write the report -> (the gap table, the files written)."""
    configs = demo_configs(out, arms=arms, gpu=gpu, **changes)
    for cfg in configs:
        print(f"training {cfg.recipe} ({cfg.model}, {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens)",
              flush=True)
        train(cfg)
    return report([c.out for c in configs], out, title="fp4lab demo")
