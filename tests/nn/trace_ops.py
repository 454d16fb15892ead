"""Trace the traced ops of nn.ops as torch.compile's AOTAutograd would, on a machine without a GPU.

Run by tests/nn/test_traced.py in a subprocess (Triton's interpreter must be off at import, so the
kernels are Triton's own JIT functions). Recipes nn.ops.traceable leaves on the opaque ops (a
dither, an unfused rotation, a BF16 operand) trace too: what the body allows, not the rule. The tensors are a fake mode's, so nothing has memory and
nothing runs: what is checked is the graph Inductor would get. Where the GPU's answers are asked
for (the device's SM count, the backend rule, Triton's target for its analysis of each kernel's
writes) this script gives an H100's. For every recipe given: the forward and the backward op each
trace (no memory read, no host value asked of a tensor) into launches of fp4lab's kernels; no
launch writes a graph input (torch's analysis of the kernel counts only its outputs as written,
so Inductor copies nothing in); every GEMM is the persistent kernel making its TMA descriptors on
the device (a host descriptor cannot be recorded); a recipe that draws seeds reads
them as slices of the table's buffer, handed in as an input.

    python tests/nn/trace_ops.py nvfp4 nvfp4_plain nvfp4:wgrad.hadamard=random   # one line a recipe
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from torch._subclasses.functional_tensor import dispatch_functionalize  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

import fp4lab.kernels as kernels  # noqa: E402
from fp4lab.kernels import matmul  # noqa: E402
from fp4lab.kernels import host  # noqa: E402
from fp4lab.nn import ops  # noqa: E402
from fp4lab.nn.recipe import preset  # noqa: E402
from fp4lab.nn.seeds import SeedTable  # noqa: E402
from seed_oracle import slot_seed  # noqa: E402  (beside this script)


class _Hopper:
    """Triton's active driver as far as torch's analysis asks it: an sm_90 target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0


def _as_gpu() -> None:
    driver.set_active(_Hopper())
    host._sm_count = lambda index: 132
    kernels._backend_rule = lambda backend, device_type, interpreted: (True, None)  # (fake CPU tensors: "CUDA")
    rows_ok = matmul._tma_reads_rows
    matmul._tma_reads_rows = lambda a: rows_ok(a) or (a.stride(1) == 1 and (a.stride(0) * 2) % 16 == 0)


def _kernel_names(gm) -> list[str]:
    """The kernels a traced graph launches, in order, with DEVICE_DESC marked."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    names = []
    for node in gm.graph.nodes:
        if "triton_kernel_wrapper" in getattr(node.target, "__name__", str(node.target)):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            kernel = getattr(kernel, "fn", kernel)  # (an autotuner holding the launch options)
            names.append(kernel.__name__ + ("[device descriptors]" if node.kwargs["kwargs"].get("DEVICE_DESC") else ""))
    return names


_VIEWS = {"view", "select", "slice", "permute", "t", "transpose", "expand", "alias", "as_strided", "reshape",
          "unsqueeze", "squeeze", "_unsafe_view"}


def _root(node):
    """The node a view chain starts from."""
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEWS:
        node = node.args[0]
    return node


def _check(gm, what: str) -> int:
    """-> the graph's launches, after asserting none writes an input (which Inductor would copy first)
    and no buffer is an empty [] (which Inductor lowers to a fill launch)."""
    launches = 0
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        val = node.meta.get("val")
        assert not (name.startswith("empty") and isinstance(val, torch.Tensor) and val.dim() == 0), \
            f"{what}: an empty [] ({node.name}), a fill launch under Inductor"
        if "triton_kernel_wrapper" not in name:
            continue
        launches += 1
        args = node.kwargs["kwargs"]
        for written in node.kwargs["tensors_to_clone"]:
            root = _root(args[written])
            assert root.op != "placeholder", f"{what}: launch {launches} writes its input {written} ({root.name})"
    assert launches, f"{what}: no launch recorded"
    return launches


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        return text


def _placeholders(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def trace(recipe_name: str) -> str:
    name, _, changes = recipe_name.partition(":")  # e.g. nvfp4:fprop.b.dither=0.5,dgrad.b.dither=0.5
    recipe = preset(name)
    if changes:
        recipe = recipe.override({k: _value(v) for k, v in (c.split("=") for c in changes.split(","))})
    index = ops.register_recipe(recipe)
    table = SeedTable("cpu", capacity=64)
    # (make_fx swaps these for its fake mode's tensors: nothing below reads them)
    x, w, dy = torch.zeros(256, 128), torch.zeros(1, 192, 128), torch.zeros(256, 192)
    x, w, dy = x.bfloat16(), w.bfloat16(), dy.bfloat16()
    seeds = torch.zeros(64, dtype=torch.int64)

    def forward(x, w, seeds):
        return torch.ops.fp4lab.gemms_traced(x, w, None, 1234, index, 0, seeds, table.index, True, True)

    def backward(dy, x, w, seeds, *kept):
        return torch.ops.fp4lab.gemms_traced_backward(dy, x, w, 1234, index, 0, seeds, table.index, True, True, *kept)

    fwd = make_fx(dispatch_functionalize(forward), tracing_mode="fake")(x, w, seeds)
    outputs = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
    kept = [torch.zeros(o.meta["val"].shape, dtype=o.meta["val"].dtype) for o in outputs[1:]]  # (their shapes)
    bwd = make_fx(dispatch_functionalize(backward), tracing_mode="fake")(dy, x, w, seeds, *kept)
    counts = _check(fwd, f"{recipe_name} forward"), _check(bwd, f"{recipe_name} backward")
    gemms = [k for g in (fwd, bwd) for k in _kernel_names(g) if k.startswith("_scaled_mm")]
    # (every operand here is TMA-readable: the persistent kernel, its descriptors made on the device)
    assert all(k == "_scaled_mm_persistent_kernel[device descriptors]" for k in gemms), (recipe_name, gemms)
    slices = [n for g, at in ((fwd, 2), (bwd, 3)) for n in g.graph.nodes if n.op == "call_function"
              and getattr(n.target, "__name__", "").startswith("slice") and _root(n) is _placeholders(g)[at]]
    drawn = len(table.specs)
    assert bool(drawn) == bool(slices), f"{recipe_name}: {drawn} slots drawn, {len(slices)} read from the input"
    want = [slot_seed(spec, table.tick) for spec in table.specs]
    assert table.values[:drawn].tolist() == want, f"{recipe_name}: a slot's value"
    return f"{recipe_name}: forward {counts[0]} launches, backward {counts[1]}, {drawn} seed slots"


if __name__ == "__main__":
    _as_gpu()
    for name in sys.argv[1:]:
        print(trace(name), flush=True)
