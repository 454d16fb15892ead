"""Does a GPU training run repeat its bits? Reruns of one config, default and deterministic, eager and graphed.

Not a timing: a reproducibility check that needs a GPU. Trains the same small NVIDIA-recipe run
(d6 by default, 64 x 512 tokens a step, synthetic tokens) several ways and compares each with the
first default run: the first step whose train loss differs, and the final validation loss.
By default cuDNN's attention backward may sum in another order on a rerun; the trainer's
``deterministic`` setting asks torch for reproducible kernels (train.config).

    python benchmarks/rerun_bits.py [--steps 20] [--model d6]

Writes benchmarks/results/rerun_bits.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

# cuBLAS reads its workspace setting once per process: fixed for every run here, so what still
# varies between default reruns is the kernels torch picks (the deterministic setting's part)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, save  # noqa: E402
from fp4lab.train.data import write_bin  # noqa: E402
from fp4lab.train.loop import TrainConfig, train  # noqa: E402

WAYS = {  # name -> settings on top of the shared config
    "default": {}, "default again": {},
    "deterministic": {"deterministic": True}, "deterministic again": {"deterministic": True},
    "deterministic graphed": {"deterministic": True, "cuda_graph": True},
}


def first_difference(a: list, b: list) -> int | None:
    return next((step for (step, x), (_, y) in zip(a, b) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="d6")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = np.tile(rng.integers(0, 256, size=97), 4000)
        noise = rng.random(tokens.size) < 0.1
        tokens[noise] = rng.integers(0, 256, size=int(noise.sum()))
        write_bin(Path(tmp) / "train.bin", tokens)
        receipts = {}
        for name, settings in WAYS.items():
            cfg = TrainConfig(out=str(Path(tmp) / name.replace(" ", "_")), model=args.model,
                              data=str(Path(tmp) / "train.bin"), recipe="nvfp4", steps=args.steps,
                              batch_size=64, seq_len=512, lr=3e-3, warmup=4,
                              eval_every=args.steps, eval_batches=2, log_every=10, progress=False, **settings)
            receipts[name] = train(cfg)
    base, det = receipts["default"], receipts["deterministic"]
    rows = {}
    for name, r in receipts.items():
        ref = det if "deterministic" in name and name != "deterministic" else base
        differs = first_difference(ref.train_curve, r.train_curve) if r is not ref else None
        rows[name] = {"against": "deterministic" if ref is det else "default", "first_differing_step": differs,
                      "final_val": r.final.val_loss, "final_val_minus_reference": r.final.val_loss - ref.final.val_loss,
                      "tokens_per_s": r.tokens_per_s}
        print(f"{name:22s} vs {rows[name]['against']:13s}: first differing step {rows[name]['first_differing_step']}, "
              f"final val {r.final.val_loss:.6f} ({rows[name]['final_val_minus_reference']:+.2e}), "
              f"{r.tokens_per_s:,.0f} tok/s", flush=True)
    save("rerun_bits", {**environment(), "steps": args.steps, "runs": rows})


if __name__ == "__main__":
    main()
