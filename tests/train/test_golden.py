"""Golden losses: a short fixed run per recipe preset (and the MoE path) whose loss curve is
committed in tests/golden/losses.json. A refactor that should change nothing must leave these
curves as they are; a change that means to alter numerics regenerates them on purpose:

    FP4LAB_UPDATE_GOLDEN=1 python -m pytest tests/train/test_golden.py

The tolerance only absorbs float32 summation-order differences between CPUs (a BLAS picks its
kernel by instruction set and vendor). FP4 rounding can amplify those: one block's code flips and
a 6-step curve ends up to 1% away (seen on an AMD EPYC, AVX512, for 4 of these runs, with code
that passed on another CPU). So a curve may also match one recorded on another CPU
(tests/golden/losses_by_cpu.json, keyed by vendor and instruction set; a code change that moves
numerics matches none of them). Record this CPU's curves, once, where they differ:

    FP4LAB_ADD_GOLDEN_CPU=1 python -m pytest tests/train/test_golden.py

FP4LAB_UPDATE_GOLDEN=1 (a deliberate numerics change) clears the other CPUs' curves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fp4lab.train.loop import TrainConfig, train

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "losses.json"
BY_CPU = GOLDEN.with_name("losses_by_cpu.json")
RTOL = 2e-4


def cpu_key() -> str:
    """'<vendor>-<instruction set torch dispatches to>', e.g. 'AuthenticAMD-AVX512'."""
    vendor = "unknown"
    try:
        vendor = next(line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("vendor_id"))
    except (OSError, StopIteration):
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def _matches(got: dict, want: dict) -> bool:
    return got["train"] == pytest.approx(want["train"], rel=RTOL) and got["val"] == pytest.approx(want["val"], rel=RTOL)

RUNS = {
    "bf16": ("tiny", "bf16", {}),
    "nvfp4": ("tiny", "nvfp4", {"keep_first": 0, "keep_last": 0}),
    "nvfp4_plain": ("tiny", "nvfp4_plain", {}),
    "nvfp4_torchao_dither": ("tiny", "nvfp4_plain", {"fprop.b.profile": "torchao", "fprop.b.dither": 1.0, "dgrad.b.dither": 1.0,
                                                     "wgrad.hadamard": "random"}),
    "mxfp4": ("tiny", "mxfp4", {}),
    "mxfp4_rceil": ("tiny", "mxfp4_rceil", {}),
    "mxfp4_hadamard": ("tiny", "mxfp4_hadamard", {}),
    "fprop": ("tiny", "fprop", {}),
    "fprop_dgrad": ("tiny", "fprop_dgrad", {}),
    "fprop_dgrad_wgrad": ("tiny", "fprop_dgrad_wgrad", {}),
    "moe_bf16": ("moe-tiny", "bf16", {}),
    "moe_nvfp4": ("moe-tiny", "nvfp4", {"keep_first": 0, "keep_last": 0}),
    "moe_mxfp4": ("moe-tiny", "mxfp4", {}),
}


def _run(token_file, out, model: str, recipe: str, overrides: dict) -> dict:
    cfg = TrainConfig(out=str(out), model=model, data=str(token_file), steps=6, batch_size=4, seq_len=32,
                      lr=3e-3, warmup=2, eval_every=3, eval_batches=1, log_every=3, progress=False,
                      recipe=recipe, recipe_overrides=overrides)
    receipt = train(cfg)
    return {"train": [loss for _, loss in receipt["train_curve"]], "val": [e["val_loss"] for e in receipt["evals"]]}


@pytest.mark.parametrize("name", list(RUNS))
def test_loss_curve_matches_golden(name, token_file, tmp_path):  # (CPU runs, on any machine: conftest)
    got = _run(token_file, tmp_path / name, *RUNS[name])
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    by_cpu = json.loads(BY_CPU.read_text()) if BY_CPU.exists() else {}
    if os.environ.get("FP4LAB_UPDATE_GOLDEN") == "1":
        golden[name] = got
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        by_cpu = {cpu: {k: v for k, v in runs.items() if k != name} for cpu, runs in by_cpu.items()}
        BY_CPU.write_text(json.dumps({c: r for c, r in sorted(by_cpu.items()) if r}, indent=1) + "\n")
        return
    assert name in golden, f"no golden curve for {name}: run with FP4LAB_UPDATE_GOLDEN=1"
    known = {"the reference CPU": golden[name]} | {cpu: runs[name] for cpu, runs in by_cpu.items() if name in runs}
    if os.environ.get("FP4LAB_ADD_GOLDEN_CPU") == "1" and not any(_matches(got, w) for w in known.values()):
        by_cpu.setdefault(cpu_key(), {})[name] = got
        BY_CPU.write_text(json.dumps(by_cpu, indent=1, sort_keys=True) + "\n")
        return
    assert any(_matches(got, want) for want in known.values()), (
        f"{name}: the loss curve {got} matches none recorded ({', '.join(known)}); this CPU is {cpu_key()}")
