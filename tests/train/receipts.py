"""Synthetic receipts for tests that judge runs without training them."""

from __future__ import annotations

from fp4lab.nn.recipe import preset
from fp4lab.train.receipt import RECEIPT_SCHEMA, Receipt


def receipt_dict(name: str = "bf16-seed0", recipe: str = "bf16", seed: int = 0, final: float | None = 3.0, *,
                 status: str = "ok", curve=(4.0, 3.5), flip_rate=(), served: float | None = None,
                 served_fp4: float | None = None) -> dict:
    """A complete receipt.json object: evals at steps 10, 20, ... ending at ``final``."""
    evals = [{"step": 10 * (i + 1), "tokens": 1000 * (i + 1), "val_loss": v} for i, v in enumerate(curve)]
    evals[-1]["val_loss"] = final if final is not None else float("nan")
    return {"schema": RECEIPT_SCHEMA, "name": name, "status": status, "message": "",
            "config": {"batch_size": 10, "seq_len": 10, "recipe": recipe, "recipe_overrides": {"seed": seed}},
            "recipe": preset(recipe).to_dict(), "recipe_text": recipe, "model": {"depth": 2, "dim": 128},
            "params": 1000, "active_params": 1000,
            "data": {"source": "synthetic", "path": "/nowhere", "tokens": 1, "identity": {"sha256": None},
                     "vocab_size": 256, "tokenizer_sha256": None, "eot_id": None, "split": None, "epochs": None},
            "seed": seed, "world": 1, "coverage": None, "git": {"sha": "0" * 40, "dirty": False, "diff_sha256": None},
            "device": "cpu", "versions": {"torch": "x"}, "backend": "reference", "evals": evals,
            "train_curve": [[10, 4.1], [20, 3.6]],
            "final": {"val_loss": final, "min_val_loss": final, "train_loss": 3.6, "steps": 20,
                      "bf16_forward_val_loss": served, "fp4_forward_val_loss": served_fp4},
            "wall_s": 1.0, "tokens_per_s": 100.0, "mfu": None, "flip_rate": [list(p) for p in flip_rate]}


def make_receipt(*args, **kwargs) -> Receipt:
    """``receipt_dict``'s receipt, read as a Receipt."""
    return Receipt.from_dict(receipt_dict(*args, **kwargs))
