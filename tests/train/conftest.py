"""Fixtures for the trainer tests: a small token file whose next token is learnable."""

from __future__ import annotations

import numpy as np
import pytest

from fp4lab.train.data import write_bin


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
