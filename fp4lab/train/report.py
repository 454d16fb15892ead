"""Tables and plots rebuilt from receipts alone.

``report(run_dirs, out_dir)`` reads each run's receipt.json and writes
    report.md        one row per run: final and min valid loss, gap to the BF16 arm (absolute
                     and %), tokens/s and its ratio to BF16, status
    loss.png         valid-loss curves (and train loss, faint) against tokens
    gap.png          valid-loss gap to the BF16 arm against step (where a BF16 arm exists)
The BF16 arm is the run whose recipe quantizes nothing (the first such, when several).

Public: ``load_receipts``, ``gap_table``, ``plots``, ``report``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..nn.recipe import Recipe


def load_receipts(run_dirs: list[Path]) -> list[dict[str, Any]]:
    receipts = []
    for run in map(Path, run_dirs):
        path = run / "receipt.json" if run.is_dir() else run
        if not path.is_file():
            raise FileNotFoundError(f"{run}: no receipt.json (did the run finish?)")
        receipts.append(json.loads(path.read_text()))
    return receipts


def _is_bf16(receipt: dict) -> bool:
    return not Recipe.from_dict(receipt["recipe"]).quantized


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def gap_table(receipts: list[dict[str, Any]]) -> str:
    """The markdown table described in the module doc."""
    base = next((r for r in receipts if _is_bf16(r)), None)
    lines = ["| run | recipe | final val | min val | gap to bf16 | gap % | tokens/s | x bf16 | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in receipts:
        final, best = r["final"]["val_loss"], r["final"]["min_val_loss"]
        gap = pct = speed = None
        if base is not None and final is not None and base["final"]["val_loss"] is not None:
            gap = final - base["final"]["val_loss"]
            pct = 100 * gap / base["final"]["val_loss"]
        if base is not None and r.get("tokens_per_s") and base.get("tokens_per_s"):
            speed = r["tokens_per_s"] / base["tokens_per_s"]
        lines.append(f"| {r['name']} | {r['recipe']['name']} | {_fmt(final, '.4f')} | {_fmt(best, '.4f')} | "
                     f"{_fmt(gap, '+.4f')} | {_fmt(pct, '+.2f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_fmt(speed, '.2f')} | {r['status']} |")
    return "\n".join(lines)


def plots(receipts: list[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in receipts:
        tokens_per_step = r["config"]["batch_size"] * r["config"]["seq_len"]
        line, = ax.plot([e["tokens"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], marker="o",
                        markersize=3, label=f"{r['name']} (val)")
        if r.get("train_curve"):
            steps, losses = zip(*r["train_curve"])
            ax.plot([s * tokens_per_step for s in steps], losses, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set(xlabel="tokens", ylabel="loss", title=f"{title}: validation loss (train faint)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    finals = [e["val_loss"] for r in receipts for e in r["evals"][len(r["evals"]) // 3:]]
    if finals:
        ax.set_ylim(min(finals) - 0.1, max(finals) + 0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=120)
    written.append(out_dir / "loss.png")
    plt.close(fig)
    base = next((r for r in receipts if _is_bf16(r)), None)
    if base is not None:
        ref = {e["step"]: e["val_loss"] for e in base["evals"]}
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in receipts:
            if r is base:
                continue
            pts = [(e["step"], e["val_loss"] - ref[e["step"]]) for e in r["evals"] if e["step"] in ref]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=r["name"])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(xlabel="step", ylabel=f"val loss - {base['name']}", title=f"{title}: gap to BF16")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "gap.png", dpi=120)
        written.append(out_dir / "gap.png")
        plt.close(fig)
    return written


def report(run_dirs: list[Path], out_dir: Path, *, title: str = "fp4lab") -> tuple[str, list[Path]]:
    """Write report.md (and the plots) into out_dir -> (the table, the files written)."""
    receipts = load_receipts(run_dirs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = gap_table(receipts)
    env = receipts[0]
    header = (f"# {title}\n\n{len(receipts)} runs; device {env['device']}; torch {env['versions']['torch']}; "
              f"git {env['git']['sha'][:12]}; data {env['data']['source']} "
              f"({env['data']['tokens']:,} tokens, sha256 {str(env['data']['identity'].get('sha256'))[:12]})\n\n")
    (out_dir / "report.md").write_text(header + table + "\n")
    return table, [out_dir / "report.md"] + plots(receipts, out_dir, title)
