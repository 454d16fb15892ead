"""torch's answer to "which arguments does this recorded launch write?", kept for fp4lab's kernels.

A Triton launch recorded while torch.compile traces (``torch.library.wrap_triton``, kernels.launch)
does not say what it writes. torch finds out by compiling the kernel to Triton IR and walking the
IR (``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``;
``identify_mutated_tensors`` in torch 2.11), and asks at every recorded launch, then again at each
lowering step that meets the launch: two to four compiles a call site. A compiled d12 FP4 step
records about 300 launches of a few dozen distinct specializations (its layers repeat four shapes),
and one such compile takes 0.02 to 0.4 s on a CPU (the pair kernel's copies pass the longest):
minutes of compiling spent answering the same question.

The answer depends on nothing but the kernel, the target Triton compiles for (the current
device's) and what that compile specializes on. torch stands an empty two-element tensor of the
same dtype in for each tensor, and 2 for each symbolic size, so the specialization is each
tensor's dtype, each other argument's value, and the TMA metadata.
``remember(kernel)`` has torch's analysis kept for that kernel under such a key, computed by
torch's own function the first time and handed out as a copy after. Only kernels passed to
``remember`` use it (kernels.launch passes fp4lab's, as it records them); another kernel, a
launch with TMA metadata, or an argument of a kind not listed above goes to torch's function
every time.

Public: ``remember``.
"""

from __future__ import annotations

import copy
import functools

import torch

# torch's analysis, by its name in torch 2.13 (identify_accessed_tensors) and in 2.11
_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_KERNELS: dict[int, object] = {}  # id -> kernel, for the kernels whose analyses are kept (held: ids stay theirs)
_installed = False


def remember(kernel) -> None:
    """Keep torch's analysis of ``kernel``'s recorded launches (module doc); installs the keeping
    in torch's module the first time."""
    global _installed
    _KERNELS[id(kernel)] = kernel
    inner = getattr(kernel, "fn", None)  # an autotuned kernel: Inductor's lowering asks about the function inside
    if getattr(kernel, "configs", None) is not None and inner is not None:
        _KERNELS[id(inner)] = inner
    if not _installed:
        _installed = True
        _install()


def _install() -> None:
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:  # (a torch without user-kernel tracing records no launch to analyse)
        return
    for name in _ANALYSES:
        original = getattr(wrap, name, None)
        if original is not None and not getattr(original, "keeps_fp4lab_kernels", False):
            # (callers look the name up in the module at each call, so the replacement reaches them)
            setattr(wrap, name, kept_analysis(original))


def kept_analysis(original):
    """``original`` (torch's analysis: kernel, kwargs, TMA metadata -> what the launch reads and
    writes) with its answers kept per (kernel, specialization) for the kernels ``remember`` was
    given."""
    kept: dict[tuple, object] = {}

    @functools.wraps(original)
    def analysis(kernel, kwargs, tma_descriptor_metadata, *args, **options):
        key = None if args or options else _key(kernel, kwargs, tma_descriptor_metadata)
        if key is None:
            return original(kernel, kwargs, tma_descriptor_metadata, *args, **options)
        if key not in kept:
            kept[key] = original(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(kept[key])  # (a caller that edits its answer edits a copy)

    analysis.keeps_fp4lab_kernels = True
    return analysis


def _key(kernel, kwargs: dict, tma_descriptor_metadata) -> tuple | None:
    """What torch's analysis of this launch depends on, or None where it is not kept."""
    if _KERNELS.get(id(kernel)) is not kernel or tma_descriptor_metadata:
        return None
    target = _target()
    if target is None:
        return None
    parts = []
    for name, value in kwargs.items():
        part = _arg_key(value)
        if part is None:
            return None
        parts.append((name, part))
    return id(kernel), target, tuple(sorted(parts, key=lambda p: p[0]))


def _target() -> str | None:
    """The target torch's analysis compiles for (the current device's), or None without a driver
    (torch's analysis then fails the same way each time, and is asked each time)."""
    try:
        import triton
        return repr(triton.runtime.driver.active.get_current_target())
    except Exception:  # noqa: BLE001
        return None


def _arg_key(value):
    """An argument as torch's analysis sees it: a traced tensor by its dtype, a symbolic number
    as one kind (torch compiles 2 for it), a plain value by its type and value; None for anything
    else (a real tensor, whose address alignment the compile would read, or an unknown object)."""
    kind = type(value)
    if kind in (int, float, bool, str) or value is None:
        return kind.__name__, value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbolic",)
    if _traced_tensor(value):
        return "tensor", value.dtype
    try:  # (sympy comes with torch; a symbolic size may arrive as an expression)
        import sympy
    except ImportError:
        return None
    return ("symbolic",) if isinstance(value, sympy.Expr) else None


def _traced_tensor(value) -> bool:
    """A fake tensor (tracing) or an Inductor buffer (lowering): what torch replaces by a new empty tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(value, FakeTensor):
        return True
    try:
        from torch._inductor.ir import TensorBox
    except ImportError:
        return False
    return isinstance(value, TensorBox)
