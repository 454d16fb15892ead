"""Runs that should agree (e.g. 1 GPU vs 2 GPUs at the same global batch).

    python scripts/compare_runs.py RUN_A RUN_B [RUN_C RUN_D ...]             pairs, in order
    python scripts/compare_runs.py PAIRS... --reference RUN [RUN ...]        and each pair's second run
                                                                             against the reference runs
                                                                             of its recipe (seeds)

The first table: the largest train-loss difference step by step and the final validation difference
of each pair (the same seed: the same init and data order). The second: whether each run's final
validation loss lies inside the reference seeds' 95% interval of the mean, and inside the 95%
prediction interval for one more run (mean +- t * sd * sqrt(1 + 1/n)), the interval a run that
differs only by chance falls in.
"""

import argparse
import math
import statistics

from fp4lab.train.receipt import Receipt
from fp4lab.train.stats import t_quantile


def pairs_table(runs: list[Receipt]) -> list[str]:
    lines = ["| run | vs | steps | max abs train-loss diff | at step | final val diff | tokens/s ratio |",
             "|---|---|---|---|---|---|---|"]
    for ra, rb in zip(runs[::2], runs[1::2]):
        diffs = [(abs(la - lb), s) for (s, la), (_, lb) in zip(ra.train_curve, rb.train_curve)]
        worst, at = max(diffs)
        val = rb.final.val_loss - ra.final.val_loss
        lines.append(f"| {rb.name} | {ra.name} | {len(diffs)} | {worst:.2e} | {at} | {val:+.4f} | "
                     f"{rb.tokens_per_s / ra.tokens_per_s:.2f} |")
    return lines


def interval_table(runs: list[Receipt], reference: list[Receipt]) -> list[str]:
    lines = ["| run | recipe | final val | reference seeds | mean +- sd | 95% CI of the mean | inside? "
             "| 95% prediction interval | inside? |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        values = [r.final.val_loss for r in reference if r.config["recipe"] == run.config["recipe"]]
        if len(values) < 2:
            lines.append(f"| {run.name} | {run.config['recipe']} | {run.final.val_loss:.4f} | {len(values)} "
                         "| - | - | - | - | - |")
            continue
        n, mean, sd = len(values), statistics.fmean(values), statistics.stdev(values)
        t = t_quantile(0.975, n - 1)
        ci, pi = t * sd / math.sqrt(n), t * sd * math.sqrt(1 + 1 / n)
        v = run.final.val_loss
        lines.append(f"| {run.name} | {run.config['recipe']} | {v:.4f} | {n} | {mean:.4f} +- {sd:.4f} "
                     f"| [{mean - ci:.4f}, {mean + ci:.4f}] | {'yes' if abs(v - mean) <= ci else 'no'} "
                     f"| [{mean - pi:.4f}, {mean + pi:.4f}] | {'yes' if abs(v - mean) <= pi else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", help="run directories, in pairs")
    parser.add_argument("--reference", nargs="*", default=[], help="reference runs (seeds), any recipes")
    args = parser.parse_args(argv)
    if len(args.pairs) % 2:
        raise SystemExit("give run directories in pairs")
    runs = [Receipt.load(p) for p in args.pairs]
    lines = pairs_table(runs)
    if args.reference:
        lines += [""] + interval_table(runs[1::2], [Receipt.load(p) for p in args.reference])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
