"""Text to token shards: the locally trained BPE, JSONL, identities, the built-in corpus."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
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
    meta = json.loads((first / "meta.json").read_text())
    assert meta["identity"]["filters"] == asdict(corpus.Filters())  # built-in corpora are filtered
    assert meta["filters"]["kept_files"] + sum(meta["filters"]["dropped"].values()) == meta["identity"]["files"]


def _code(tmp_path):
    """A small source tree holding one file for each filter, and one spelling the end-of-text token."""
    src = tmp_path / "code"
    src.mkdir()
    body = "".join(f"def f{i}(x):\n    return x * {i}  # scale by {i}\n\n" for i in range(60))
    (src / "a.py").write_text(body)
    (src / "b_copy.py").write_text(body)  # duplicate of a.py
    (src / "c_empty.py").write_text("")
    (src / "d_blob.py").write_text("x = 1\n" * 200_000)  # 1.2 MB: too large
    (src / "e_latin1.py").write_bytes("name = 'café'\n".encode("latin-1"))  # not UTF-8
    (src / "f_minified.py").write_text("x=[" + ",".join(["1"] * 3000) + "]\n")  # one 6000-char line
    (src / "g_wide.py").write_text(("y = '" + "z" * 300 + "'\n") * 5)  # mean line over 200
    (src / "h_eot.py").write_text(f"TOKEN = '{corpus.EOT}'  # a literal, not a document end\n")
    (src / "i_notes.md").write_text("# notes\nquantize the weights in blocks of sixteen\n" * 40)
    return src


def _split_docs(tokens, eot):
    ends = np.flatnonzero(tokens == eot) + 1
    assert ends[-1] == len(tokens)  # the last document is closed too
    return np.split(tokens, ends[:-1])


def test_filters_drop_duplicates_blobs_and_non_text_and_count_them(tmp_path):
    files = corpus.text_files(_code(tmp_path))
    out = corpus.build_dataset(files, tmp_path / "ds", vocab_size=300, filters=corpus.Filters(), workers=1)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["filters"]["dropped"] == {"empty": 1, "too_large": 1, "duplicate": 1, "not_text": 1, "generated": 2}
    kept = ["a.py", "h_eot.py", "i_notes.md"]
    assert meta["filters"]["kept_files"] == 3
    assert meta["filters"]["kept_bytes"] == sum((tmp_path / "code" / k).stat().st_size for k in kept)
    assert meta["identity"] == corpus.corpus_identity(files, corpus.Filters())
    assert meta["identity"]["filters"]["max_file_bytes"] == corpus.MAX_FILE_BYTES
    # the identity follows the filter settings, not only the files
    others = {corpus.corpus_identity(files)["sha256"],
              corpus.corpus_identity(files, corpus.Filters(max_line_chars=10_000))["sha256"]}
    assert meta["identity"]["sha256"] not in others and len(others) == 2
    # every kept document, in corpus order, ends with exactly one end-of-text token
    tokens = load_tokens(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta["eot_id"] == tok.token_to_id(corpus.EOT) is not None
    docs = _split_docs(np.asarray(tokens), meta["eot_id"])
    assert [tok.decode(d.tolist()[:-1]) for d in docs] == [(tmp_path / "code" / k).read_text() for k in kept]


def test_parallel_build_equals_serial(tmp_path):
    src = _code(tmp_path)
    for i in range(10):
        (src / f"m{i}.py").write_text(f"# module {i}\n" + "".join(f"v{j} = {i * j}\n" for j in range(20 + i)))
    files = corpus.text_files(src)
    serial = corpus.build_dataset(files, tmp_path / "serial", vocab_size=300, filters=corpus.Filters(), workers=1)
    parallel = corpus.build_dataset(files, tmp_path / "parallel", tokenizer=serial / "tokenizer.json",
                                    filters=corpus.Filters(), workers=2)
    assert (load_tokens(parallel) == load_tokens(serial)).all()
    assert json.loads((parallel / "meta.json").read_text()) == json.loads((serial / "meta.json").read_text())


def test_code_corpus_holds_python_and_headers():
    files = corpus.corpus_files("code")
    headers = [label for label, path in files if path.suffix in corpus.HEADER_SUFFIXES]
    if not headers:
        pytest.skip("no C/C++ headers on this machine")
    assert len({label for label, _ in files}) == len(files)
    assert {p.suffix for _, p in files} <= {".py", *corpus.HEADER_SUFFIXES}
    assert any(label.startswith("site-packages/") and label.endswith(".py") for label, _ in files)
    stdlib = corpus.corpus_files("stdlib")
    assert files[:len(stdlib)] == stdlib  # the standard library first, as in every built-in corpus
