"""Host-side arithmetic for sizing launches, kept cheap: an FP4 linear's forward and backward
size nine launches, every step, and an eager step is bound by the host's time.

``cdiv`` is plain integer arithmetic: Triton's own ``triton.cdiv`` is a constexpr function (so
kernels can call it too), and on the host each call goes through Triton's argument unwrapping,
several microseconds, 20 to 30 calls an FP4 linear's step. ``sm_count`` asks the device once.
``zeroed_int32`` gives the zeroed buffers that amax passes take atomic maxima in, without a
fill launch each (torch.zeros' fill was tens of microseconds of host time, three an FP4 linear's
step). ``env`` reads an environment switch (the backend, the interpreter) for the twenty-odd
reads an FP4 linear's step makes. ``PlanTable`` holds what a kernel entry works out once per call
shape (its plans), bounded. ``tracing`` says whether a tracer runs the code (torch.compile
tracing a traced op of nn.ops): tensors then have no memory, and launches are recorded.

Public: ``cdiv``, ``sm_count``, ``zeroed_int32``, ``env``, ``PlanTable``, ``tracing``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (1 for any other: the interpreter's CPU)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_POOL_SLOTS = 4096  # int32 slots of one pool (16 KiB)
_MAX_POOLS = 64
_pools: dict[tuple[int, int, int], list] = {}  # (device index, raw stream, thread) -> [pool, next free slot]


def zeroed_int32(n: int, device: torch.device) -> torch.Tensor:
    """What ``torch.zeros(n, dtype=torch.int32, device=device)`` gives, for a kernel to take atomic
    maxima in. On CUDA: n slots of a pool zeroed in one fill, each slot handed out once and never
    again (a slice: a few microseconds of host time, where torch.zeros launches a fill); a pool
    used up is replaced, and freed once nothing holds a slice of it. A pool serves one stream, as
    torch.zeros' memory would, and one thread (two threads on one stream never share a slot).
    While a CUDA graph is being captured, torch.zeros itself: the graph must zero the buffer at
    every replay. Slices start 16-byte aligned. For fp4lab's kernels only (a slice keeps its pool
    alive, and a pool made under inference mode hands out inference tensors): the public amax
    functions return buffers of their own. Not for code whose allocations a CUDA-graph manager
    routes to its private pool outside capture (torch.compile's "reduce-overhead" warm-up): a
    pool made there is that pool's memory, which the manager may reclaim; fp4lab's opaque custom
    ops take CPU tensors, so Inductor does not graph them. While a tracer runs (``tracing``: the
    traced ops), torch.zeros: the traced graph zeroes its own buffer at every run."""
    if device.type != "cuda" or n > _POOL_SLOTS or torch.cuda.is_current_stream_capturing() or tracing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident())
    pool = _pools.get(key)
    if pool is None or pool[1] + n > _POOL_SLOTS:
        if pool is None and len(_pools) >= _MAX_POOLS:
            _pools.clear()
        pool = _pools[key] = [torch.zeros(_POOL_SLOTS, dtype=torch.int32, device=device), 0]
    start = pool[1]
    pool[1] = start + cdiv(n, 4) * 4  # (the next slice 16-byte aligned)
    return pool[0][start:start + n]


_TRACER_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, key) for key in ("FAKE", "PROXY", "FUNCTIONAL"))


def starts_aligned(t: torch.Tensor) -> bool:
    """Whether a traced tensor (no address to read) starts 16 bytes into its allocation's alignment:
    by its offset in its storage, which torch's and Inductor's allocations align."""
    return (t.storage_offset() * t.element_size()) % 16 == 0


def tracing() -> bool:
    """Whether a tracer is running this code (torch.compile's fake, proxy or functional mode: what
    runs a traced op of nn.ops at compile time): tensors have shapes but no memory, so no address
    can be read and a launch is recorded (torch.library.wrap_triton) rather than made. Asked on
    the eager hot path (each dense GEMM, each pooled zero buffer): with no dispatch mode at all,
    tracer or other (the stack's length counts both), one call answers."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    mode = torch._C._get_dispatch_mode
    return any(mode(key) is not None for key in _TRACER_MODES)


_ENVIRON = os.environ
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENCODING = sys.getfilesystemencoding()  # (os.environ's own encoding of keys and values)


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``. On POSIX it reads os.environ's own table of bytes (which
    every change made through os.environ updates), skipping the mapping's encoding of the key
    and checks: a few microseconds of host time a read on the H100 host, twenty-odd reads an FP4
    linear's step."""
    table = _ENVIRON_BYTES
    if table is None or os.environ is not _ENVIRON:  # (another platform, or os.environ replaced)
        return os.environ.get(name, default)
    value = table.get(name.encode(_ENCODING, "surrogateescape"))
    return default if value is None else value.decode(_ENCODING, "surrogateescape")


class PlanTable(dict):
    """Plans kept per call key (kernels.quantize, kernels.matmul): a dict whose ``keep`` stores one,
    emptying the table first once it holds ``limit`` plans (keys made per call, say, never grow it
    without bound; a dropped plan is worked out again)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def keep(self, key, plan):
        """Store ``plan`` under ``key``; -> plan."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan
