"""Text to token shards: the locally trained BPE, JSONL, identities, the built-in corpus."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from fp4lab.train import corpus
from fp4lab.train.data import load_tokens


def _texts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    (src / "b.md").write_text("# notes\nquantize the weights in blocks of sixteen\n" * 150)
    (src / "c.jsonl").write_text("\n".join(json.dumps({"text": f"document {i} is short"}) for i in range(50)))
    (src / "skip.bin").write_bytes(b"\0\1")
    return src


def test_build_dataset_round_trips_through_its_tokenizer(tmp_path):
    files = corpus.text_files(_texts(tmp_path))
    assert [label for label, _ in files] == ["a.txt", "b.md", "c.jsonl"]
    out = corpus.build_dataset(files, tmp_path / "ds", vocab_size=300)
    meta = json.loads((out / "meta.json").read_text())
    tokens = load_tokens(out)
    assert meta["tokens"] == len(tokens) and meta["vocab_size"] <= 300 and tokens.max() < meta["vocab_size"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tok.token_to_id(corpus.EOT)
    docs = tok.decode(tokens.tolist(), skip_special_tokens=False).split(corpus.EOT)
    assert docs[0] == (tmp_path / "src" / "a.txt").read_text()  # byte-level BPE: lossless
    assert docs[-2] == "document 49 is short" and int((tokens == eot).sum()) == 2 + 50
    assert meta["identity"] == corpus.corpus_identity(files)
    again = corpus.build_dataset(files, tmp_path / "ds2", tokenizer=out / "tokenizer.json")
    assert (load_tokens(again) == tokens).all()  # a given tokenizer.json gives the same ids


def test_identity_follows_content(tmp_path):
    files = corpus.text_files(_texts(tmp_path))
    before = corpus.corpus_identity(files)
    (tmp_path / "src" / "a.txt").write_text("changed")
    after = corpus.corpus_identity(files)
    assert before["sha256"] != after["sha256"] and after["files"] == 3


def test_bad_text_sources_are_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        corpus.build_dataset(corpus.text_files(tmp_path / "bad.jsonl"), tmp_path / "out", vocab_size=260)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt"):
        corpus.text_files(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown built-in corpus"):
        corpus.corpus_files("wikipedia")


def test_built_in_corpus_is_real_source_and_cached(tmp_path, monkeypatch):
    files = corpus.corpus_files("stdlib")
    assert len(files) > 100 and all(p.suffix == ".py" for _, p in files)
    assert not any("site-packages" in label for label, _ in files)
    assert any(label == "stdlib/json/decoder.py" for label, _ in files)
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path))
    first = corpus.default_dataset("stdlib", vocab_size=300, max_bytes=50_000)
    stamp = (first / "meta.json").stat().st_mtime_ns
    assert corpus.default_dataset("stdlib", vocab_size=300, max_bytes=50_000) == first  # cached, not rebuilt
    assert (first / "meta.json").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("datasets/*.partial*"))
