"""Token data: shard files, the train/validation split by document, and the seekable batch stream.

Shard formats read (and .bin written):
    .bin  modded-nanogpt / llm.c: a 256 x int32 header (magic 20240520, version 1, token count),
          then uint16 tokens
    .npy  a 1D uint16 or uint32 array
A dataset is a directory of shards (read in sorted name order, concatenated) plus, when fp4lab
made it, ``meta.json`` (tokenizer, vocabulary size, source identity, the end-of-text id).

**Validation split** (``split_documents``): the token sequence is cut into documents, each ending
with the end-of-text token (fp4lab's corpora put one after every file; data without one is cut
into fixed chunks of ``CHUNK`` tokens). A document goes to validation when a keyed hash of its
tokens (BLAKE2b, key ``SPLIT_SEED``) falls below ``val_fraction``: held-out whole documents,
spread over the whole corpus, the same for every arm and seed, never trained on. Equal
documents hash alike, so a duplicated file cannot sit on both sides. The split's identity (its
document and token counts, a hash of the validation tokens) goes into every receipt.

**Batches**: the training documents, concatenated, are cut into windows of seq_len + 1 tokens
(inputs and shifted targets), visited in a seeded permutation, epoch after epoch. Batch ``step``
of rank ``r`` (of ``world`` ranks) holds windows [step * B + r * B / world, ...) of the global
order, so a 2-GPU run sees the same global batch as a 1-GPU run, and resuming at step s needs
nothing but s: the stream is a pure function of (tokens, seed, step). Validation windows are
cut the same way from the validation documents and visited in one fixed order (independent of
the run's seed) so that a partial evaluation (the first k batches) samples the whole corpus.

Public: ``write_bin``, ``load_tokens``, ``dataset_meta``, ``split_documents``, ``Split``,
``TokenStream``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256


def write_bin(path: Path, tokens: np.ndarray) -> None:
    """tokens: 1D ints < 65536 -> a modded-nanogpt .bin shard (written atomically)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16)):
        raise ValueError("a .bin shard holds a 1D array of uint16 token ids")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    tmp.replace(path)


def _read_bin(path: Path) -> np.ndarray:
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header.size < HEADER_INTS or header[0] != MAGIC or header[1] != VERSION:
        raise ValueError(f"{path}: not a modded-nanogpt .bin shard (magic {MAGIC}, version {VERSION})")
    n = int(header[2])
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_INTS * 4)
    if tokens.size != n:
        raise ValueError(f"{path}: header says {n} tokens, file holds {tokens.size} (truncated?)")
    return tokens


def _read_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (EOFError, ValueError, OSError) as err:  # empty, truncated, pickled or not .npy at all
        raise ValueError(f"{path}: not a readable .npy array ({err})") from None
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"{path}: expected a 1D uint16/uint32 array, got {tokens.dtype} {tokens.shape}")
    return tokens


def load_tokens(source: Path) -> np.ndarray:
    """A .bin / .npy shard, or a directory of them (sorted, concatenated) -> 1D int64-safe array."""
    source = Path(source)
    paths = sorted(p for p in source.iterdir() if p.suffix in (".bin", ".npy")) if source.is_dir() else [source]
    if not paths:
        raise FileNotFoundError(f"no .bin or .npy token shards in {source}")
    parts = [_read_bin(p) if p.suffix == ".bin" else _read_npy(p) for p in paths]
    tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if tokens.size == 0:
        raise ValueError(f"{source}: holds no tokens")
    return tokens


def dataset_meta(source: Path) -> dict:
    """meta.json of an fp4lab dataset directory ({} for bare shards)."""
    meta = Path(source) / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


SPLIT_SEED = 0
"""Key of the document hash: changing it draws another validation split."""
CHUNK = 8192
"""Document length assumed for token data without an end-of-text token."""


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    """The training documents, concatenated in corpus order (1D tokens)."""
    val: np.ndarray
    """The validation documents, concatenated in corpus order (1D tokens)."""
    info: dict
    """For receipts: method, fraction, seed, document and token counts, val_sha256."""


def _documents(tokens: np.ndarray, eot: int | None) -> np.ndarray:
    """End offsets (exclusive) of the documents: after each end-of-text token, or every CHUNK."""
    n = len(tokens)
    if eot is None:
        ends = np.arange(CHUNK, n, CHUNK)
    else:
        ends = np.flatnonzero(np.asarray(tokens) == eot) + 1
    if not len(ends) or ends[-1] != n:
        ends = np.append(ends, n)  # a tail without its end-of-text token is a document too
    return ends[ends > 0]


def _draw(doc: np.ndarray, key: bytes) -> float:
    digest = hashlib.blake2b(np.ascontiguousarray(doc).tobytes(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def split_documents(tokens: np.ndarray, *, eot: int | None, val_fraction: float, seed: int = SPLIT_SEED) -> Split:
    """tokens: [N] -> the training and validation documents (see the module doc).
    At least one document is held out (the one with the smallest hash) whenever there are two."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    ends = _documents(tokens, eot)
    starts = np.concatenate([[0], ends[:-1]])
    key = seed.to_bytes(8, "little")
    draws = np.array([_draw(tokens[a:b], key) for a, b in zip(starts, ends)])
    held = draws < val_fraction
    if not held.any() and len(ends) > 1:
        held[int(np.argmin(draws))] = True
    if held.all():
        raise ValueError(f"val_fraction {val_fraction} holds out all {len(ends)} documents")
    lengths = ends - starts
    mask = np.repeat(held, lengths)
    val, train = np.asarray(tokens[mask]), np.asarray(tokens[~mask])
    info = {"method": "documents" if eot is not None else f"chunks of {CHUNK} tokens (no end-of-text id)",
            "fraction": val_fraction, "seed": seed, "docs": int(len(ends)), "val_docs": int(held.sum()),
            "train_tokens": int(len(train)), "val_tokens": int(len(val)),
            "val_sha256": hashlib.sha256(val.astype(np.uint32).tobytes()).hexdigest()}
    return Split(train, val, info)


class TokenStream:
    """Deterministic batches of [B, T] inputs and targets from a token array (see the module doc)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int = 0,
                 val_fraction: float = 0.02, eot: int | None = None, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise ValueError(f"global batch {batch_size} does not split over {world} ranks")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
        split = split_documents(tokens, eot=eot, val_fraction=val_fraction)
        self.train_tokens, self.val_tokens, self.split_info = split.train, split.val, split.info
        self.n_train = (len(split.train) - 1) // seq_len
        n_val = (len(split.val) - 1) // seq_len
        if self.n_train < batch_size or n_val < 1:
            raise ValueError(f"{len(tokens)} tokens make {self.n_train} training windows of {seq_len + 1} and "
                             f"{max(n_val, 0)} validation windows: too few for a batch of {batch_size} "
                             "and one validation window")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world = rank, world
        # a fixed order (not the run's seed): a partial evaluation samples the whole split
        self.val_windows = np.random.default_rng([SPLIT_SEED, 1]).permutation(n_val)
        self._orders: dict[int, np.ndarray] = {}

    @staticmethod
    def _window(source: np.ndarray, w: int, seq_len: int) -> np.ndarray:
        start = int(w) * seq_len
        return np.asarray(source[start:start + seq_len + 1], dtype=np.int64)

    def _stack(self, source: np.ndarray, windows) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.stack([self._window(source, w, self.seq_len) for w in windows]))
        return rows[:, :-1], rows[:, 1:]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:  # one permutation per epoch, kept for the next batches
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_train)}
        return self._orders[epoch]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of global batch ``step``: inputs, targets [B / world, T] int64."""
        per_rank = self.batch_size // self.world
        first = step * self.batch_size + self.rank * per_rank
        windows = []
        for g in range(first, first + per_rank):
            epoch, i = divmod(g, self.n_train)
            windows.append(self._order(epoch)[i])
        return self._stack(self.train_tokens, windows)

    def val_batches(self, n_batches: int | None = None, batch_size: int | None = None):
        """The fixed validation batches (this rank's share), the same for every run on these
        tokens: the first ``n_batches`` of them, or all (None); the last may be shorter."""
        per_global = (batch_size or self.batch_size) // self.world * self.world
        for k in range(self.val_batch_count(n_batches, batch_size)):
            chunk = self.val_windows[k * per_global:(k + 1) * per_global]
            share = np.array_split(chunk, self.world)[self.rank]  # every rank's share, any world size
            if len(share):
                yield self._stack(self.val_tokens, share)

    def val_batch_count(self, n_batches: int | None = None, batch_size: int | None = None) -> int:
        """The global batches ``val_batches`` walks, the same on every rank. Only the last can
        leave a rank an empty share (it then yields one batch fewer than this)."""
        per_global = (batch_size or self.batch_size) // self.world * self.world
        total = -(-len(self.val_windows) // per_global)  # whole and partial global batches
        return total if n_batches is None else min(n_batches, total)

    @property
    def epoch_steps(self) -> int:
        return self.n_train // self.batch_size
