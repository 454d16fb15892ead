"""Host-side arithmetic for sizing launches, kept cheap: an FP4 linear's forward and backward
size nine launches, every step, and an eager step is bound by the host's time.

``cdiv`` is plain integer arithmetic: Triton's own ``triton.cdiv`` is a constexpr function (so
kernels can call it too), and on the host each call goes through Triton's argument unwrapping,
several microseconds, 20 to 30 calls an FP4 linear's step. ``sm_count`` asks the device once.

Public: ``cdiv``, ``sm_count``.
"""

from __future__ import annotations

import functools

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
