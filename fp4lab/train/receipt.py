"""What a receipt pins about the machine and the code: versions, device, git commit and dirt.

``environment(device)`` -> {"git": {"sha", "dirty", "diff_sha256"}, "versions": {...},
"device": name}. The device machine gets the tree without .git, so FP4LAB_GIT_SHA (set by
whoever launches the run) takes precedence. ``peak_flops`` gives dense BF16 tensor-core peaks
for MFU (None where unknown, e.g. CPUs).

Public: ``environment``, ``peak_flops``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

# dense BF16 peak, FLOP/s (vendor datasheets, SXM parts)
_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAKS.items() if key in name), None)


def _git() -> dict:
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    sha = os.environ.get("FP4LAB_GIT_SHA") or git("rev-parse", "HEAD").strip() or "unknown"
    diff = git("diff", "HEAD")
    return {"sha": sha, "dirty": bool(diff), "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"git": _git(), "device": name,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": _version("triton"), "fp4lab": _version("fp4lab")}}
