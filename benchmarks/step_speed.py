"""The step-speed figures (FP4 step against BF16, quantize against copy bandwidth) in one table,
from the benchmarks' own JSON files, with each figure's target and the run it came from.

    python benchmarks/step_speed.py [--results benchmarks/results]

Reads model.json (d12: bench_model.py --model d12 --batch 16 --seq 1024), model_moe64.json
(--model moe64 --batch 8 --seq 1024), linear.json (bench_linear.py) and quantize.json
(bench_quantize.py); a figure whose run is missing, or lacks the mode, reads "not measured".
Each row names the git commit and date of its file: a table is "one device run" only where
they agree, and the output says whether they do. Writes <results>/step_speed.md. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Figure:
    label: str
    source: str  # the JSON file under results/
    read: Callable[[dict], float | None]
    target: float | None  # None: reported beside a target row, not judged
    at_least: bool = False  # True: higher is better (tokens/s, bandwidth)
    unit: str = "x"
    # where arithmetic bounds the figure whatever the kernel does; or read from the run: the same
    # comparison with no host work (both steps replayed from CUDA graphs), what the row would read
    # if launching cost nothing on either side
    bound: str | Callable[[dict], str | None] = ""


def _step_ratio(arm: str, mode: str, base_mode: str | None = None) -> Callable[[dict], float | None]:
    """NVFP4's step time over BF16's, the arm in ``mode`` against BF16 in ``base_mode`` (default the same)."""
    def read(run: dict) -> float | None:
        arms = run.get("arms", {})
        fp4, bf16 = arms.get(f"{arm}/{mode}"), arms.get(f"bf16/{base_mode or mode}")
        return None if fp4 is None or bf16 is None else fp4["step_ms"] / bf16["step_ms"]
    return read


def _tokens_per_s(mode: str) -> Callable[[dict], float | None]:
    return lambda run: run.get("arms", {}).get(f"bf16/{mode}", {}).get("tokens_per_s")


def _linear(shape: str, key: str) -> Callable[[dict], float | None]:
    return lambda run: run.get("shapes", {}).get(shape, {}).get(key)


def _gpu_alone(ratio: Callable[[dict], float | None]) -> Callable[[dict], str | None]:
    """The bound of a host-bound row: its comparison with the host's work taken away (``ratio``:
    both arms replayed from CUDA graphs, in the same run): the part of the miss that is the GPU's."""
    def read(run: dict) -> str | None:
        value = ratio(run)
        return None if value is None else f"{value:.2f}x the GPU's work alone (both graphed)"
    return read


def _over_copy(case: str) -> Callable[[dict], float | None]:
    return lambda run: run.get("cases", {}).get(case, {}).get("over_copy")


_BIG, _SMALL = "M8192_K4096_N4096", "M4096_K2048_N2048"
# bench_quantize counts one read of bf16 x and the codes and scales written: 2 + 0.5 + 1/16 bytes
# an element; an amax pass first reads x once more, 2 bytes: at full copy speed both passes
# together reach 2.5625 / 4.5625 of the single-pass figure
_TWO_PASSES = f"at most {2.5625 / 4.5625:.2f} with the amax pass: x read twice"
FIGURES = (
    Figure("d12 step, NVFP4 / BF16, eager (16 x 1024 tokens)", "model.json", _step_ratio("nvfp4", "eager"), 1.30,
           bound=_gpu_alone(_step_ratio("nvfp4", "graphed"))),
    Figure("d12 step, graphed", "model.json", _step_ratio("nvfp4", "graphed"), None),
    Figure("d12 step, compiled, against compiled BF16", "model.json", _step_ratio("nvfp4", "compiled"), 1.30,
           bound=_gpu_alone(_step_ratio("nvfp4", "compiled_graphed"))),
    Figure("the same, FP4 compiled under Inductor's C++ wrapper (`cpp_wrapper=true`)", "model.json",
           _step_ratio("nvfp4:cpp", "compiled"), 1.30, bound=_gpu_alone(_step_ratio("nvfp4", "compiled_graphed"))),
    Figure("d12 step, compiled + graphed, against compiled + graphed BF16", "model.json",
           _step_ratio("nvfp4", "compiled_graphed"), None),
    Figure("NVFP4 linear fwd+bwd 8192 x 4096 x 4096, eager wall / BF16", "linear.json",
           _linear(_BIG, "nvfp4_over_bf16_eager"), 1.30, bound=_gpu_alone(_linear(_BIG, "nvfp4_over_bf16_graphed"))),
    Figure("the same, graphed", "linear.json", _linear(_BIG, "nvfp4_over_bf16_graphed"), None),
    Figure("NVFP4 linear fwd+bwd 4096 x 2048 x 2048, eager wall / BF16", "linear.json",
           _linear(_SMALL, "nvfp4_over_bf16_eager"), 2.0,
           bound=_gpu_alone(_linear(_SMALL, "nvfp4_over_bf16_graphed"))),
    Figure("the same, graphed", "linear.json", _linear(_SMALL, "nvfp4_over_bf16_graphed"), None),
    Figure("moe64 step in BF16, eager (8 x 1024 tokens), tokens/s", "model_moe64.json", _tokens_per_s("eager"),
           150e3, at_least=True, unit="tokens/s"),
    Figure("moe64 BF16, compiled + graphed, tokens/s", "model_moe64.json", _tokens_per_s("compiled_graphed"), None,
           at_least=True, unit="tokens/s"),
    Figure("moe64 step, NVFP4 / BF16, both compiled + graphed (the fast baseline)", "model_moe64.json",
           _step_ratio("nvfp4", "compiled_graphed"), 1.5),
    Figure("moe64 step, NVFP4 / BF16, both graphed", "model_moe64.json", _step_ratio("nvfp4", "graphed"), None),
    Figure("quantize incl. amax, over copy bandwidth", "quantize.json", _over_copy("nvfp4_rtne"), 0.60,
           at_least=True, unit="of copy", bound=_TWO_PASSES),
    Figure("quantize, amax given, over copy bandwidth", "quantize.json", _over_copy("nvfp4_rtne_amax_given"), 0.85,
           at_least=True, unit="of copy"),
    Figure("quantize RHT + SR, over copy bandwidth", "quantize.json", _over_copy("nvfp4_rht_sr"), 0.50,
           at_least=True, unit="of copy", bound=_TWO_PASSES + " (the rotated tensor's amax)"),
)


def _shown(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    if unit == "tokens/s":
        return f"{value / 1e3:.1f}k tokens/s"
    return f"{value:.2f}{'x' if unit == 'x' else ' ' + unit}"


def table(results: Path) -> str:
    runs = {}
    for name in sorted({f.source for f in FIGURES}):
        path = results / name
        runs[name] = json.loads(path.read_text()) if path.exists() else {}
    lines = ["| figure | measured | target | met | bound | run (git, date, device) |", "|---|---|---|---|---|---|"]
    for f in FIGURES:
        run = runs[f.source]
        value = f.read(run) if run else None
        if f.target is None or value is None:
            met = "-"
        else:
            met = "yes" if (value >= f.target if f.at_least else value <= f.target) else "no"
        target = "-" if f.target is None else ("at least " if f.at_least else "at most ") + _shown(f.target, f.unit)
        where = (f"{f.source}: {run.get('git', '?')}, {run.get('date', '?')}, {run.get('device', '?')}" if run
                 else f"{f.source}: missing")
        bound = (f.bound(run) if run else None) if callable(f.bound) else f.bound
        lines.append(f"| {f.label} | {_shown(value, f.unit)} | {target} | {met} | {bound or '-'} | {where} |")
    commits = {run.get("git") for run in runs.values() if run}
    lines.append("")
    lines.append("One device run: every figure from one commit." if len(commits) == 1 else
                 f"Not one run: the files come from commits {', '.join(sorted(str(c) for c in commits))}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    text = table(args.results)
    (args.results / "step_speed.md").write_text("# Step speed against the targets\n\n" + text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
