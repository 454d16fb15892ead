"""nn.seeds.SeedTable: a step's seeds in device memory give the bits of the int seeds, tick by tick."""

import importlib.util

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from fp4lab.nn.gemms import GEMMS, QuantContext, call_at, layer_key
from fp4lab.nn.linear import FP4Linear
from fp4lab.nn.quant import derive_seed
from fp4lab.nn.recipe import nvfp4, preset
from fp4lab.nn.seeds import SeedTable

from .seed_oracle import slot_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (TRITON_INTERPRET=1 on a CPU)"))]


def _step(layer: FP4Linear, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad, layer.weight.grad]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_sr_random", "nvfp4_dither"])
def test_a_seed_table_gives_the_int_seeds_bits_at_every_tick(name, backend, monkeypatch):
    """NVIDIA's recipe (SR on the gradients, random Hadamard signs on wgrad, 16x16 weight tiles),
    MXFP4 with SR and random 32-point signs, and NVIDIA's recipe with its weight dithered (the
    dither's seed a slot too): with the table, every kernel reads its seeds from one device buffer that setting the tick
    refills; forward and both gradients equal the int-seed path's bit for bit at each tick, and
    the ticks differ (the slots were refilled, not frozen)."""
    monkeypatch.setenv("FP4LAB_BACKEND", backend)
    torch.manual_seed(0)
    dither = {"fprop.b.dither": 0.5, "dgrad.b.dither": 0.5} if name == "nvfp4_dither" else {}
    recipe = (preset("nvfp4").override({"keep_first": 0, "keep_last": 0, **dither}) if name.startswith("nvfp4") else
              preset("mxfp4").override({"wgrad.hadamard": "random", "dgrad.a.rounding": "stochastic",
                                        "wgrad.a.rounding": "stochastic"}))
    plain, tabled = QuantContext(rank=1), QuantContext(rank=1, seeds=SeedTable(DEVICE, capacity=64))
    layer = FP4Linear(64, 48, recipe=recipe, name="blocks.0.mlp.up", context=plain).to(DEVICE)
    x, dy = torch.randn(32, 64, device=DEVICE), torch.randn(32, 48, device=DEVICE)
    results = []
    for tick in (3, 4, 3):
        plain.tick = tabled.tick = tick
        layer.context = plain
        want = _step(layer, x, dy)
        layer.context = tabled
        got = _step(layer, x, dy)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        results.append(want)
    assert not torch.equal(results[0][2], results[1][2]) and torch.equal(results[0][2], results[2][2])
    assert tabled.seeds.specs  # the kernels did draw from the table
    assert (name == "nvfp4_dither") == any(spec[4] == ord("d") for spec in tabled.seeds.specs)  # the dither's slot


def test_slots_hold_derive_seed_and_are_shared_per_spec():
    table = SeedTable("cpu", capacity=4)
    context = QuantContext(tick=9, rank=2, seeds=table)
    recipe = nvfp4()
    call = call_at(recipe, layer_key("a"), 9, 0.0, 2, seeds=context.seeds)
    slot = call.seed("wgrad", "a")
    root = derive_seed(recipe.seed, layer_key("a"), 9, 2)
    assert int(slot) == derive_seed(root, GEMMS.index("wgrad"), ord("a"))
    assert call.seed("wgrad", "a").data_ptr() == slot.data_ptr() and len(table.specs) == 1
    context.tick = 10  # refilled in place: the view a captured kernel holds sees the new value
    assert int(slot) == slot_seed((recipe.seed, layer_key("a"), 2, GEMMS.index("wgrad"), ord("a")), 10)
    for side in "bcd":
        call.seed("wgrad", side)
    grown = call.seed("dgrad", "a")  # a fifth slot: the table doubles, the values kept
    assert len(table.values) == 8 and int(grown) == slot_seed((recipe.seed, layer_key("a"), 2, GEMMS.index("dgrad"),
                                                                ord("a")), 10)
    assert int(call.seed("wgrad", "a")) == int(slot) and call.seed("wgrad", "a").data_ptr() != slot.data_ptr()


def test_a_groups_seeds_are_one_view_of_the_table_where_its_slots_run_on():
    """A grouped launch's seeds (one per expert): the experts' slots, drawn one after another, as one
    view of the table (no copy or launch), refilled in place each tick; slots drawn apart are
    gathered, the same values."""
    from fp4lab.nn.gemms import _group_seeds
    table = SeedTable("cpu", capacity=64)
    context = QuantContext(tick=3, seeds=table)
    recipe = nvfp4()
    calls = [call_at(recipe, layer_key(f"e.{g}"), 3, 0.0, 0, seeds=context.seeds) for g in range(5)]
    want = lambda tick: [derive_seed(derive_seed(recipe.seed, layer_key(f"e.{g}"), tick), GEMMS.index("wgrad"),
                                     ord("a")) for g in range(5)]
    group = _group_seeds(calls, "wgrad", "a")
    assert group.tolist() == want(3) and group._base is table.values
    context.tick = 4
    assert group.tolist() == want(4)  # (the view a captured launch holds sees each tick's values)
    calls[2].seed("dgrad", "a")  # a slot drawn between the experts' next ones
    apart = [calls[g] for g in (0, 2, 4)]
    shuffled = _group_seeds(apart, "fprop", "a")[:1].tolist() + _group_seeds(calls[1:2], "fprop", "a").tolist()
    assert shuffled == [derive_seed(derive_seed(recipe.seed, layer_key(f"e.{g}"), 4), GEMMS.index("fprop"), ord("a"))
                        for g in (0, 1)]
    gathered = _group_seeds(calls, "fprop", "a")  # slots 0, 2, 4 then 1, 3: not one run
    assert gathered._base is None and gathered.tolist() == [
        derive_seed(derive_seed(recipe.seed, layer_key(f"e.{g}"), 4), GEMMS.index("fprop"), ord("a")) for g in range(5)]
    small = SeedTable("cpu", capacity=2)  # drawing the group's slots grows the table: read after
    small.fill(4)
    grown = _group_seeds([call_at(recipe, layer_key(f"e.{g}"), 4, 0.0, 0, seeds=small) for g in range(5)], "wgrad", "a")
    assert grown.tolist() == want(4) and grown._base is small.values
    handed = small.values.clone()  # a traced op's reading of the table: views of the buffer it was handed
    slots = small.reading(handed).seeds([c.seed_spec("wgrad", "a") for c in calls])
    assert slots._base is handed and slots.tolist() == want(4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_on_a_seed_table_reads_no_seed_on_the_host(backend, monkeypatch):
    """With a table, no seed of a step is read back to the host (what CUDA refuses while a graph
    is captured): SR on the gradients, random signs on wgrad, the weight's dither, and a random
    rotation on fprop, which a dithered weight takes unfused (drawn by formats.hadamard)."""
    import fp4lab.formats.blocks as blocks
    monkeypatch.setenv("FP4LAB_BACKEND", backend)
    read = []
    real = blocks.resolve_seed

    def spy(seed):
        read.append(isinstance(seed, torch.Tensor))
        return real(seed)
    monkeypatch.setattr(blocks, "resolve_seed", spy)  # every seed goes through formats.blocks.seed_key
    recipe = preset("nvfp4").override({"keep_first": 0, "keep_last": 0, "fprop.b.dither": 0.5,
                                       "dgrad.b.dither": 0.5, "fprop.hadamard": "random"})
    for seeds in (SeedTable(DEVICE, capacity=64), None):
        read.clear()
        layer = FP4Linear(64, 48, recipe=recipe, name="a", context=QuantContext(tick=2, seeds=seeds)).to(DEVICE)
        _step(layer, torch.randn(32, 64, device=DEVICE), torch.randn(32, 48, device=DEVICE))
        assert not any(read) if seeds is not None else read  # int seeds: resolved, and never tensors


@settings(max_examples=30, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from([0, 1234, -5, 2**63 + 3, 2**64 - 1]),
                                st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 0, 1, 7, 2**40, 2**64]),
                                st.integers(0, 2), st.sampled_from([ord("a"), ord("b"), ord("h")])),
                      min_size=1, max_size=40, unique=True),
       ticks=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=3), grow_at=st.integers(1, 40))
@example(parts=[(0, 0, 0, 0, 97), (1, 0, 0, 0, 97)], ticks=[0, 1], grow_at=1)  # slots drawn after a fill
@example(parts=[(0, 5, 2**64, 0, 97), (0, 5, 0, 0, 97)], ticks=[3], grow_at=2)  # a rank whose mask is 0
def test_a_fill_writes_each_slots_derived_seed(parts, ticks, grow_at):
    """fill's array passes (each spec folded up to its layer once) give derive_seed(derive_seed(recipe
    seed, layer, tick[, rank]), gemm, side) for every slot (rank 0 folds none), across ticks and
    with slots drawn between fills (each at the table's tick when drawn); parts past int64 and
    negative read as derive_seed's mask reads them."""
    table = SeedTable("cpu", capacity=4)
    for i, spec in enumerate(parts):
        at = table.slot(*spec)  # (first: drawing may grow the buffer)
        assert int(table.values[at]) == slot_seed(spec, table.tick)  # drawn between fills: its value at the tick
        if i + 1 == grow_at or i + 1 == len(parts):
            for tick in ticks:
                table.fill(tick)
                want = [slot_seed(spec, tick) for spec in table.specs]
                assert table.values[: len(table.specs)].tolist() == want


def test_a_table_goes_with_its_run():
    """The process's tables are held weakly: a dropped table (and its device buffer) is freed, and
    its index then names no table, a clear error rather than another run's seeds."""
    import gc
    import weakref
    from fp4lab.nn.seeds import table_at
    table = SeedTable("cpu", capacity=4)
    index, ref = table.index, weakref.ref(table)
    assert table_at(index) is table and table_at(-1) is None
    del table
    gc.collect()
    assert ref() is None
    with pytest.raises(LookupError, match="is gone"):
        table_at(index)
    assert SeedTable("cpu", capacity=4).index != index  # (indices are never reused)


def test_the_stiction_meters_weight_leaves_the_table_as_it_was(monkeypatch):
    """nn.linear.fprop_weight quantizes the weight as fprop does, with collect off: its context
    copy must not refill the run's SeedTable (a host-to-device copy of every slot) or touch the
    run's own context."""
    from fp4lab.nn.linear import fprop_weight
    table = SeedTable("cpu", capacity=4)
    context = QuantContext(tick=5, collect=True, seeds=table)
    fills = []
    monkeypatch.setattr(SeedTable, "fill", lambda self, tick: fills.append(tick))
    recipe = nvfp4().override({"fprop.b.dither": 0.5, "dgrad.b.dither": 0.5})  # (a dithered weight draws a seed)
    q = fprop_weight(torch.randn(32, 64), recipe, name="a", context=context)
    assert q is not None and fills == [] and context.collect and context.tick == 5 and context.seeds is table


def test_a_copied_table_is_a_table_of_its_own():
    """A deepcopy (a copied model's context) or a pickle gets its own index, registered: the ops
    reach the copy through it, never the original."""
    import copy
    import pickle
    from fp4lab.nn.seeds import table_at
    table = SeedTable("cpu", capacity=4)
    table.slot(1, 2, 0, 0, 97)
    for twin in (copy.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert twin.index != table.index and table_at(twin.index) is twin and table_at(table.index) is table
        assert twin.specs == table.specs and torch.equal(twin.values, table.values)


def test_with_a_table_a_layers_calls_are_made_once_per_recipe_in_force():
    """nn.gemms.layer_calls: with every seed a SeedTable slot, an MoE projection's Calls hold nothing
    that changes with the tick, so they are made once and kept (their root, never read, is None);
    after a late switch the switched recipe's own; fresh ones at every tick where the step
    collects statistics, evaluates with BF16 GEMMs or has no table."""
    from fp4lab.nn.gemms import layer_calls, make_call
    from fp4lab.nn.linear import expert_names
    recipe = nvfp4().override({"bf16_after": 0.5})
    names = expert_names("blocks.1.ffn.experts", 4, "gate")
    context = QuantContext(tick=3, rank=2, seeds=SeedTable("cpu", capacity=8))
    first = layer_calls(recipe, names, context)
    context.tick = 4
    assert layer_calls(recipe, names, context) is first and all(c.root is None for c in first)
    made = [make_call(recipe, n, context) for n in names]
    assert [(c.recipe, c.name, c.layer, c.rank, c.seeds) for c in first] == [
        (c.recipe, c.name, c.layer, c.rank, c.seeds) for c in made]
    assert [int(c.seed("wgrad", "a")) for c in first] == [int(c.seed("wgrad", "a")) for c in made]
    context.progress = 0.75
    late = layer_calls(recipe, names, context)
    assert late is not first and late[0].recipe == recipe.at_progress(0.75) and layer_calls(recipe, names, context) is late
    assert layer_calls(recipe, names[:1], context) is not late  # (another layer)
    for fresh in (dict(collect=True), dict(forward_bf16=True), dict(seeds=None)):
        other = QuantContext(tick=4, rank=2, **{"seeds": context.seeds, **fresh})
        got = layer_calls(recipe, names, other)
        assert got is not layer_calls(recipe, names, other) and all(c.root is not None for c in got)
    with pytest.raises(TypeError):  # a root read where there is none: loud
        Call = type(first[0])
        Call(**{**{f: getattr(first[0], f) for f in ("recipe", "name", "root", "stats", "layer", "rank")},
                "seeds": None}).seed("wgrad", "a")


def test_kept_calls_keep_their_groups_slots_and_read_the_tables_current_buffer():
    """A grouped launch's seeds from a layer's kept Calls (gemms._group_seeds): the slots looked up
    once are the table's own (the values make_call's Calls draw at each tick), still right after
    the table's buffer grows and moves, and the kept list reaches the autograd Function whole."""
    from fp4lab.nn import gemms
    from fp4lab.nn.linear import expert_names
    recipe = nvfp4()
    names = expert_names("blocks.1.ffn.experts", 6, "up")
    context = QuantContext(tick=3, seeds=SeedTable("cpu", capacity=8))
    kept = gemms.layer_calls(recipe, names, context)
    for tick in (3, 4):
        context.tick = tick
        want = [int(gemms.make_call(recipe, n, context).seed("dgrad", "a")) for n in names]
        assert gemms._group_seeds(kept, "dgrad", "a").tolist() == want
        assert list(kept.slots) == [("dgrad", "a")]
    before = context.seeds.values
    gemms._group_seeds(kept, "wgrad", "a")  # 12 slots drawn in all: the buffer of 8 grows, and moves
    assert context.seeds.values is not before
    context.tick = 5
    want = [int(gemms.make_call(recipe, n, context).seed("dgrad", "a")) for n in names]
    assert gemms._group_seeds(kept, "dgrad", "a").tolist() == want
    assert gemms._group_seeds(list(kept), "dgrad", "a").tolist() == want  # (a plain list: looked up)
    seen = []
    real = gemms._FP4GemmsFn.apply
    gemms._FP4GemmsFn.apply = lambda *args: seen.append(args[4]) or real(*args)
    try:
        gemms.fp4_gemms(torch.randn(12, 32), torch.randn(6, 16, 32), None, [2] * 6, kept, grouped=True)
    finally:
        gemms._FP4GemmsFn.apply = real
    assert seen[0] is kept


def test_the_kept_calls_stay_bounded_and_let_a_replaced_table_go():
    """A caller making a new recipe object at every call (the functional API) cannot grow the
    context's kept Calls without bound, and a table the context no longer holds is not kept alive
    by them."""
    import gc
    import weakref
    from fp4lab.nn import gemms
    context = QuantContext(seeds=SeedTable("cpu", capacity=8))
    for tick in range(gemms._KEPT_CALLS + 5):
        context.tick = tick
        gemms.layer_calls(nvfp4().override({"bf16_after": 0.9}), ["a"], context)
    assert len(context.kept_calls) <= gemms._KEPT_CALLS
    old = weakref.ref(context.seeds)
    context.seeds = SeedTable("cpu", capacity=8)
    gemms.layer_calls(nvfp4(), ["a"], context)
    gc.collect()
    assert old() is None and len(context.kept_calls) == 1
