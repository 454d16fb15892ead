"""Text to token shards: a BPE tokenizer trained locally, and fp4lab's built-in corpora.

**The built-in corpora** are real, human-written text that exists wherever fp4lab can be
installed, with nothing downloaded and nothing committed: source code already on the machine.

``"code"`` (the GPU corpus)
    every ``.py`` file of the interpreter's standard library and of every installed package
    (the site-packages directories: sysconfig's purelib and platlib plus
    ``site.getsitepackages()``), and every C/C++/CUDA header (``.h .hh .hpp .hxx .cuh .inl``)
    under those site-packages, under sysconfig's include directory, and under /usr/include,
    /usr/local/include and /usr/local/cuda/include where they exist. Measured on the H200 image
    (Python 3.12 with torch, jax, transformers, scipy, ...): 59,863 files, 710 MB listed; 57,145
    files, 642 MB kept; 199.9M tokens with the 8192-entry BPE (3.2 bytes per token), built in
    38 s on 16 cores (``scripts/corpus_size.py``; results/fidelity/corpus_h200.json).
``"python"``
    the standard library plus the packages fp4lab itself needs (PyTorch, NumPy, Matplotlib):
    68 MB, 19M tokens there.
``"stdlib"``
    the standard library alone (10.7 MB, 2.8M tokens there): the CPU default and the small studies.

A file's label is "root/relative/path" (``stdlib/json/decoder.py``, ``site-packages/torch/...``,
``usr-include/stdio.h``); roots come in a fixed order and files sorted within each, and a file
reachable twice (from two roots, or through a link) is listed once, the first time.

**Filters.** Installed trees hold more than human-written code: vendored copies, generated
tables, minified bundles, binary blobs with a text suffix. Every built-in corpus (``"python"``
and ``"stdlib"`` too) is built with the ``Filters`` below; each file is dropped for the first
reason that applies, in this order, and the counts go into meta.json:

    empty       no bytes: nothing to learn, and a document of a lone end-of-text token
    too_large   over ``MAX_FILE_BYTES``: generated data (unicode tables, API dumps), not prose
    duplicate   the same sha256 as an earlier file (the first in corpus order is kept): vendored
                copies, and headers shipped both in a wheel and in /usr/include, would otherwise
                be trained on two or more times an epoch
    not_text    not valid UTF-8, or holds a NUL byte
    generated   a line over ``MAX_LINE_CHARS`` or a mean line over ``MAX_MEAN_LINE_CHARS``
                characters: minified or machine-written

``build_dataset`` on a user's own text applies no filters unless asked (``filters=Filters()``):
a novel or a JSONL dump has long lines and large files by nature.

**Identity.** The list of (label, size, sha256) of the files in corpus order, before filtering, plus the
filter settings (``Filters``, including ``FILTER_VERSION``), hashed into one sha256 that is
recorded in every receipt: two runs compare only when the identities match (another Python,
another package version or other filter thresholds make another corpus).

**Build and cache.** ``build_dataset(files, out_dir)`` reads every file once to hash it (the
identity, and the empty / too_large / duplicate filters), trains a byte-level BPE (the
``tokenizers`` library) on an even spread of the kept files (``sample_bytes``, 8 MB by default)
or uses a given tokenizer.json, then tokenizes the files in a pool of spawned worker processes:
each worker loads the saved tokenizer.json, reads a chunk of files (their second read; the BPE
sample is the only text read a third time), applies the not_text / generated filters and
returns the chunk's tokens; the chunks are reassembled in corpus order, so the shards are
identical to a serial build. Every document (a file, or a line of a JSONL file) ends with
exactly one end-of-text token, in corpus order; text that happens to spell ``<|endoftext|>`` is
tokenized as ordinary text. The output is modded-nanogpt .bin shards (uint16) plus
tokenizer.json and meta.json (identity, filter counts, vocabulary size, token count, the
end-of-text id, the tokenizer's sha256). ``default_dataset(name)`` caches the build under
``<cache>/datasets/<name>-<identity16>-v<vocab>`` (~/.cache/fp4lab; FP4LAB_CACHE overrides),
built in a private partial directory and renamed into place when complete; its ``max_bytes``
takes the first files holding that many bytes (CPU-sized subsets, another identity).

Public: ``CORPORA``, ``EOT``, ``Filters``, ``corpus_files``, ``text_files``, ``corpus_identity``,
``build_dataset``, ``default_dataset``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import site
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

CORPORA = ("code", "python", "stdlib")
EOT = "<|endoftext|>"
SHARD_TOKENS = 10_000_000
SAMPLE_BYTES = 8_000_000
"""Text the BPE is trained on, an even spread of files: bounded, so that training the BPE takes
seconds whatever the corpus size."""
CHUNK_FILES = 64
"""Files per unit of work in the tokenizing pool (fewer for small corpora, to use every worker)."""

HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".cuh", ".inl")
SYSTEM_INCLUDES = (("usr-include", "/usr/include"), ("usr-local-include", "/usr/local/include"),
                   ("cuda-include", "/usr/local/cuda/include"))

FILTER_VERSION = 1
"""Bump when the filters' logic changes (not their thresholds): it is part of the identity."""
MAX_FILE_BYTES = 1_000_000
"""Hand-written source files stay well below 1 MB; larger ones are generated data (unicode and
lookup tables, embedded datasets, API dumps) that would dominate the corpus with noise."""
MAX_LINE_CHARS = 5_000
"""No human writes a 5000-character line; minified code and embedded blobs (base64, data URIs) do."""
MAX_MEAN_LINE_CHARS = 200
"""Code averages 30-50 characters a line; a mean over 200 is one statement per file, i.e. generated."""
DROP_REASONS = ("empty", "too_large", "duplicate", "not_text", "generated")


@dataclass(frozen=True)
class Filters:
    """Which files a build drops (see the module doc); part of the corpus identity."""
    max_file_bytes: int = MAX_FILE_BYTES
    max_line_chars: int = MAX_LINE_CHARS
    max_mean_line_chars: float = MAX_MEAN_LINE_CHARS
    version: int = FILTER_VERSION


def cache_root() -> Path:
    return Path(os.environ.get("FP4LAB_CACHE", Path.home() / ".cache" / "fp4lab"))


# ---------------------------------------------------------------------------------------------
# The file lists


def _site_roots() -> list[tuple[str, Path]]:
    """(label, directory) of each distinct existing site-packages directory of this interpreter."""
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    unique = list(dict.fromkeys(Path(c).resolve() for c in candidates if Path(c).is_dir()))
    return [("site-packages" if k == 0 else f"site-packages-{k + 1}", root) for k, root in enumerate(unique)]


def _roots(name: str) -> list[tuple[str, Path, tuple[str, ...]]]:
    """(label, directory, file suffixes) of every root of corpus ``name``, in corpus order."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]), (".py",))]
    if name == "python":  # fp4lab's own runtime dependencies: installed wherever fp4lab is
        import matplotlib
        import numpy
        import torch
        roots += [(m.__name__, Path(m.__file__).parent, (".py",)) for m in (torch, numpy, matplotlib)]
    elif name == "code":
        roots += [(label, root, (".py", *HEADER_SUFFIXES)) for label, root in _site_roots()]
        includes = [("include", sysconfig.get_paths()["include"]), *SYSTEM_INCLUDES]
        roots += [(label, Path(d), HEADER_SUFFIXES) for label, d in includes if Path(d).is_dir()]
    return roots


def _listing(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The regular files under root with one of the suffixes, sorted; directory links are not
    followed, and site-packages / dist-packages trees below the root are left out (the stdlib
    root holds installed packages too: they differ per machine, and "code" lists them itself)."""
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        found += [Path(top, n) for n in names if Path(n).suffix in suffixes]
    return sorted(p for p in found if p.is_file())


def corpus_files(name: str = "python") -> list[tuple[str, Path]]:
    """(label, path) of every file of the built-in corpus ``name``, in a fixed order."""
    if name not in CORPORA:
        raise ValueError(f"unknown built-in corpus {name!r}; expected one of {CORPORA}")
    files, seen = [], set()
    for label, root, suffixes in _roots(name):
        for path in _listing(root, suffixes):
            stat = path.stat()
            if (stat.st_dev, stat.st_ino) not in seen:  # one file reachable from two roots, or linked
                seen.add((stat.st_dev, stat.st_ino))
                files.append((f"{label}/{path.relative_to(root).as_posix()}", path))
    return files


TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".py", ".rst")


def text_files(source: Path) -> list[tuple[str, Path]]:
    """A text / JSONL file or a directory of them -> (label, path), sorted."""
    source = Path(source)
    if source.is_file():
        return [(source.name, source)]
    files = [(p.relative_to(source).as_posix(), p) for p in sorted(source.rglob("*"))
             if p.is_file() and p.suffix in TEXT_SUFFIXES]
    if not files:
        raise FileNotFoundError(f"no .txt/.md/.jsonl/.py/.rst files under {source}")
    return files


# ---------------------------------------------------------------------------------------------
# Identity and the filters


def _digests(files: list[tuple[str, Path]]) -> list[tuple[int, str]]:
    """(size in bytes, sha256 hex) of each file: one read of every file."""
    out = []
    for _, path in files:
        data = path.read_bytes()
        out.append((len(data), hashlib.sha256(data).hexdigest()))
    return out


def _identity(files: list[tuple[str, Path]], digests: list[tuple[int, str]], filters: Filters | None) -> dict:
    """corpus_identity, given the files' _digests."""
    outer = hashlib.sha256()
    for (label, _), (size, sha) in zip(files, digests):
        outer.update(f"{label}\0{size}\0{sha}\n".encode())
    settings = asdict(filters) if filters else None
    if settings:  # unfiltered builds keep the plain file-list hash
        outer.update(f"filters\0{json.dumps(settings, sort_keys=True)}\n".encode())
    return {"files": len(files), "bytes": sum(size for size, _ in digests), "sha256": outer.hexdigest(),
            "filters": settings}


def corpus_identity(files: list[tuple[str, Path]], filters: Filters | None = None) -> dict:
    """{"files": n, "bytes": total, "sha256": hash over (label, size, sha256) of each file and the
    filter settings, "filters": the settings or None}."""
    return _identity(files, _digests(files), filters)


def _prefilter(digests: list[tuple[int, str]], filters: Filters | None) -> tuple[list[int], dict]:
    """Indices of the files passing the empty / too_large / duplicate filters, {reason: files dropped}."""
    dropped = dict.fromkeys(DROP_REASONS, 0)
    if filters is None:
        return list(range(len(digests))), dropped
    kept, seen = [], set()
    for index, (size, sha) in enumerate(digests):
        reason = ("empty" if size == 0 else "too_large" if size > filters.max_file_bytes
                  else "duplicate" if sha in seen else None)
        seen.add(sha)
        if reason:
            dropped[reason] += 1
        else:
            kept.append(index)
    return kept, dropped


def _text_problem(text: str, filters: Filters) -> str | None:
    """Why decoded file text fails the content filters ("not_text", "generated"), or None."""
    if "\0" in text:
        return "not_text"
    lengths = [len(line) for line in text.splitlines()] or [0]
    if max(lengths) > filters.max_line_chars or len(text) / len(lengths) > filters.max_mean_line_chars:
        return "generated"
    return None


def _read(path: Path, filters: Filters | None) -> tuple[str | None, str | None]:
    """(text, None) for a file the content filters keep, (None, reason) for one they drop."""
    data = path.read_bytes()
    if filters is None:
        return data.decode("utf-8", errors="replace"), None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_text"
    problem = _text_problem(text, filters)
    return (None, problem) if problem else (text, None)


def _documents(path: Path, text: str) -> list[str]:
    """A file's documents: the whole text, or the "text" field of each line of a JSONL file."""
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


# ---------------------------------------------------------------------------------------------
# Tokenizing


def _train_tokenizer(files: list[tuple[str, Path]], filters: Filters | None, vocab_size: int, sample_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tqdm import tqdm
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the trainer's own bars (pre-tokenizing, counting pairs, merges) on a terminal; logs get the lines below
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    step = max(1, sum(p.stat().st_size for _, p in files) // max(sample_bytes, 1))
    chosen = files[::step]  # an even spread of files up to sample_bytes, in corpus order

    def sample():  # the reading and pre-tokenizing, the slow part, happens as the trainer pulls
        for _, path in tqdm(chosen, desc=f"BPE {vocab_size}: reading the sample", unit="file"):
            text, _ = _read(path, filters)
            if text is not None:
                yield from _documents(path, text)
    start = time.perf_counter()
    tok.train_from_iterator(sample(), trainer)
    print(f"BPE {vocab_size}: {len(chosen)} files sampled, merges learned in {time.perf_counter() - start:.0f} s",
          file=sys.stderr, flush=True)
    return tok


def _encode_files(tok, filters: Filters | None, paths: list[Path]) -> tuple[np.ndarray, list[str | None]]:
    """Tokenize a chunk of files -> (tokens [n] uint16, every document followed by the end-of-text
    id when the tokenizer has one; each file's drop reason, None for a kept file)."""
    eot = tok.token_to_id(EOT)
    end = [] if eot is None else [eot]
    docs, reasons = [], []
    for path in paths:
        text, reason = _read(path, filters)
        reasons.append(reason)
        if text is not None:
            docs += _documents(path, text)
    ids = [i for enc in tok.encode_batch(docs) for i in enc.ids + end]
    return np.array(ids, dtype=np.uint16), reasons


_worker: tuple | None = None
"""(tokenizer, filters) of a pool worker process, set by ``_init_worker``."""


def _init_worker(tokenizer_json: str, filters: Filters | None) -> None:
    from tokenizers import Tokenizer
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    tok = Tokenizer.from_file(tokenizer_json)
    tok.encode_special_tokens = True  # not saved in tokenizer.json
    _worker = (tok, filters)


def _worker_encode(paths: list[Path]) -> tuple[np.ndarray, list[str | None]]:
    return _encode_files(*_worker, paths)


def _default_workers() -> int:
    if multiprocessing.current_process().daemon:  # a pool's worker may not start a pool of its own
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _encoded_chunks(tok, tokenizer_json: Path, filters: Filters | None, paths: list[Path], workers: int):
    """_encode_files' result for consecutive chunks of ``paths``, in order: in this process
    (workers 1) or in a pool of spawned processes that load ``tokenizer_json``."""
    size = max(1, min(CHUNK_FILES, len(paths) // (4 * workers)))
    chunks = [paths[i:i + size] for i in range(0, len(paths), size)]
    if workers <= 1 or len(chunks) <= 1:
        yield from map(partial(_encode_files, tok, filters), chunks)
        return
    # a ProcessPoolExecutor, not a multiprocessing.Pool: a worker that dies raises here instead of hanging
    with ProcessPoolExecutor(min(workers, len(chunks)), multiprocessing.get_context("spawn"), _init_worker,
                             (str(tokenizer_json), filters)) as pool:
        yield from pool.map(_worker_encode, chunks)


class _Shards:
    """Token arrays appended in order, written as .bin shards of at least SHARD_TOKENS tokens."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.pending, self.n_pending, self.n_shards, self.tokens = [], 0, 0, 0

    def append(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.n_pending += len(ids)
        if self.n_pending >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        from .data import write_bin  # imported here: spawned workers import this module and need no torch
        if self.n_pending:
            write_bin(self.out_dir / f"shard_{self.n_shards:04d}.bin", np.concatenate(self.pending))
            self.tokens, self.n_shards = self.tokens + self.n_pending, self.n_shards + 1
            self.pending, self.n_pending = [], 0


def _build(files, digests, out_dir: Path, *, vocab_size: int, tokenizer: Path | None, sample_bytes: int,
           filters: Filters | None, workers: int | None) -> Path:
    """build_dataset, given the files' _digests (read once already)."""
    from tokenizers import Tokenizer
    from tqdm import tqdm
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    indices, dropped = _prefilter(digests, filters)
    kept = [files[i] for i in indices]
    if not kept:
        raise ValueError(f"no files to tokenize: {len(files)} given, dropped {dropped}")
    tok = Tokenizer.from_file(str(tokenizer)) if tokenizer else _train_tokenizer(kept, filters, vocab_size, sample_bytes)
    if tok.get_vocab_size() > 2**16:
        raise ValueError(f"a vocabulary of {tok.get_vocab_size()} does not fit uint16 .bin shards")
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a file is text, not a document end
    tok.save(str(out_dir / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    shards, n_files, n_bytes = _Shards(out_dir), 0, 0
    sizes = iter(digests[i][0] for i in indices)
    bar = tqdm(total=len(kept), desc="tokenizing", unit="file")
    for ids, reasons in _encoded_chunks(tok, out_dir / "tokenizer.json", filters, [p for _, p in kept],
                                        workers or _default_workers()):
        shards.append(ids)
        for reason, size in zip(reasons, sizes):  # reasons first: zip then takes one size per file
            if reason:
                dropped[reason] += 1
            else:
                n_files, n_bytes = n_files + 1, n_bytes + size
        bar.update(len(reasons))
    bar.close()
    shards.flush()
    meta = {"identity": _identity(files, digests, filters),
            "filters": {"dropped": dropped, "kept_files": n_files, "kept_bytes": n_bytes},
            "vocab_size": tok.get_vocab_size(), "tokens": shards.tokens, "eot_id": eot,
            "tokenizer_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest()}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return out_dir


def build_dataset(files: list[tuple[str, Path]], out_dir: Path, *, vocab_size: int = 8192,
                  tokenizer: Path | None = None, sample_bytes: int = SAMPLE_BYTES, filters: Filters | None = None,
                  workers: int | None = None) -> Path:
    """Tokenize ``files`` into out_dir (.bin shards + tokenizer.json + meta.json) -> out_dir.

    filters: the files to drop (None: keep every file); workers: tokenizing processes (None: one
    per available core, 1: this process alone); the shards are the same for any number."""
    return _build(files, _digests(files), out_dir, vocab_size=vocab_size, tokenizer=tokenizer,
                  sample_bytes=sample_bytes, filters=filters, workers=workers)


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
    return _cached(name, _prefix(corpus_files(name), max_bytes), vocab_size)


def text_dataset(source: Path, *, vocab_size: int = 8192) -> Path:
    """A text / JSONL file, or a directory of them (``text_files``), tokenized like the built-in
    corpora (a BPE of ``vocab_size`` trained on it, then cached by identity) -> its directory."""
    source = Path(source)
    return _cached(source.stem or "text", text_files(source), vocab_size)


def _cached(name: str, files: list[tuple[str, Path]], vocab_size: int) -> Path:
    digests, filters = _digests(files), Filters()
    ident = _identity(files, digests, filters)["sha256"][:16]
    out = cache_root() / "datasets" / f"{name}-{ident}-v{vocab_size}"
    if (out / "meta.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")  # processes building at once never share one
    _build(files, digests, tmp, vocab_size=vocab_size, tokenizer=None, sample_bytes=SAMPLE_BYTES,
           filters=filters, workers=None)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: its copy is the same data
        shutil.rmtree(tmp, ignore_errors=True)
    return out
