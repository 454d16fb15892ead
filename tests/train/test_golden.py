"""Golden losses: a short fixed run per recipe preset (and the MoE path) whose loss curve is
committed in tests/golden/losses.json. A refactor that should change nothing must leave these
curves as they are; a change that means to alter numerics regenerates them on purpose:

    FP4LAB_UPDATE_GOLDEN=1 python -m pytest tests/train/test_golden.py

The tolerance only absorbs float32 summation-order differences between CPUs (a BLAS picks its
kernel by instruction set); a real numerics change moves these losses by far more.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fp4lab.train.loop import TrainConfig, train

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "losses.json"
RTOL = 2e-4

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
def test_loss_curve_matches_golden(name, token_file, tmp_path):
    got = _run(token_file, tmp_path / name, *RUNS[name])
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("FP4LAB_UPDATE_GOLDEN") == "1":
        golden[name] = got
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        return
    assert name in golden, f"no golden curve for {name}: run with FP4LAB_UPDATE_GOLDEN=1"
    assert got["train"] == pytest.approx(golden[name]["train"], rel=RTOL)
    assert got["val"] == pytest.approx(golden[name]["val"], rel=RTOL)
