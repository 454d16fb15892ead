"""Philox4x32-10: Random123's known-answer vectors and the byte layout contract."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fp4lab.formats.rng import philox4x32, philox_rounds, random_bytes

# Random123 kat_vectors, philox4x32_10: (counter, key) -> output
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected):
    out = philox_rounds(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in out) == expected


def test_seed_splits_low_word_first_and_counter_high_word():
    seed, counter = 0xA4093822 | (0x299F31D0 << 32), 0x243F6A88 | (0x05A308D3 << 32)
    out = philox4x32(seed, torch.tensor([counter]))
    ref = philox_rounds(tuple(torch.tensor([c]) for c in (0x243F6A88, 0x05A308D3, 0, 0)),
                        (0xA4093822, 0x299F31D0))
    assert [int(w) for w in out] == [int(w) for w in ref]


def test_random_bytes_layout():
    b = random_bytes(7, 40)
    words = philox4x32(7, torch.arange(3))
    for n in range(40):
        word = int(words[(n % 16) // 4][n // 16])
        assert b[n].item() == (word >> (8 * (n % 4))) & 0xFF


def test_random_bytes_are_seeded_and_prefix_stable():
    assert torch.equal(random_bytes(3, 100)[:37], random_bytes(3, 37))
    assert not torch.equal(random_bytes(3, 64), random_bytes(4, 64))
    counts = torch.bincount(random_bytes(11, 256 * 400).long(), minlength=256).float()
    assert counts.min() > 400 - 5 * 20 and counts.max() < 400 + 5 * 20  # ~Binomial, sd ~ 20


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_range(seed):
    with pytest.raises(ValueError, match="seed"):
        random_bytes(seed, 4)


@given(st.integers(0, 2**64 - 1), st.integers(1, 80))
@settings(max_examples=60, deadline=None)
def test_a_tensor_seed_gives_the_int_seeds_bytes(seed, numel):
    # a seed a CUDA graph reads at replay (nn.seeds): one int64 element holding the seed's 64 bits
    # (two's complement above 2^63)
    held = torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed], dtype=torch.int64)
    assert torch.equal(random_bytes(held, numel), random_bytes(seed, numel))


@pytest.mark.parametrize("bad", [torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32)])
def test_a_tensor_seed_is_one_int64(bad):
    with pytest.raises(ValueError, match="holds one int64 element"):
        random_bytes(bad, 4)
