"""The checkout under test, for tests that start a Python subprocess: it imports fp4lab (and
tests) from here, installed or not (the GPU machines run the suite from an uninstalled copy)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(*, interpret: bool = True, **extra: str) -> dict[str, str]:
    """os.environ with ROOT first on PYTHONPATH and ``extra`` set; ``interpret=False`` drops
    TRITON_INTERPRET (a subprocess that compiles, or traces, for a real GPU)."""
    env = {k: v for k, v in os.environ.items() if interpret or k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**env, **extra}
