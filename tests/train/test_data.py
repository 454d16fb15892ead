"""Token shards, the document-level validation split, and the seekable, rank-sharded batch stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4lab.train.data import CHUNK, TokenStream, load_tokens, split_documents, write_bin


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



@pytest.mark.parametrize("content,match", [(b"", "not a readable .npy array"),
                                           (b"\x93NUMPY\x01", "not a readable .npy array"),
                                           (None, "holds no tokens")])
def test_empty_or_truncated_npy_is_refused_by_name(tmp_path, content, match):
    path = tmp_path / "f.npy"
    if content is None:
        np.save(path, np.zeros(0, dtype=np.uint16))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        load_tokens(path)
    assert str(path) in str(err.value)


EOT = 0


def _corpus(n_docs=400, seed=0):
    """n_docs documents of 20..80 distinct-ish tokens, each ending with EOT (id 0)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 4000, rng.integers(20, 80)), EOT) for _ in range(n_docs)]
    return np.concatenate(docs).astype(np.uint16), docs


def _stream(tokens, **kw):
    return TokenStream(tokens, **{"seq_len": 16, "batch_size": 8, "seed": 3, "eot": EOT, "val_fraction": 0.1, **kw})


def _docs_of(tokens):
    ends = np.flatnonzero(tokens == EOT) + 1
    return {tuple(d) for d in np.split(tokens, ends) if len(d)}


def test_validation_holds_out_whole_documents_spread_over_the_corpus():
    tokens, docs = _corpus()
    split = split_documents(tokens, eot=EOT, val_fraction=0.1)
    val, train = _docs_of(split.val), _docs_of(split.train)
    assert not val & train  # disjoint at the document level
    assert val | train == {tuple(d) for d in docs}  # and nothing lost
    assert 20 <= len(val) <= 60 and split.info["val_docs"] == len(val) and split.info["docs"] == 400
    positions = [i for i, d in enumerate(docs) if tuple(d) in val]
    assert min(positions) < 100 and max(positions) > 300  # spread, not the corpus tail
    again = split_documents(tokens.copy(), eot=EOT, val_fraction=0.1)
    assert np.array_equal(again.val, split.val) and again.info == split.info
    assert not np.array_equal(split_documents(tokens, eot=EOT, val_fraction=0.1, seed=1).val, split.val)


def test_every_arm_and_seed_sees_the_same_validation_windows():
    tokens, _ = _corpus()
    ref = torch.cat([x for x, _ in _stream(tokens).val_batches()])
    for kw in ({"seed": 9}, {"batch_size": 4}, {"world": 2}):
        ranks = range(kw.get("world", 1))
        got = torch.cat([x for r in ranks for x, _ in _stream(tokens, rank=r, **kw).val_batches()])
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, ref.tolist()))


def test_a_duplicated_document_stays_on_one_side():
    tokens, docs = _corpus(200)
    tokens = np.concatenate([tokens, *docs[:50]])  # the first 50 documents again, at the end
    split = split_documents(tokens, eot=EOT, val_fraction=0.2)
    assert not _docs_of(split.val) & _docs_of(split.train)


def test_data_without_an_end_of_text_token_splits_by_chunks():
    tokens = (np.arange(CHUNK * 40) % 4093).astype(np.uint32) + np.repeat(np.arange(40), CHUNK)
    split = split_documents(tokens, eot=None, val_fraction=0.25)
    assert split.info["docs"] == 40 and "chunks" in split.info["method"]
    assert len(split.val) % CHUNK == 0 and len(split.val) + len(split.train) == len(tokens)
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(tokens, eot=None, val_fraction=1.0)


def test_stream_is_a_pure_function_of_seed_and_step():
    tokens, _ = _corpus()
    a, b = _stream(tokens), _stream(tokens)
    for step in (0, 1, 7):  # b is asked out of order: seekable, no hidden position
        assert torch.equal(a.batch(step)[0], b.batch(step)[0])
    late = _stream(tokens).batch(a.epoch_steps + 3)  # past the first epoch
    assert torch.equal(late[0], _stream(tokens).batch(a.epoch_steps + 3)[0])
    assert not torch.equal(a.batch(0)[0], _stream(tokens, seed=4).batch(0)[0])
    x, y = a.batch(2)
    assert x.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_rank_shares_make_up_the_global_batch():
    tokens, _ = _corpus()
    whole = _stream(tokens).batch(5)[0]
    shares = [_stream(tokens, rank=r, world=2).batch(5)[0] for r in range(2)]
    assert torch.equal(torch.cat(shares), whole)
    whole_val = [x for x, _ in _stream(tokens).val_batches()]
    shares = [[x for x, _ in _stream(tokens, rank=r, world=2).val_batches()] for r in range(2)]
    interleaved = [torch.cat([a, b]) for a, b in zip(*shares)]
    assert all(torch.equal(a, b) for a, b in zip(interleaved, whole_val))
    assert len(list(_stream(tokens).val_batches(2))) == 2  # a partial evaluation: the first batches


def test_validation_windows_are_never_trained_on():
    tokens, _ = _corpus()
    stream = _stream(tokens)
    val = {tuple(r) for x, _ in stream.val_batches() for r in x.tolist()}
    seen = {tuple(r) for s in range(stream.epoch_steps * 2) for r in stream.batch(s)[0].tolist()}
    assert val and not val & seen


def test_too_few_tokens_and_uneven_ranks_are_errors():
    with pytest.raises(ValueError, match="too few"):
        _stream(_corpus(2)[0])
    with pytest.raises(ValueError, match="ranks"):
        _stream(_corpus()[0], world=3)
