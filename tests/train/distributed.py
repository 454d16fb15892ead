"""Several ranks on the CPU: torchrun (gloo) in a subprocess, for the tests that compare ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout under test: the ranks import fp4lab (and tests) from here, not from an install."""


def torchrun(n: int, *args: str, timeout: float = 300) -> None:
    """``torchrun --standalone --nproc_per_node n ARGS`` (a free port, one thread per rank);
    AssertionError with the end of its stderr if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
