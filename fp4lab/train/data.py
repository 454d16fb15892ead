"""Token data: shard files, the deterministic seekable batch stream, and the validation split.

Shard formats read (and .bin written):
    .bin  modded-nanogpt / llm.c: a 256 x int32 header (magic 20240520, version 1, token count),
          then uint16 tokens
    .npy  a 1D uint16 or uint32 array
A dataset is a directory of shards (read in sorted name order, concatenated) plus, when fp4lab
made it, ``meta.json`` (tokenizer, vocabulary size, source identity).

The stream cuts the token sequence into windows of seq_len + 1 tokens (inputs and shifted
targets). The last ``val_fraction`` of windows is the validation split (a fixed list, the same
for every arm); the training windows are visited in a seeded permutation, epoch after epoch.
Batch ``step`` of rank ``r`` (of ``world`` ranks) holds windows [step * B + r * B / world, ...)
of the global order, so a 2-GPU run sees the same global batch as a 1-GPU run, and resuming at
step s needs nothing but s: the stream is a pure function of (tokens, seed, step).

Public: ``write_bin``, ``load_tokens``, ``TokenStream``.
"""

from __future__ import annotations

import json
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
    tokens = np.load(path, mmap_mode="r")
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
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def dataset_meta(source: Path) -> dict:
    """meta.json of an fp4lab dataset directory ({} for bare shards)."""
    meta = Path(source) / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


class TokenStream:
    """Deterministic batches of [B, T] inputs and targets from a token array (see the module doc)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int = 0,
                 val_fraction: float = 0.05, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise ValueError(f"global batch {batch_size} does not split over {world} ranks")
        n_windows = (len(tokens) - 1) // seq_len
        n_val = max(1, int(n_windows * val_fraction))
        if n_windows - n_val < batch_size:
            raise ValueError(f"{len(tokens)} tokens make {n_windows} windows of {seq_len + 1}: too few for "
                             f"a batch of {batch_size} plus {n_val} validation windows")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.rank, self.world = rank, world
        self.n_train = n_windows - n_val
        self.val_windows = np.arange(self.n_train, n_windows)
        self._orders: dict[int, np.ndarray] = {}

    def _window(self, w: int) -> np.ndarray:
        start = int(w) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def _stack(self, windows) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.stack([self._window(w) for w in windows]))
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
        return self._stack(windows)

    def val_batches(self, n_batches: int, batch_size: int | None = None):
        """The fixed validation batches (this rank's share): the same for every run on these tokens."""
        b = (batch_size or self.batch_size) // self.world
        # only whole global batches, the same count on every rank: any world size sees the same windows
        for k in range(min(n_batches, len(self.val_windows) // (b * self.world))):
            yield self._stack(self.val_windows[(k * self.world + self.rank) * b:(k * self.world + self.rank + 1) * b])

    @property
    def epoch_steps(self) -> int:
        return self.n_train // self.batch_size
