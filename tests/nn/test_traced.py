"""The traced ops of nn.ops: a compiled FP4 layer whose kernel launches Inductor makes itself.

On the CPU, ``trace_ops.py`` (a subprocess: Triton's interpreter off) traces the ops as
AOTAutograd would, with fake tensors and an H100's answers; here the rule that picks the traced
ops and the seed table's behaviour while tracing. On a GPU, Inductor compiles a layer and its
bits are the eager path's at every tick, with no Python of the op's body run after compiling.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fp4lab.kernels import blas
from fp4lab.kernels.host import tracing
from fp4lab.nn import ops
from fp4lab.nn.linear import fp4_linear, layer_keys
from fp4lab.nn.gemms import QuantContext
from fp4lab.nn.recipe import preset
from fp4lab.nn.seeds import SeedTable

from ..checkout import subprocess_env

RECIPES = ["nvfp4", "nvfp4_plain", "mxfp4_hadamard", "nvfp4_four_over_six",
           "nvfp4:fprop.b.dither=0.5,dgrad.b.dither=0.5", "nvfp4:wgrad.hadamard=random,wgrad.hadamard_size=32",
           "nvfp4:fprop.b.block2d=false", "nvfp4:fprop.a.format=bf16", "mxfp4:fprop.a.rounding=stochastic"]


def test_every_recipe_traces_into_launches_that_write_only_their_outputs():
    """trace_ops.py asserts, per recipe: both ops trace with no memory read, each launch writes no
    graph input, and seeds drawn are read as slices of the table's buffer (written for real)."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("trace_ops.py")
    done = subprocess.run([sys.executable, str(script), *RECIPES], capture_output=True, text=True,
                          env=subprocess_env(interpret=False), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(RECIPES), done.stdout
    slots = {line.rsplit(": forward", 1)[0]: int(line.rsplit(", ", 1)[1].split()[0]) for line in lines}
    assert slots["nvfp4"] == 2 and slots["nvfp4_plain"] == 0  # dy's two stochastic copies; none drawn


def _index(name: str, **changes) -> int:
    recipe = preset(name).override(changes) if changes else preset(name)
    return ops.register_recipe(recipe)


def test_the_traced_ops_are_picked_where_a_graph_can_hold_the_call(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FP4LAB_TRACED", raising=False)
    monkeypatch.delenv("FP4LAB_BACKEND", raising=False)
    if not ops.kernels.uses_triton(torch.device("cuda")):
        pytest.skip("needs triton installed")
    rtne, sr = _index("nvfp4_plain"), _index("nvfp4")
    assert ops.traceable(rtne, False, "cuda") and ops.traceable(sr, True, "cuda")
    assert not ops.traceable(sr, False, "cuda")  # an int seed would be frozen into the graph
    assert not ops.traceable(rtne, False, "cpu")  # the reference backend: the opaque ops
    assert not ops.traceable(_index("nvfp4_plain", bf16_after=0.5), True, "cuda")  # the recipe moves with progress
    # torch arithmetic in the body (Inductor may round it its own way): a dither, an unfused
    # rotation (NVFP4's quantizer fuses 16 points), a BF16 operand
    for changes in ({"fprop.b.dither": 0.5, "dgrad.b.dither": 0.5},
                    {"wgrad.hadamard": "random", "wgrad.hadamard_size": 32}, {"fprop.a.format": "bf16"}):
        assert not ops.traceable(_index("nvfp4", **changes), True, "cuda"), changes
    assert ops.traceable(_index("nvfp4", **{"wgrad.hadamard": "random"}), True, "cuda")  # 16 points: fused
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ops.traceable(rtne, True, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FP4LAB_TRACED", "0")
    assert not ops.traceable(rtne, True, "cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels: the interpreter or a GPU")
@pytest.mark.parametrize("recipe_name", ["nvfp4", "mxfp4_hadamard"])
def test_the_traced_ops_run_eagerly_give_the_opaque_ops_bits_and_gradients(recipe_name):
    """Called outside a trace (their autograd included) the traced ops are the opaque ops: the same
    y, dx, dW and db, the seeds read from the table's buffer they are handed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    index = ops.register_recipe(preset(recipe_name))
    table = SeedTable(device)
    context = QuantContext(seeds=table)
    context.tick = 3
    g = torch.Generator().manual_seed(0)
    x, w, b, dy = (torch.randn(*shape, generator=g).bfloat16().to(device)
                   for shape in ((64, 32), (1, 48, 32), (48,), (64, 48)))
    key = 1234
    traced = _layer_step(lambda x, w, b: torch.ops.fp4lab.gemms_traced(
        x, w, b, key, index, 0, table.values, table.index, True, True)[0], x, w, b, dy)
    opaque = _layer_step(lambda x, w, b: torch.ops.fp4lab.gemms(
        x, w, b, [64], None, torch.tensor([key]), index, context.clock, 0, table.index, False, True, True)[0],
        x, w, b, dy)
    for name, a, e in zip(("y", "dx", "dw", "db"), traced, opaque):
        assert torch.equal(a, e), name


def test_a_model_with_grouped_experts_keeps_the_opaque_ops():
    """A compiled MoE model may break its graph at each block's routing: a traced layer drawing
    seeds compiles per layer key, and past dynamo's recompile limit later blocks would run eager."""
    from fp4lab.nn import GPT, model_config, quantize_model
    assert quantize_model(GPT(model_config("tiny", vocab_size=64, seq_len=16)), preset("nvfp4")).traced_ops
    assert not quantize_model(GPT(model_config("moe-tiny", vocab_size=64, seq_len=16)), preset("nvfp4")).traced_ops


def test_a_layer_pickled_with_its_keys_as_a_tensor_loads_them_in_both_forms():
    from fp4lab.nn.linear import FP4Linear
    from fp4lab.nn.ops import LayerKeys
    layer = FP4Linear(32, 16, recipe=preset("mxfp4"), name="block.fc")
    old = dict(layer.__dict__, keys=layer.keys.tensor)  # as layer_keys made them before LayerKeys
    copy = FP4Linear.__new__(FP4Linear)
    copy.__setstate__(old)
    assert isinstance(copy.keys, LayerKeys) and copy.keys.ints == layer.keys.ints
    assert torch.equal(copy.keys.tensor, layer.keys.tensor)


def test_a_slot_first_drawn_while_tracing_is_written_and_a_full_table_refuses_to_grow():
    from fp4lab.nn.quant import derive_seed
    table = SeedTable("cpu", capacity=2)
    table.fill(5)
    with FakeTensorMode():  # (a traced op reads the slot from its input: SeedSlots)
        assert table.slot(7, 1, 0, 2, ord("a")) == 0  # written for real, not traced
    assert table.values[0].item() == derive_seed(derive_seed(7, 1, 5), 2, ord("a")) and len(table.specs) == 1
    table.seed(7, 1, 0, 2, ord("b"))
    with FakeTensorMode(), pytest.raises(RuntimeError, match="larger capacity"):
        table.slot(7, 1, 0, 1, ord("a"))
    table.seed(7, 1, 0, 1, ord("a"))  # eager: it grows
    assert len(table.values) == 4


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor compiles the traced ops for a GPU")


def _layer_step(fn, x, w, b, dy):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@cuda
@pytest.mark.parametrize("recipe_name", ["nvfp4", "nvfp4_plain", "mxfp4_hadamard"])
@pytest.mark.parametrize("table", [True, False])
def test_an_inductor_compiled_layer_gives_the_eager_bits_at_every_tick(recipe_name, table, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.delenv("FP4LAB_TRACED", raising=False)
    recipe = preset(recipe_name)
    index = ops.register_recipe(recipe)
    context = QuantContext(seeds=SeedTable("cuda") if table else None)
    keys = layer_keys(["block.fc"])
    traced = ops.traceable(index, table, "cuda")
    assert traced == (table or recipe_name != "nvfp4")
    calls, lt_runs = [], []
    monkeypatch.setattr(ops, "_traced_calls", lambda *a, _f=ops._traced_calls: calls.append(1) or _f(*a))
    # cuBLASLt's GEMMs are recorded into the graph (a plan first made while tracing works at run time)
    monkeypatch.setattr(blas.LtPlan, "run", lambda self, *a, _f=blas.LtPlan.run: lt_runs.append(tracing()) or _f(self, *a))
    compiled = torch.compile(lambda x, w, b: fp4_linear(x, w, b, index, context=context, keys=keys), fullgraph=True)
    g = torch.Generator("cuda").manual_seed(0)
    x, dy = (torch.randn(n, k, device="cuda", generator=g).bfloat16() for n, k in ((256, 384), (256, 512)))
    w, b = torch.randn(512, 384, device="cuda", generator=g).bfloat16(), torch.randn(512, device="cuda").bfloat16()
    for tick in range(3):
        context.tick = tick
        # compiled first: its slots are drawn while tracing, as in a compiled run (train.run)
        lt_runs.clear()
        got = _layer_step(compiled, x, w, b, dy)
        compiled_runs = list(lt_runs)
        want = _layer_step(lambda x, w, b: fp4_linear(x, w, b, recipe, name="block.fc", context=context), x, w, b, dy)
        for name, a, e in zip(("y", "dx", "dw", "db"), got, want):
            assert torch.equal(a, e), (tick, name)
        if tick == 0:
            assert bool(calls) == traced  # traced: the body ran while compiling
            calls.clear()
        if traced:  # cuBLASLt's GEMMs recorded while tracing, then run by the recorded op at every
            lt = blas._library() is not None  # later tick (the plan made while tracing works)
            assert (True in compiled_runs) == (lt and tick == 0)
            assert (False in compiled_runs) == lt  # (tick 0: the first run follows the compile)
    assert not calls  # no Python of the body after compiling: Inductor launches the kernels (and the cuBLASLt op)


@cuda
@torch._dynamo.config.patch(error_on_recompile=True)
def test_a_compiled_model_on_the_traced_ops_is_one_graph_with_close_losses(monkeypatch):
    from fp4lab.nn import GPT, model_config, quantize_model
    torch._dynamo.reset()
    calls = []
    monkeypatch.setattr(ops, "_traced_calls", lambda *a, _f=ops._traced_calls: calls.append(1) or _f(*a))
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=128, seq_len=64)).cuda()
    context = quantize_model(model, preset("nvfp4"))
    context.seeds = SeedTable("cuda")
    compiled = torch.compile(model, fullgraph=True)
    for tick in range(3):
        context.tick = tick
        idx = torch.randint(0, 128, (2, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(tick))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = model(idx[:, :-1], idx[:, 1:]).item()
            got = compiled(idx[:, :-1], idx[:, 1:]).item()
        assert abs(got - want) < 2e-2 * abs(want), (tick, got, want)  # (Inductor's own kernels elsewhere)
    assert calls  # the layers took the traced ops (their bodies ran while compiling)


def test_compiling_a_traced_op_turns_off_the_autograd_cache(monkeypatch):
    """AOTAutograd's cache cannot see into a traced op's body (ops._without_autograd_cache): a
    compile that traces one turns it off before AOTAutograd runs; eager calls leave it alone."""
    import torch._functorch.config as functorch_config
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", True)
    monkeypatch.setattr(ops, "traceable", lambda *a: True)
    monkeypatch.setattr(ops, "_gemms_traced", lambda *args: (args[0] * 1,))
    index = _index("nvfp4_plain")
    context = QuantContext()
    x, w = torch.zeros(32, 16), torch.zeros(24, 16)
    ops.fp4_gemms_op(x, w, None, [32], [7], index, context, grouped=False)
    assert functorch_config.enable_autograd_cache  # eager: untouched
    torch._dynamo.reset()
    seen = []
    compiled = torch.compile(lambda x, w: ops.fp4_gemms_op(x, w, None, [32], [7], index, context, grouped=False),
                             backend=lambda gm, inputs: seen.append(functorch_config.enable_autograd_cache) or gm,
                             fullgraph=True)
    compiled(x, w)
    assert seen == [False]  # already off when the backend (AOTAutograd, under Inductor) got the graph
    torch._dynamo.reset()
