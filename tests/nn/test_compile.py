"""torch.compile of FP4 models: one graph, no recompiles across steps, the eager path's results.

The custom ops of nn.ops carry the GEMMs through dynamo; ``aot_eager`` traces the forward and
backward graphs (what inductor would compile) without generating code, which keeps CPU tests fast.
"""

import importlib.util
import os

import pytest
import torch
import torch._dynamo

from fp4lab.nn import GPT, model_config, quantize_model
from fp4lab.nn import gemms as G
from fp4lab.nn.gemms import QuantContext, call_at, fp4_gemms, layer_key
from fp4lab.nn.ops import fp4_gemms_op
from fp4lab.nn.recipe import nvfp4, preset
from fp4lab.nn.seeds import SeedTable


def _model(recipe: str, **overrides):
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=128, seq_len=64))
    quantize_model(model, preset(recipe).override(overrides) if overrides else preset(recipe))
    return model


def _step(model, tick, progress=0.0, seed=0):
    if hasattr(model, "fp4_context"):
        model.fp4_context.tick, model.fp4_context.progress = tick, progress
    g = torch.Generator().manual_seed(seed + tick)
    idx = torch.randint(0, 128, (2, 33), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss_and_grads(model, runner, tick, progress=0.0):
    model.zero_grad(set_to_none=True)
    loss = runner(*_step(model, tick, progress))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4_hadamard"])
@torch._dynamo.config.patch(error_on_recompile=True)  # (monkeypatch loses the flag on torch 2.11)
def test_a_compiled_fp4_model_is_one_graph_with_the_eager_results_at_every_step(recipe):
    torch._dynamo.reset()
    model = _model(recipe)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    # ticks re-draw stochastic rounding and random signs; progress 0.95 crosses nvfp4's bf16_after
    for tick, progress in [(0, 0.0), (1, 0.5), (7, 0.95)]:
        want = _loss_and_grads(model, model, tick, progress)
        got = _loss_and_grads(model, compiled, tick, progress)
        assert torch.equal(got[0], want[0]), (tick, got[0], want[0])
        for name in want[1]:
            assert torch.equal(got[1][name], want[1][name]), (tick, name)


def test_switching_the_pair_off_after_compiling_keeps_the_compiled_graphs_plan(monkeypatch):
    """The forward op's outputs (wgrad's copy of x, or none) are planned when the graph is traced;
    FP4LAB_PAIR=0 set afterwards makes that copy on its own (the same bytes), not a missing one."""
    torch._dynamo.reset()
    model = _model("nvfp4")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _loss_and_grads(model, compiled, 0)  # traced with the pair on
    monkeypatch.setenv("FP4LAB_PAIR", "0")
    want = _loss_and_grads(model, model, 1)
    got = _loss_and_grads(model, compiled, 1)
    assert torch.equal(got[0], want[0])
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_different_ticks_give_different_gradients_through_the_ops():
    # the clock tensor really reaches the op: otherwise every step would replay tick 0's noise
    model = _model("nvfp4")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.fp4_context.tick = 0
    idx, tgt = _step(model, 0)
    grads = []
    for tick in (0, 1):
        model.zero_grad(set_to_none=True)
        model.fp4_context.tick = tick
        compiled(idx, tgt).backward()
        grads.append(model.blocks[0].attn.qkv.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("grouped, sizes, backend", [
    (False, [16], "reference"), (True, [5, 0, 11], "reference"),
    # every expert live on the Triton backend: backward makes fprop's tiles of all experts again
    # in one launch (nothing is kept between the ops) and multiplies them transposed
    pytest.param(True, [5, 16, 11], "triton", marks=pytest.mark.skipif(
        importlib.util.find_spec("triton") is None
        or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
        reason="needs triton and a CUDA device, or TRITON_INTERPRET=1 on a CPU"))])
def test_the_ops_equal_the_autograd_function_bit_for_bit(grouped, sizes, backend, monkeypatch):
    monkeypatch.setenv("FP4LAB_BACKEND", backend)
    # the Triton kernels run on CUDA tensors where a device is present (interpreted on a CPU otherwise)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)

    def randn(*shape, grad=True):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)
    x, w, dy = randn(sum(sizes), 64), randn(len(sizes), 48, 64), randn(sum(sizes), 48, grad=False)
    bias = None if grouped else randn(48)
    wrt = (x, w) if grouped else (x, w, bias)
    context = QuantContext(tick=4, rank=1)
    names = [f"e.{i}" for i in range(len(sizes))]
    recipe = nvfp4()
    per_expert_dgrad_weights = []  # Call.operand of dgrad's weight: the path the grouped launch replaces
    x_for_wgrad = []  # Call.operand of wgrad's x: what a dense layer's forward already made (the pair)
    operand = G.Call.operand
    monkeypatch.setattr(G.Call, "operand", lambda self, t, axis, gemm, side, **kw: (
        per_expert_dgrad_weights.append(1) if (gemm, side) == ("dgrad", "b") else None,
        x_for_wgrad.append(1) if (gemm, side) == ("wgrad", "b") else None,
        operand(self, t, axis, gemm, side, **kw))[-1])
    results = []
    for path in ("function", "op"):
        if path == "function":
            calls = [call_at(recipe, layer_key(n), 4, 0.0, 1, name=n) for n in names]
            y = fp4_gemms(x, w, bias, sizes, calls, grouped=grouped)
        else:
            y = fp4_gemms_op(x, w, bias, sizes, [layer_key(n) for n in names], recipe, context, grouped=grouped)
        results.append((y, *torch.autograd.grad(y, wrt, dy)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    if backend == "triton" or not grouped:  # neither path quantized dgrad's weight again (a dense
        assert not per_expert_dgrad_weights  # layer's op returns fprop's tiles, as eager keeps them)
    if not grouped:  # the op, like the function, kept wgrad's copy of x from the forward's read
        assert not x_for_wgrad


@pytest.mark.parametrize("recipe_name,keeps", [("nvfp4", True), ("bf16", False), ("mxfp4", True)])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 64), (40, 40)])
def test_the_forward_ops_outputs_are_what_its_fake_says(recipe_name, keeps, n, k):
    """torch.library.opcheck: the fake (what a compiled graph plans for) gives the real op's
    outputs' shapes and dtypes, wgrad's copy of x included where gemms.keeps_x_wgrad says, and
    fprop's weight tiles where gemms.keeps_w_values says (NVFP4's 16x16 weights: 40 rows or
    columns pad to 48)."""
    from fp4lab.nn.ops import recipe_index
    recipe = preset(recipe_name)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, k, generator=g), torch.randn(1, n, k, generator=g)
    layers = torch.tensor([layer_key("a")])
    args = (x, w, None, [40], None, layers, recipe_index(recipe), QuantContext().clock, 0, -1, False, True, True)
    torch.library.opcheck(torch.ops.fp4lab.gemms.default, args, test_utils=("test_schema", "test_faketensor"))
    _, xw, scale, wv, w_scale = torch.ops.fp4lab.gemms(*args)
    assert xw.shape == ((k, 64) if keeps else (0,)) and xw.dtype == torch.bfloat16
    assert scale.shape == (() if recipe_name == "nvfp4" else (0,))
    tiles = recipe_name == "nvfp4"  # the one preset of the three with 16x16 weight tiles
    assert wv.shape == ((48, k + (-k % 16)) if tiles else (0,)) and wv.dtype == torch.bfloat16
    assert w_scale.shape == (() if tiles else (0,))
    no_grads = args[:-2] + (False, False)  # nothing kept where no gradient follows
    assert [t.numel() for t in torch.ops.fp4lab.gemms(*no_grads)[1:]] == [0, 0, 0, 0]


@pytest.mark.parametrize("case", ["sizes", "an_empty_expert", "counts", "n_40", "dithered"])
def test_the_grouped_forward_ops_weight_tiles_are_what_its_fake_says(case, monkeypatch):
    """A grouped call keeps every expert's fprop weight tiles (one launch's GroupedValues: [G N, K
    padded], a tensor scale per expert) where every expert has rows (device counts, or host sizes
    without a 0), N is whole 16-row tiles and the weight undithered; the fake plans the same shapes."""
    from fp4lab.nn.ops import recipe_index
    n = 40 if case == "n_40" else 48
    sizes = [16, 0, 24] if case == "an_empty_expert" else [16, 8, 16]
    # device counts take the Triton path: on CUDA tensors where a GPU is present, interpreted otherwise
    dev = "cuda" if case == "counts" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(sum(sizes), 64, generator=g).to(dev), torch.randn(3, n, 64, generator=g).to(dev))
    layers = torch.tensor([layer_key(f"e.{e}") for e in range(3)])  # (the ops take keys on the CPU)
    context = QuantContext()
    counts = None
    if case == "counts":  # (with seeds in a table)
        if importlib.util.find_spec("triton") is None:
            pytest.skip("needs triton (TRITON_INTERPRET=1 on a CPU)")
        monkeypatch.setenv("FP4LAB_BACKEND", "triton")
        counts, sizes, context.seeds = torch.tensor(sizes, device=dev), [], SeedTable(dev, capacity=16)
    dither = {"fprop.b.dither": 0.5, "dgrad.b.dither": 0.5} if case == "dithered" else {}
    recipe = preset("nvfp4").override({"keep_first": 0, "keep_last": 0, **dither})
    seeds = -1 if context.seeds is None else context.seeds.index
    args = (x, w, None, sizes, counts, layers, recipe_index(recipe), context.clock, 0, seeds, True, True, True)
    torch.library.opcheck(torch.ops.fp4lab.gemms.default, args, test_utils=("test_schema", "test_faketensor"))
    _, xw, _, wv, w_scale = torch.ops.fp4lab.gemms(*args)
    kept = case in ("sizes", "counts")
    assert xw.numel() == 0  # (a grouped layer's wgrad copy of x is made in backward)
    assert wv.shape == ((3 * n, 64) if kept else (0,)) and w_scale.shape == ((3,) if kept else (0,))


def test_a_compiled_moe_model_gives_the_eager_results():
    # routing (bincount, per-expert counts) breaks the graph; the grouped FP4 projections do not
    torch.manual_seed(0)
    model = GPT(model_config("moe-tiny", vocab_size=128, seq_len=64))
    quantize_model(model, preset("nvfp4"))
    compiled = torch.compile(model, backend="aot_eager")
    want = _loss_and_grads(model, model, 3)
    got = _loss_and_grads(model, compiled, 3)
    assert torch.equal(got[0], want[0])
    for name in want[1]:
        if name == "wte.weight":  # the traced embedding backward sums its rows in another order
            torch.testing.assert_close(got[1][name], want[1][name], rtol=0, atol=1e-7)
        else:
            assert torch.equal(got[1][name], want[1][name]), name


def test_the_bf16_moe_baseline_compiles_as_one_graph():
    # grouped expert GEMMs with device-side offsets and fixed-size counts: nothing data-dependent
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(model_config("moe-tiny", vocab_size=128, seq_len=64))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(model, model, 0)
        got = _loss_and_grads(model, compiled, 0)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def _frames_compiled(depth: int) -> int:
    """Dynamo compilations (first ones and recompiles) of an NVFP4 MoE GPT of ``depth`` MoE blocks,
    one training step."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(model_config("moe-tiny", vocab_size=128, seq_len=64, depth=depth))
    quantize_model(model, preset("nvfp4").override({"keep_first": 0, "keep_last": 0}))
    compiled = torch.compile(model, backend="aot_eager")
    _loss_and_grads(model, compiled, 0)
    return counters["frames"]["ok"]


def test_a_compiled_moe_model_compiles_no_more_frames_when_deeper():
    # routing breaks each MoE block's graph, so dynamo compiles Block.forward as a frame of its
    # own; a guard on a layer's name (the op's key as a Python constant) recompiled it per block
    # until dynamo's limit of 8 sent moe64's later blocks back to eager
    assert _frames_compiled(5) == _frames_compiled(3)  # block 0 is dense: 2 and 4 MoE blocks


@torch._dynamo.config.patch(error_on_recompile=True)
@pytest.mark.parametrize("dither", [0.0, 0.5])
def test_a_compiled_model_reads_its_seeds_from_a_table_with_the_eager_bits(dither):
    """With a SeedTable on the context the custom ops build their calls on it (the table's index is
    an op argument), so a CUDA graph around the compiled step would draw each step's seeds; the
    bits are the eager int seeds', tick after tick, from one compilation. The weight's dither
    seed too, where the recipe dithers."""
    torch._dynamo.reset()
    model = _model("nvfp4", **({"fprop.b.dither": dither, "dgrad.b.dither": dither} if dither else {}))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    table = SeedTable("cpu", capacity=256)
    for tick in (2, 3):
        model.fp4_context.seeds = None
        want = _loss_and_grads(model, model, tick)
        model.fp4_context.seeds = table
        got = _loss_and_grads(model, compiled, tick)
        assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    assert table.specs  # the ops drew from the table
    assert bool(dither) == any(spec[4] == ord("d") for spec in table.specs)


@pytest.mark.parametrize("model_name", ["tiny", "moe-tiny"])
def test_a_second_model_in_the_process_finds_its_graphs_compiled(model_name):
    """A layer hands the op its recipe's index (RecipeSlot), not the recipe to look up in the
    process's registry: a lookup guarded the registry's length, so a second run in one process
    (another recipe registered meanwhile) recompiled every frame, and an MoE block's frame hit
    dynamo's limit of 8 and ran eager from then on."""
    torch._dynamo.reset()

    def step(recipe):
        torch.manual_seed(0)
        model = GPT(model_config(model_name, vocab_size=128, seq_len=64))
        quantize_model(model, recipe)
        return _loss_and_grads(model, torch.compile(model, backend="aot_eager"), 0)

    first = step(preset("nvfp4"))
    quantize_model(GPT(model_config("tiny", vocab_size=128, seq_len=64)), preset("mxfp4"))  # a new recipe
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = step(preset("nvfp4"))  # an equal recipe, a new object
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][n], second[1][n]) for n in first[1])


def test_an_unpickled_layer_registers_its_recipe_in_the_new_process(monkeypatch):
    import pickle
    from fp4lab.nn import ops
    from fp4lab.nn.linear import FP4Linear
    layer = FP4Linear(32, 16, recipe=preset("mxfp4"))
    data = pickle.dumps(layer)
    monkeypatch.setattr(ops, "_RECIPES", [preset("nvfp4")])  # another process's registry
    monkeypatch.setattr(ops, "_SEEN", [])
    copy = pickle.loads(data)
    assert ops.registered_recipe(copy.recipe_id) == copy.recipe == layer.recipe and copy.recipe_id == 1


def test_a_layer_pickled_before_the_recipe_slot_loads_with_its_recipe():
    from fp4lab.nn.linear import FP4Linear
    layer = FP4Linear(32, 16, recipe=preset("mxfp4"))
    old = {k: v for k, v in layer.__dict__.items() if k not in ("_recipe", "recipe_id")}
    old["recipe"] = layer.recipe  # where a module kept its recipe before RecipeSlot
    copy = FP4Linear.__new__(FP4Linear)
    copy.__setstate__(old)
    x = torch.randn(4, 32)
    assert copy.recipe == layer.recipe and "recipe" not in copy.__dict__
    assert torch.equal(copy(x), layer(x))


def test_a_compiled_layer_on_the_eager_path_is_not_recompiled_by_a_new_recipe():
    """Collecting operand statistics keeps a compiled layer on the eager path, which reads the
    module's own recipe: registering another recipe recompiles nothing there either, and neither
    does the next step's tick."""
    from fp4lab.nn.linear import FP4Linear
    torch._dynamo.reset()
    layer = FP4Linear(32, 16, recipe=preset("nvfp4"), context=QuantContext(collect=True))
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(4, 32)
    compiled(x)
    FP4Linear(32, 16, recipe=preset("nvfp4").override({"keep_first": 3}))  # a new recipe registered
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(x)
        for tick in range(1, 10):  # nor does the step: the traced frame reads no tick (the limit is 8)
            layer.context.tick = tick
            compiled(x)


def test_inductors_cpp_wrapper_gives_its_python_wrappers_bits():
    """TrainConfig.cpp_wrapper compiles with Inductor's C++ wrapper: the same kernels launched from
    C++, so the same losses and gradients at every tick as the Python wrapper's graph (the FP4 ops
    called back from C++ included)."""
    runs = []
    # one thread for Inductor's CPU kernels: across threads they add the embedding's gradient rows
    # with atomics, in an order the threads' timing picks (on a busy CI machine wte.weight's
    # gradient came out different, the FP4 layers' equal)
    for options in ({"cpp.threads": 1}, {"cpp.threads": 1, "cpp_wrapper": True}):
        torch._dynamo.reset()
        model = _model("nvfp4")
        compiled = torch.compile(model, options=options)
        runs.append([_loss_and_grads(model, compiled, tick) for tick in (0, 1)])
    for (want_loss, want), (got_loss, got) in zip(*runs):
        assert torch.equal(got_loss, want_loss)
        for name in want:
            assert torch.equal(got[name], want[name]), name
