"""Launching fp4lab's Triton kernels with less host time a launch.

``kernel[grid](*args, **constexprs)`` makes Triton, at every call, bind each argument, work out
its specialization, build a cache key, compare every global the kernel reads with its value at
compile time, and only then launch: 13 to 42 us a launch on the H100 host measured in isolation
(benchmarks/NOTES.md, eighteenth session), 76 us in a d12 step, whose 450 launches spent 34 ms
there while the step's GPU work took 81.

``cached(kernel)`` keeps Triton's call form (``cached_kernel[grid](*args, **constexprs)``) and
remembers, per call *signature*, the compiled kernel Triton's own first launch of it returned;
later calls of that signature launch it directly. A signature holds everything Triton
specializes a kernel on, and more: each positional argument's type, and for a tensor its dtype
and whether its address is 16-byte aligned, for an int whether it is 1, a multiple of 16, and
which integer type holds it, for a tensor descriptor its dtype, block and alignment and whether
each size and stride is a multiple of 16; every keyword (the constexprs and launch options) by
value; the device. Anything it cannot classify, and every call of a kernel the interpreter runs,
goes through Triton's own path. Calls that differ in anything Triton would compile differently for never share an entry, so the
kernels and their bits are those of Triton's path (the GPU tests run every kernel through here;
a CPU test holds the signature to Triton's own specializer). Triton's debug and instrumentation
settings are part of the signature too. What a cached launch does not repeat is Triton's check
that the globals a kernel reads still hold their compile-time values: fp4lab's are constants
set at import (the E4M3 form, the rule numbers).

A cached launch hands the launcher no metadata and no hooks while Triton's launch hooks are empty
chains (none registered, as in a training run): Triton's own launch builds the metadata and calls
both empty chains at every launch. With a hook registered (a profiler's), it does what Triton does.

``cached_kernel.bind(**constexprs)`` fixes the keywords once, for a plan that makes the same
launch every step (kernels.quantize, kernels.matmul): ``bound[grid](*args)`` launches as the
keyword call would, without keying the keywords again at each call. It shares the keyword call's
cache entry where the keywords come in the same order (another order is another entry, learnt
through Triton's path once).

Traced: where torch.compile traces a call (a traced op of nn.ops: its tensors are a tracer's, with
no memory), a launch is recorded with ``torch.library.wrap_triton`` instead, and Inductor's
generated code makes it at run time, with its own launcher. A host TMA descriptor cannot be
recorded (torch does not capture one outside dynamo): kernels.matmul's persistent GEMM makes its
descriptors on the device there. torch works out what a recorded launch writes by compiling the
kernel to Triton IR, at every call site, several times; kernels.traced_accesses keeps the answer
per specialization.

Public: ``cached``.
"""

from __future__ import annotations

import torch

from .host import tracing
from .traced_accesses import remember

_UNKNOWN = object()
_TRACED = object()  # a tracer's tensor among the arguments: the launch is recorded (module doc)
_MAX_SIGNATURES = 512  # per kernel; past it the remembered signatures are dropped and relearnt
_triton = None  # (triton.runtime.driver, triton.knobs), imported at the first launch


_I32, _U64 = 1 << 31, 1 << 63


def _tensor_key(arg: torch.Tensor) -> tuple:
    return arg.dtype, arg.data_ptr() % 16 == 0


def _same(arg):
    return arg


def _float_key(arg: float):
    return float


# the kinds _signature does not key inline (ints and tensors are), by exact type
_BY_TYPE = {bool: _same, type(None): _same, float: _float_key}


def _arg_key(arg):
    """The key of an argument _signature does not key inline: a bool, None, a float, a tensor
    subclass (a Parameter), a host TMA descriptor; _UNKNOWN for anything else."""
    keyer = _BY_TYPE.get(type(arg))  # (by exact type: a dict lookup, no isinstance chain)
    if keyer is not None:
        return keyer(arg)
    if isinstance(arg, torch.Tensor):  # a subclass: a Parameter, or a tracer's tensor (no address)
        return _TRACED if tracing() else _tensor_key(arg)
    base = getattr(arg, "base", None)  # a host TMA descriptor (triton.tools.tensor_descriptor)
    if isinstance(base, torch.Tensor) and hasattr(arg, "block_shape"):
        if tracing():
            raise RuntimeError("a host TMA descriptor cannot be recorded in a traced graph (torch.library."
                               "wrap_triton): launch the pointer kernel while tracing")
        # Triton compiles for its dtype and block; the alignments of its sizes and strides are kept
        # too (classes, not values: a new row count is not a new signature)
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(arg.block_shape),
                tuple(n % 16 == 0 for n in arg.shape), tuple(n % 16 == 0 for n in arg.strides),
                getattr(arg, "padding", None))
    return _UNKNOWN


def _signature(args: tuple, constexpr: tuple[bool, ...]) -> tuple | None:
    """The positional arguments' keys, two entries each (a kind, then its key), flattened into one
    tuple, or None where one is unknown (_arg_key), or _TRACED where one is a tracer's tensor. A
    constexpr is keyed by its value. The two commonest kinds are keyed inline: a tensor by its dtype and 16-byte alignment; an int by
    Triton's specializations (1, divisible by 16, i32 / i64 / u64 by range) packed into one small
    int. A launch keys a dozen or two arguments, and a function call and a nested tuple each were
    the larger part of a cached launch's host time."""
    keys = []
    for arg, const in zip(args, constexpr):
        kind = type(arg)
        if const:
            keys += ("constexpr", arg)
        elif kind is torch.Tensor:
            keys += (arg.dtype, arg.data_ptr() % 16 == 0)
        elif kind is int:
            keys += (int, (arg == 1) + 2 * (arg % 16 == 0) + 4 * (-_I32 <= arg < _I32) + 8 * (arg < _U64))
        else:
            key = _arg_key(arg)
            if key is _UNKNOWN or key is _TRACED:
                return None if key is _UNKNOWN else key
            keys += (kind, key)
    return tuple(keys)


class _Cached:
    """A Triton kernel whose launches skip Triton's per-call binding where a signature repeats."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
        self._constexpr: tuple[bool, ...] | None = None  # per parameter, read at the first launch
        # decorated under TRITON_INTERPRET=1: there is no compiled kernel, every call interprets
        self._interpreted = type(kernel).__name__ == "InterpretedFunction"

    def __getattr__(self, name: str):  # (the kernel's own attributes: fn, src, warmup, ...)
        if name.startswith("__") or name in ("kernel", "_compiled", "_constexpr", "_interpreted"):
            raise AttributeError(name)  # (copy and pickle look these up before __init__ has run)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs, None)

    def bind(self, **kwargs) -> "_Bound":
        """The kernel with its keywords (constexprs, launch options) fixed: ``bound[grid](*args)``
        launches as ``cached_kernel[grid](*args, **kwargs)`` does, without keying the keywords
        at each call (a plan that makes the same launch every step holds one; module doc)."""
        return _Bound(self, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict, kwargs_key):
        if self._interpreted:
            return self.kernel[grid](*args, **kwargs)
        if self._constexpr is None:
            self._constexpr = tuple(p.is_constexpr for p in self.kernel.params)
        signature = _signature(args, self._constexpr)  # (None: a call the cache does not take)
        if signature is _TRACED:
            remember(self.kernel)  # (torch's analysis of what it writes, worked out once: traced_accesses)
            return torch.library.wrap_triton(self.kernel)[grid](*args, **kwargs)
        if callable(grid):
            return self.kernel[grid](*args, **kwargs)
        driver, knobs = _triton or _import_triton()
        try:
            device = driver.active.get_current_device()
        except Exception:  # no GPU driver (an offline compile's recorder stands in for Triton's launch)
            return self.kernel[grid](*args, **kwargs)
        key = hit = None
        if signature is not None:
            try:
                key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, signature,
                       tuple(kwargs.items()) if kwargs_key is None else kwargs_key)
                hit = self._compiled.get(key)
            except TypeError:  # an unhashable keyword value
                key = None
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            tail = None if key is None else self._tail(len(args), kwargs)
            if tail is not None and hasattr(compiled, "packed_metadata"):
                if len(self._compiled) >= _MAX_SIGNATURES:
                    self._compiled.clear()
                compiled._init_handles()  # (loaded by the launch above; run, function are set)
                self._compiled[key] = (compiled, tail)
            return compiled
        compiled, tail = hit
        stream = driver.active.get_current_stream(device)
        # what CompiledKernel[grid](*args, stream=stream) runs, without making its closure each call
        grid = (*grid, 1, 1)
        args = (*args, *tail)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _silent(enter) and _silent(leave):  # (the launcher calls no hook given None)
            metadata = enter = leave = None
        else:  # a profiler's hooks get what Triton's own launch gives them
            metadata = compiled.launch_metadata(grid[:3], stream, *args)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, leave, *args)
        return compiled

    def _tail(self, given: int, kwargs: dict) -> tuple | None:
        """The values of the parameters after the positional ones, in order, as Triton hands them
        to a compiled kernel: constexprs from the keywords or their defaults. None where one of
        them is not a constexpr (a run-time value passed by keyword: Triton's path each time)."""
        tail = []
        for param in self.kernel.params[given:]:
            if not param.is_constexpr:
                return None
            name = param.name
            if name in kwargs:
                tail.append(kwargs[name])
            elif param.has_default:
                tail.append(param.default)
            else:
                return None
        return tuple(tail)


def _silent(hook) -> bool:
    """Whether a Triton launch hook would do nothing: None, or an empty chain. Triton 3.6 and 3.9
    keep both hooks as chains (``knobs.HookChain``), never None, so its own launch builds each
    launch's metadata (a dict of the kernel's name, handle and stream) and its launcher calls both
    empty chains from C: a few microseconds a launch that no one reads."""
    return hook is None or getattr(hook, "calls", None) == []


class _Bound:
    """A cached kernel with fixed keywords (_Cached.bind)."""

    def __init__(self, cached: _Cached, kwargs: dict) -> None:
        self.cached, self.kwargs = cached, kwargs
        try:
            self.key = tuple(kwargs.items())
            hash(self.key)
        except TypeError:  # an unhashable keyword value: keyed (and refused) at each call, as unbound
            self.key = None

    def __getitem__(self, grid):
        return lambda *args: self.cached._launch(grid, args, self.kwargs, self.key)


def _import_triton():
    global _triton
    from triton import knobs
    from triton.runtime import driver
    _triton = driver, knobs
    return _triton


def cached(kernel):
    """``kernel`` (a ``triton.jit`` function) launched through a cache of its compiled signatures
    (the module doc); ``cached(kernel)[grid](...)`` takes what ``kernel[grid](...)`` takes."""
    return _Cached(kernel)
