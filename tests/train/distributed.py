"""Several ranks on the CPU: torchrun (gloo) in a subprocess, for the tests that compare ranks."""

from __future__ import annotations

import subprocess
import sys

from ..checkout import ROOT, subprocess_env


def torchrun(n: int, *args: str, timeout: float = 300) -> None:
    """``torchrun --standalone --nproc_per_node n ARGS`` (a free port, one thread per rank, no GPU
    visible: the ranks are CPU ranks on any machine); AssertionError with the end of its stderr if
    it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *args]
    env = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
