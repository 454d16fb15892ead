"""Token shards and the deterministic, seekable, rank-sharded batch stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4lab.train.data import TokenStream, load_tokens, write_bin


def test_bin_round_trip_and_npy(tmp_path):
    tokens = np.arange(1000, dtype=np.int64) % 65536
    write_bin(tmp_path / "a.bin", tokens)
    assert np.array_equal(load_tokens(tmp_path / "a.bin"), tokens)
    header = np.fromfile(tmp_path / "a.bin", dtype=np.int32, count=3)
    assert header.tolist() == [20240520, 1, 1000]
    np.save(tmp_path / "b.npy", np.arange(5, dtype=np.uint32) + 70000)
    both = load_tokens(tmp_path)  # a directory: sorted, concatenated
    assert both.tolist() == tokens.tolist() + [70000, 70001, 70002, 70003, 70004]


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_damaged_bin_is_refused(tmp_path, damage):
    path = tmp_path / "a.bin"
    write_bin(path, np.arange(100))
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[0] ^= 1
    else:
        data = data[:-10]
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="magic|truncated"):
        load_tokens(path)


def test_write_bin_refuses_ids_beyond_uint16(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        write_bin(tmp_path / "a.bin", np.array([0, 65536]))
    assert not (tmp_path / "a.bin").exists()


def test_npy_of_the_wrong_dtype_is_refused(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="uint16/uint32"):
        load_tokens(tmp_path / "f.npy")


def _stream(tokens, **kw):
    return TokenStream(tokens, **{"seq_len": 16, "batch_size": 8, "seed": 3, **kw})


def test_stream_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(5000) % 251
    a, b = _stream(tokens), _stream(tokens)
    for step in (0, 1, 7):  # b is asked out of order: seekable, no hidden position
        assert torch.equal(a.batch(step)[0], b.batch(step)[0])
    late = _stream(tokens).batch(40)  # past the first epoch (n_train // 8 < 40)
    assert torch.equal(late[0], _stream(tokens).batch(40)[0])
    assert not torch.equal(a.batch(0)[0], _stream(tokens, seed=4).batch(0)[0])
    x, y = a.batch(2)
    assert x.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_rank_shares_make_up_the_global_batch():
    tokens = np.arange(5000) % 251
    whole = _stream(tokens).batch(5)[0]
    shares = [_stream(tokens, rank=r, world=2).batch(5)[0] for r in range(2)]
    assert torch.equal(torch.cat(shares), whole)
    # more batches asked than the split holds: every world size stops after the same whole batches
    whole_val = torch.cat([x for x, _ in _stream(tokens).val_batches(100)])
    shares = [[x for x, _ in _stream(tokens, rank=r, world=2).val_batches(100)] for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == len(whole_val) // 8
    interleaved = torch.cat([torch.cat([a, b]) for a, b in zip(*shares)])
    assert torch.equal(interleaved, whole_val)


def test_validation_windows_are_fixed_and_never_trained_on():
    tokens = np.arange(5000) % 4999
    stream = _stream(tokens)
    val = torch.cat([x for x, _ in stream.val_batches(100, batch_size=1)])
    seen = torch.cat([stream.batch(s)[0] for s in range(stream.epoch_steps * 2)])
    assert not set(val[:, 0].tolist()) & set(seen[:, 0].tolist())
    assert torch.equal(val, torch.cat([x for x, _ in _stream(tokens, seed=9).val_batches(100, batch_size=1)]))


def test_too_few_tokens_and_uneven_ranks_are_errors():
    with pytest.raises(ValueError, match="too few"):
        _stream(np.arange(100))
    with pytest.raises(ValueError, match="ranks"):
        _stream(np.arange(5000), world=3)
