"""Hadamard transforms: orthonormality, the explicit matrix, determinism, Wgrad cancellation."""

import pytest
import torch

from fp4lab.formats import hadamard_matrix, hadamard_signs, hadamard_transform
from fp4lab.formats.hadamard import TE_SIGNS

CASES = [(16, "none"), (16, "te"), (16, "random"), (32, "none"), (32, "random")]


@pytest.mark.parametrize("size,signs", CASES)
def test_orthonormal_and_equal_to_the_explicit_matrix(size, signs):
    m = hadamard_matrix(size, signs, seed=5)
    assert torch.allclose(m @ m.T, torch.eye(size), atol=1e-6)
    i = torch.arange(size)
    popcount = torch.zeros(size, size, dtype=torch.int64)
    for bit in range(6):
        popcount += ((i[:, None] & i[None, :]) >> bit) & 1
    sylvester = (1 - 2 * (popcount % 2)).double()
    explicit = torch.diag(hadamard_signs(size, signs, seed=5).double()) @ sylvester / size**0.5
    assert torch.allclose(m.double(), explicit, atol=1e-7)


def test_te_signs_and_random_signs_are_seeded():
    assert hadamard_signs(16, "te").tolist() == list(TE_SIGNS)
    assert torch.equal(hadamard_signs(32, "random", 1), hadamard_signs(32, "random", 1))
    assert not torch.equal(hadamard_signs(32, "random", 1), hadamard_signs(32, "random", 2))
    with pytest.raises(ValueError, match="16 entries"):
        hadamard_signs(32, "te")
    with pytest.raises(ValueError, match="size"):
        hadamard_signs(8)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_transform_is_a_blockwise_product_along_the_axis(axis):
    x = torch.randn(32, 64, dtype=torch.float64).float()
    y = hadamard_transform(x, axis=axis, signs="te")
    m = hadamard_matrix(16, "te").double()
    xm = x.double().movedim(axis, -1)
    ref = (xm.reshape(*xm.shape[:-1], -1, 16) @ m).reshape(xm.shape).movedim(-1, axis)
    assert torch.allclose(y.double(), ref, atol=1e-5)


def test_bf16_in_bf16_out_rounded_once():
    x = torch.randn(8, 32).to(torch.bfloat16)
    y = hadamard_transform(x, signs="te")
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, hadamard_transform(x.float(), signs="te").to(torch.bfloat16))
    assert hadamard_transform(x, dtype=torch.float32).dtype == torch.float32


def test_rotation_cancels_in_a_wgrad_shaped_product():
    dy, x = torch.randn(64, 24, dtype=torch.float64), torch.randn(64, 40, dtype=torch.float64)
    for signs, seed in [("none", None), ("te", None), ("random", 7)]:
        rdy = hadamard_transform(dy.float(), axis=0, signs=signs, seed=seed).double()
        rx = hadamard_transform(x.float(), axis=0, signs=signs, seed=seed).double()
        assert torch.allclose(rdy.T @ rx, dy.T @ x, atol=1e-4)


def test_empty_leading_dimension():
    assert hadamard_transform(torch.zeros(0, 16)).shape == (0, 16)


def test_errors():
    with pytest.raises(ValueError, match="not divisible by the Hadamard size 16"):
        hadamard_transform(torch.randn(4, 24))
    with pytest.raises(TypeError):
        hadamard_transform(torch.ones(4, 16, dtype=torch.int32))
