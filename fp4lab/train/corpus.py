"""Text to token shards: a BPE tokenizer trained locally, and fp4lab's built-in default corpus.

The built-in corpus is real, human-written text that exists wherever fp4lab can be installed,
with nothing downloaded and nothing committed: the Python source (code, comments, docstrings)
of the interpreter's standard library and of fp4lab's installed dependencies PyTorch, NumPy
and Matplotlib. On the H100 machine (Python 3.12, torch 2.11) the standard library and torch
alone were 52 MB of text, 14.1M tokens with an 8192-entry BPE; NumPy and Matplotlib add about
16 MB more. Its identity is the sorted list of (relative path, size, sha256) hashed into one
sha256, recorded in every receipt: two runs compare only when the identities match (another
Python or package version is another corpus). ``"stdlib"`` is the standard library alone
(10.7 MB, 2.8M tokens there), for CPU runs and the small studies.

``build_dataset(files, out_dir)`` trains a byte-level BPE (the ``tokenizers`` library) on the
text, or uses a given tokenizer.json, tokenizes every file (documents separated by an
end-of-text token) and writes modded-nanogpt .bin shards plus meta.json; the result is cached
by identity under ~/.cache/fp4lab/datasets (FP4LAB_CACHE overrides).

Public: ``corpus_files``, ``text_files``, ``corpus_identity``, ``build_dataset``, ``default_dataset``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from .data import write_bin

CORPORA = ("python", "stdlib")
EOT = "<|endoftext|>"
SHARD_TOKENS = 10_000_000


def cache_root() -> Path:
    return Path(os.environ.get("FP4LAB_CACHE", Path.home() / ".cache" / "fp4lab"))


def corpus_files(name: str = "python") -> list[tuple[str, Path]]:
    """(label, path) of every .py file of the built-in corpus, in a fixed order."""
    if name not in CORPORA:
        raise ValueError(f"unknown built-in corpus {name!r}; expected one of {CORPORA}")
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    if name == "python":  # fp4lab's own runtime dependencies: installed wherever fp4lab is
        import matplotlib
        import numpy
        import torch
        roots += [(m.__name__, Path(m.__file__).parent) for m in (torch, numpy, matplotlib)]
    files = []
    for label, root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if {"site-packages", "dist-packages"} & set(rel.parts):
                continue  # the stdlib root holds installed packages too; they differ per machine
            files.append((f"{label}/{rel.as_posix()}", path))
    return files


def text_files(source: Path) -> list[tuple[str, Path]]:
    """A text / JSONL file or a directory of them -> (label, path), sorted."""
    source = Path(source)
    if source.is_file():
        return [(source.name, source)]
    files = [(p.relative_to(source).as_posix(), p) for p in sorted(source.rglob("*"))
             if p.is_file() and p.suffix in (".txt", ".md", ".jsonl", ".py", ".rst")]
    if not files:
        raise FileNotFoundError(f"no .txt/.md/.jsonl/.py/.rst files under {source}")
    return files


def _documents(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                docs.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{n}: each JSONL line needs a 'text' field ({err})") from None
    return docs


def corpus_identity(files: list[tuple[str, Path]]) -> dict:
    """{"files": n, "bytes": total, "sha256": hash over (label, size, sha256) of each file}."""
    outer, total = hashlib.sha256(), 0
    for label, path in files:
        data = path.read_bytes()
        total += len(data)
        outer.update(f"{label}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return {"files": len(files), "bytes": total, "sha256": outer.hexdigest()}


def _train_tokenizer(files: list[tuple[str, Path]], vocab_size: int, sample_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def sample():  # an even spread of files up to sample_bytes, in corpus order
        step = max(1, sum(p.stat().st_size for _, p in files) // max(sample_bytes, 1))
        for _, path in files[::step]:
            yield from _documents(path)
    tok.train_from_iterator(sample(), trainer)
    return tok


def build_dataset(files: list[tuple[str, Path]], out_dir: Path, *, vocab_size: int = 8192,
                  tokenizer: Path | None = None, sample_bytes: int = 8_000_000) -> Path:
    """Tokenize ``files`` into out_dir (.bin shards + tokenizer.json + meta.json) -> out_dir."""
    from tokenizers import Tokenizer
    from tqdm import tqdm
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer)) if tokenizer else _train_tokenizer(files, vocab_size, sample_bytes)
    if tok.get_vocab_size() > 2**16:
        raise ValueError(f"a vocabulary of {tok.get_vocab_size()} does not fit uint16 .bin shards")
    eot = tok.token_to_id(EOT)
    buffer, shard, n_tokens = [], 0, 0
    bar = tqdm(total=len(files), desc="tokenizing", unit="file")
    for first in range(0, len(files), 64):  # 64 files per encode_batch: the library's threads share them
        chunk = files[first:first + 64]
        for enc in tok.encode_batch([doc for _, path in chunk for doc in _documents(path)]):
            buffer.extend(enc.ids + ([eot] if eot is not None else []))
        bar.update(len(chunk))
        if len(buffer) >= SHARD_TOKENS:
            write_bin(out_dir / f"shard_{shard:04d}.bin", np.array(buffer, dtype=np.uint16))
            n_tokens, shard, buffer = n_tokens + len(buffer), shard + 1, []
    bar.close()
    if buffer:
        write_bin(out_dir / f"shard_{shard:04d}.bin", np.array(buffer, dtype=np.uint16))
        n_tokens += len(buffer)
    tok.save(str(out_dir / "tokenizer.json"))
    meta = {"identity": corpus_identity(files), "vocab_size": tok.get_vocab_size(), "tokens": n_tokens,
            "tokenizer_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest()}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return out_dir


def _prefix(files: list[tuple[str, Path]], max_bytes: int | None) -> list[tuple[str, Path]]:
    """The first files holding at least max_bytes (all of them for None): CPU-sized subsets."""
    if max_bytes is None:
        return files
    kept, total = [], 0
    for label, path in files:
        if total >= max_bytes:
            break
        kept.append((label, path))
        total += path.stat().st_size
    return kept


def default_dataset(name: str = "python", *, vocab_size: int = 8192, max_bytes: int | None = None) -> Path:
    """The built-in corpus tokenized (built once, then cached by identity) -> its directory."""
    files = _prefix(corpus_files(name), max_bytes)
    ident = corpus_identity(files)["sha256"][:16]
    out = cache_root() / "datasets" / f"{name}-{ident}-v{vocab_size}"
    if (out / "meta.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")  # processes building at once never share one
    build_dataset(files, tmp, vocab_size=vocab_size)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: its copy is the same data
        shutil.rmtree(tmp, ignore_errors=True)
    return out
