"""Fixtures for the trainer tests: a small token file whose next token is learnable; the trainer
on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4lab.train.data import write_bin


@pytest.fixture(autouse=True)
def trainer_on_the_cpu(request, monkeypatch):
    """The trainer takes a GPU where there is one; these tests were written for its CPU runs (the
    reference kernels, a float32 BLAS, golden curves, exact resumes): on a machine with a GPU they
    hide it, so they test there what they test in CI. A module about the GPU path
    (``USES_THE_GPU = True``: test_graphed.py) keeps it."""
    if not getattr(request.module, "USES_THE_GPU", False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    """40k tokens of a noisy repeating pattern over a 256-token vocabulary (loss can fall)."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=97)
    tokens = np.tile(pattern, 420)[:40_000].copy()
    noise = rng.random(tokens.size) < 0.1
    tokens[noise] = rng.integers(0, 256, size=int(noise.sum()))
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    write_bin(path, tokens)
    return path
