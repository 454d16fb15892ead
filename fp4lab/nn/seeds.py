"""A training step's random seeds in device memory: what lets a CUDA graph replay a step.

Every stochastic choice of an FP4 layer (stochastic rounding, random Hadamard signs) draws from
derive_seed(derive_seed(recipe seed, layer, tick[, rank]), gemm, side) (nn.gemms.Call): a new
value at every tick. A kernel launch captured in a CUDA graph replays the arguments it was
captured with, so an int seed would repeat the first step's bits forever. With a ``SeedTable`` on
the QuantContext, each such seed lives in a slot of one device buffer that the kernels read at
launch (kernels: a one-element int64 tensor as the seed); setting the context's tick writes every
slot's value for that tick in one host-to-device copy, outside any graph. The bits are those of
the int seeds (tested); only where they are read from changes.

A slot is made the first time a (recipe seed, layer, rank, gemm, side) is drawn, with its value at
the current tick; a graph must therefore be captured after a step has run eagerly (the warm-up
CUDA graph capture asks for anyway), and a slot first drawn while capturing is refused.

Traced (a compiled model's traced ops, nn.ops): the op takes the table's buffer as an input and
reads its slots as views of it (``SeedTable.reading``), so the compiled graph reads each step's
values; a slot first drawn while tracing is written into the buffer for real, and a table that
would have to grow while tracing is refused (the graph would read the old buffer).

Public: ``SeedTable``, ``SeedSlots``, ``table_at``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..kernels.host import tracing
from .quant import seed_column, seed_fold, seed_start


# every live table of this process, by ``index`` (how the custom ops name one); weak, so a run's
# table (and its device buffer) goes with the run
_TABLES: "weakref.WeakValueDictionary[int, SeedTable]" = weakref.WeakValueDictionary()
_NEXT_INDEX = itertools.count()


def table_at(index: int) -> "SeedTable | None":
    """The table whose ``index`` this is; None for -1 (seeds as kernel arguments)."""
    if index < 0:
        return None
    table = _TABLES.get(index)
    if table is None:
        raise LookupError(f"seed table {index} is gone (freed with its run): a graph traced against it "
                          "cannot run without it")
    return table


class SeedTable:
    """Device-resident seeds of a model's FP4 layers (see the module doc). ``index`` names it
    among this process's tables: what nn.ops passes a compiled graph (an int it folds, not an
    object it would have to trace)."""

    def __init__(self, device: torch.device | str, capacity: int = 4096):
        self._register()
        self.values = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.specs: list[tuple[int, int, int, int, int]] = []  # (recipe seed, layer, rank, gemm, side) per slot
        self._index: dict[tuple[int, int, int, int, int], int] = {}
        self._columns = _SpecColumns()
        self.tick = 0

    def _register(self) -> None:
        self.index = next(_NEXT_INDEX)
        _TABLES[self.index] = self

    def __setstate__(self, state: dict) -> None:
        # a copy (copy, deepcopy, pickle) is a table of its own: its own index, registered, so the
        # ops never reach the original through the copy's index
        self.__dict__.update(state)
        self._register()

    def seed(self, recipe_seed: int, layer: int, rank: int, gemm: int, side: int) -> torch.Tensor:
        """The slot of this seed: a one-element view of the buffer holding its value at the tick."""
        i = self.slot(recipe_seed, layer, rank, gemm, side)
        return self.values[i: i + 1]

    def slot(self, recipe_seed: int, layer: int, rank: int, gemm: int, side: int) -> int:
        """The index of this seed's slot, made on first sight with its value at the tick."""
        spec = (recipe_seed, layer, rank, gemm, side)
        i = self._index.get(spec)
        if i is not None:
            return i
        if self.values.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a seed first drawn while a CUDA graph is captured would be written inside "
                               "the graph: run the step once before capturing it")
        traced = tracing()
        if len(self.specs) == len(self.values):  # (an MoE draws a slot per expert): twice the room.
            # A graph captured before this reads the old buffer, which fill no longer writes:
            # capture after every slot is drawn (GraphedStep's eager warm-up steps draw them)
            if traced:
                raise RuntimeError(f"the SeedTable's {len(self.values)} slots ran out while torch.compile traced the "
                                   "model, whose graph would read the old buffer: give the table a larger capacity")
            self.values = torch.cat([self.values, torch.zeros_like(self.values)])
        i = self._index[spec] = len(self.specs)
        self.specs.append(spec)
        with _disable_current_modes() if traced else contextlib.nullcontext():  # (written now, not traced)
            self.values[i] = int(self._columns.at(self.specs, self.tick, start=i)[0])
        return i

    def seeds(self, specs: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
        """The slots of ``specs`` as one tensor (a grouped launch's seeds, one per expert)."""
        slots = [self.slot(*spec) for spec in specs]  # (first: drawing may grow the buffer)
        return self.at_slots(slots)

    def at_slots(self, slots: list[int]) -> torch.Tensor:
        """Slots already drawn (SeedTable.slot), as one tensor of the current buffer."""
        return _slots_of(self.values, slots)

    def reading(self, values: torch.Tensor) -> "SeedSlots":
        """The table's slots read as views of ``values``: its buffer as a traced op was handed it."""
        return SeedSlots(self, values)

    def fill(self, tick: int) -> None:
        """Every slot's value at ``tick``, written in one copy (stream-ordered: launches queued
        before it read the old values)."""
        self.tick = tick
        if self.specs:
            new = torch.from_numpy(self._columns.at(self.specs, tick))
            self.values[: len(new)].copy_(new.pin_memory() if self.values.is_cuda else new, non_blocking=True)


class SeedSlots:
    """A SeedTable's slots as views of the buffer a traced op received (SeedTable.reading): what
    nn.gemms.Call draws from in place of the table, the same slots."""

    def __init__(self, table: SeedTable, values: torch.Tensor) -> None:
        self.table, self.values = table, values

    def seed(self, recipe_seed: int, layer: int, rank: int, gemm: int, side: int) -> torch.Tensor:
        """SeedTable.seed, a view of the buffer handed over."""
        i = self.table.slot(recipe_seed, layer, rank, gemm, side)
        return self.values[i: i + 1]

    def seeds(self, specs: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
        """SeedTable.seeds, of the buffer handed over."""
        slots = [self.table.slot(*spec) for spec in specs]
        return _slots_of(self.values, slots)


def _slots_of(values: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """values[slots]: a view where the slots run consecutively (a grouped layer's experts draw
    theirs one after another: no copy, no launch), else a copy."""
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        return values[first: first + len(slots)]
    return torch.cat([values[i: i + 1] for i in slots])


class _SpecColumns:
    """A table's specs as uint64 columns, each fold up to its layer made once (when first seen): a
    tick's values are then a few array passes over the table, where folding every spec's parts
    from the start took 2.2 ms of host time a step for moe64's 3,546 slots (this CPU), before
    every replay of a graphed step."""

    def __init__(self) -> None:
        self.count = 0
        self.prefix, self.rank, self.gemm, self.side = (np.empty(0, dtype=np.uint64) for _ in range(4))
        self.ranked = np.empty(0, dtype=bool)

    def at(self, specs: list[tuple[int, int, int, int, int]], tick: int, start: int = 0) -> np.ndarray:
        """-> int64 [len(specs) - start]: the values at ``tick`` of specs[start:], each
        derive_seed(derive_seed(recipe seed, layer, tick[, rank]), gemm, side) (rank 0 folds no
        rank, as nn.gemms.call_at); ``specs`` extend (or are) those seen before."""
        if len(specs) > self.count:
            new = specs[self.count:]
            seed, layer, rank, gemm, side = (seed_column(list(c)) for c in zip(*new))
            self.prefix = np.concatenate([self.prefix, seed_fold(seed_fold(seed_start(len(seed)), seed), layer)])
            self.rank, self.gemm, self.side = (np.concatenate(pair) for pair in
                                               ((self.rank, rank), (self.gemm, gemm), (self.side, side)))
            # (rank 0 folds no rank, as call_at: read before the mask)
            self.ranked = np.concatenate([self.ranked, np.array([bool(spec[2]) for spec in new], dtype=bool)])
            self.count = len(specs)
        rows = slice(start, len(specs))
        h = seed_fold(self.prefix[rows], np.uint64(tick & ((1 << 64) - 1)))
        h = np.where(self.ranked[rows], seed_fold(h, self.rank[rows]), h)
        roots = h >> np.uint64(1)
        h = seed_fold(seed_fold(seed_fold(seed_start(len(roots)), roots), self.gemm[rows]), self.side[rows])
        return (h >> np.uint64(1)).astype(np.int64)
