"""Pairs of runs that should agree (e.g. 1 GPU vs 2 GPUs): the largest train- and val-loss gaps.

    python scripts/compare_runs.py RUN_A RUN_B [RUN_C RUN_D ...]    (pairs, in order)
"""

import sys

from fp4lab.train.receipt import Receipt


def main(runs: list[str]) -> None:
    if len(runs) % 2:
        raise SystemExit("give run directories in pairs")
    print("| run | vs | steps | max abs train-loss diff | at step | final val diff | tokens/s ratio |")
    print("|---|---|---|---|---|---|---|")
    for a, b in zip(runs[::2], runs[1::2]):
        ra, rb = Receipt.load(a), Receipt.load(b)
        diffs = [(abs(la - lb), s) for (s, la), (_, lb) in zip(ra.train_curve, rb.train_curve)]
        worst, at = max(diffs)
        val = rb.final.val_loss - ra.final.val_loss
        print(f"| {rb.name} | {ra.name} | {len(diffs)} | {worst:.2e} | {at} | {val:+.2e} | "
              f"{rb.tokens_per_s / ra.tokens_per_s:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
