"""The value a seed slot must hold, derived one scalar at a time (the oracle the table's array
passes are checked against). Imported by test_seeds.py and by trace_ops.py, a script beside it."""

from fp4lab.nn.quant import derive_seed


def slot_seed(spec: tuple[int, int, int, int, int], tick: int) -> int:
    """spec: (recipe seed, layer, rank, gemm, side), a SeedTable spec -> its seed at ``tick``:
    derive_seed(derive_seed(recipe seed, layer, tick[, rank]), gemm, side); rank 0 folds none,
    as nn.gemms.call_at."""
    seed, layer, rank, gemm, side = spec
    return derive_seed(derive_seed(seed, layer, tick, *([rank] if rank else [])), gemm, side)
