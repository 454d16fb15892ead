"""Start-up cost of the command line: wall time of a fresh interpreter answering, side by side
with the cost of importing torch on the same machine (what a command that trains pays anyway).

    fp4lab --help            the subcommand list (no subcommand's parser is built)
    fp4lab train --help      one subcommand's full parser
    fp4lab train (bad flag)  an argument error, answered before anything is imported
    import torch             the floor of any command that touches tensors

Medians of repeated runs; JSON to benchmarks/results/startup.json.

    python benchmarks/bench_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {"fp4lab --help": ["-m", "fp4lab", "--help"],
         "fp4lab train --help": ["-m", "fp4lab", "train", "--help"],
         "fp4lab train --steps x": ["-m", "fp4lab", "train", "--steps", "x"],
         "import torch": ["-c", "import torch"]}


def wall(args: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seconds = {name: wall(argv, args.repeats) for name, argv in CASES.items()}
    for name, s in seconds.items():
        print(f"{name:26s} {s:6.3f} s   {s / seconds['import torch']:5.2f}x import torch")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "startup.json"
    out.write_text(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                               "repeats": args.repeats, "median_seconds": seconds}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
