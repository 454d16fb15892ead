"""train.graphed.GraphedStep: a captured FP4 training step replays the eager steps bit for bit.

The capture tests need a CUDA device (the device machine runs them); on a CPU only the input
checks run."""

import functools

import pytest
import torch

from fp4lab.nn import GPT, model_config, quantize_model
from fp4lab.nn.gemms import QuantContext
from fp4lab.nn.recipe import preset
from fp4lab.train.graphed import GraphedStep

USES_THE_GPU = True  # (conftest: the other trainer tests hide it)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WARMUP = 3


def test_cpu_inputs_are_refused():
    with pytest.raises(ValueError, match="CUDA tensors"):
        GraphedStep(lambda x: x.sum(), torch.optim.SGD([torch.zeros(1, requires_grad=True)]), QuantContext(),
                    (torch.zeros(2),))


_DITHER = {"fprop.b.dither": 0.5, "dgrad.b.dither": 0.5}


def _model(recipe: str):
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=256, seq_len=64)).cuda()
    context = quantize_model(model, preset("nvfp4").override(
        {"keep_first": 0, "keep_last": 0, **(_DITHER if recipe == "nvfp4_dither" else {})})
        if recipe.startswith("nvfp4") else preset(recipe))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # no cast cache across replays
            return model(idx[:, :-1], idx[:, 1:])
    return model, context, optimizer, loss_fn


@cuda
@pytest.mark.parametrize("recipe", ["nvfp4", "bf16", "nvfp4_dither"])
def test_a_captured_step_replays_the_eager_steps_bit_for_bit(recipe):
    """Two identical models from the same seed. One steps eagerly with int seeds; the other warms
    up (ticks 0-2 on the example batch, eager) and then replays its captured step at ticks 3-7,
    each tick's seeds from the table. Every loss and the final weights agree bit for bit."""
    batches = torch.randint(0, 256, (8, 4, 65), generator=torch.Generator().manual_seed(1)).cuda()
    batch = [batches[0] if tick < WARMUP else batches[tick] for tick in range(8)]  # the warm-up's batch
    eager, context, optimizer, loss_fn = _model(recipe)
    want = []
    for tick in range(8):
        context.tick = tick
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(batch[tick])
        loss.backward()
        optimizer.step()
        want.append(loss.detach().clone())
    graphed, context, optimizer, loss_fn = _model(recipe)
    step = GraphedStep(loss_fn, optimizer, context, (batches[0],), warmup=WARMUP)
    got = [step(tick, batch[tick]).clone() for tick in range(WARMUP, 8)]
    for tick, loss in zip(range(WARMUP, 8), got):
        assert torch.equal(loss, want[tick]), tick
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    assert recipe == "bf16" or context.seeds.specs  # the FP4 kernels drew from the table


def _config(token_file, out, **settings) -> "TrainConfig":
    from fp4lab.train.loop import TrainConfig
    base = dict(out=str(out), model="tiny", data=str(token_file), steps=8, batch_size=4, seq_len=32, lr=3e-3,
                warmup=2, eval_every=4, eval_batches=1, log_every=4, progress=False, recipe="nvfp4",
                recipe_overrides={"keep_first": 0, "keep_last": 0, "bf16_after": 0.75})
    return TrainConfig(**{**base, **settings})


def test_the_trainer_refuses_what_a_graph_cannot_replay(token_file, tmp_path):
    from fp4lab.train.loop import train
    with pytest.raises(ValueError, match="grad_accum must be 1"):
        _config(token_file, tmp_path / "a", cuda_graph=True, grad_accum=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            train(_config(token_file, tmp_path / "b", cuda_graph=True))


@cuda
def test_a_graphed_training_run_is_the_eager_run_bit_for_bit(token_file, tmp_path):
    """NVIDIA's recipe with a late switch to BF16 at 75% (a second capture): every train loss,
    every evaluation and the final BF16-forward evaluation equal the eager run's."""
    from fp4lab.train.loop import train
    eager = train(_config(token_file, tmp_path / "eager"))
    graphed = train(_config(token_file, tmp_path / "graphed", cuda_graph=True))
    assert graphed.train_curve == eager.train_curve
    assert [e.val_loss for e in graphed.evals] == [e.val_loss for e in eager.evals]
    assert graphed.final.bf16_forward_val_loss == eager.final.bf16_forward_val_loss


def test_a_graph_is_refused_where_experts_read_their_counts_on_the_host():
    from fp4lab.train.run import graph_refusal
    assert graph_refusal(host_counts=False) is None  # a dense model, or BF16 experts on torch._grouped_mm
    assert "counts on the host" in graph_refusal(host_counts=True)
    assert "CUDA device" in graph_refusal(host_counts=False, device_type="cpu")
    assert "one process" in graph_refusal(host_counts=False, world=2)


@cuda
def test_a_graphed_bf16_moe_run_is_the_eager_run_bit_for_bit(token_file, tmp_path, monkeypatch):
    """BF16 experts multiply on torch._grouped_mm with the routing's counts on the device, so their
    step is captured: every train loss and evaluation equals the eager run's (the routing's load
    counted inside the graph, the balancing bias updated after each replay). So are FP4 experts
    whose recipe quantizes every GEMM's activations for all experts at once (NVIDIA's, its late
    switch to BF16 captured again), against an eager run whose experts read the counts on the host
    (FP4LAB_DEVICE_COUNTS=0; else an eager CUDA run keeps them on the device too); one that rotates
    the forward's operands reads the counts on the host and is refused before training starts."""
    from fp4lab.train.loop import train
    for name, moe in (("bf16", dict(model="moe-tiny", recipe="bf16", recipe_overrides={})),
                      ("nvfp4", dict(model="moe-tiny"))):
        monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "0")
        eager = train(_config(token_file, tmp_path / f"{name}-eager", **moe))
        monkeypatch.delenv("FP4LAB_DEVICE_COUNTS")
        graphed = train(_config(token_file, tmp_path / f"{name}-graphed", cuda_graph=True, **moe))
        assert graphed.status == eager.status == "ok"
        assert graphed.train_curve == eager.train_curve, name
        assert [e.val_loss for e in graphed.evals] == [e.val_loss for e in eager.evals], name
    with pytest.raises(ValueError, match="experts read the routing's counts on the host"):
        train(_config(token_file, tmp_path / "fp4", cuda_graph=True, model="moe-tiny",
                      recipe_overrides={"keep_first": 0, "keep_last": 0, "fprop.hadamard": "deterministic"}))


@cuda
def test_a_compiled_and_graphed_fp4_moe_run_is_the_compiled_eager_run(token_file, tmp_path, monkeypatch):
    """Compiled, FP4 experts under NVIDIA's recipe hand the routing's counts to the custom ops as a
    device tensor in a graphed step, so the run is captured (no refusal; a second capture after the
    late switch); the compiled eager run here reads the counts on the host (FP4LAB_DEVICE_COUNTS=0),
    a graph break at each MoE block. Compiled with aot_eager (each traced op runs as itself), the
    two runs are the same bits: every train loss and evaluation."""
    from fp4lab.train.loop import train
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    moe = dict(model="moe-tiny", compile=True)
    monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "0")
    eager = train(_config(token_file, tmp_path / "eager", **moe))
    monkeypatch.delenv("FP4LAB_DEVICE_COUNTS")
    graphed = train(_config(token_file, tmp_path / "graphed", cuda_graph=True, **moe))
    assert graphed.status == eager.status == "ok"
    assert graphed.train_curve == eager.train_curve
    assert [e.val_loss for e in graphed.evals] == [e.val_loss for e in eager.evals]


@cuda
def test_a_compiled_and_graphed_fp4_moe_run_under_inductor_trains_as_the_compiled_eager_one(token_file, tmp_path):
    """Under inductor the two runs compile different graphs (one per step against one broken at each
    MoE block), which fuse bf16 elementwise work differently, and FP4 rounding amplifies those
    last-bit differences from step to step. On an H100 (benchmarks/NOTES.md, 2026-11-26) inductor
    alone moved this 8-step curve up to 2.5% from the uncompiled run's, and the graphed run sat
    1.3% from the compiled eager one: the first loss (the same weights, forward only) agrees to
    1e-4, the curves and the final evaluation to 5%."""
    from fp4lab.train.loop import train
    moe = dict(model="moe-tiny", compile=True)
    eager = train(_config(token_file, tmp_path / "eager", **moe))
    graphed = train(_config(token_file, tmp_path / "graphed", cuda_graph=True, **moe))
    assert graphed.status == eager.status == "ok"
    assert [s for s, _ in graphed.train_curve] == [s for s, _ in eager.train_curve]
    losses = torch.tensor([v for _, v in graphed.train_curve]), torch.tensor([v for _, v in eager.train_curve])
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-4, atol=0)
    torch.testing.assert_close(*losses, rtol=5e-2, atol=0)
    torch.testing.assert_close(graphed.final.val_loss, eager.final.val_loss, rtol=5e-2, atol=0)
    assert losses[0][-1] < losses[0][0] - 1  # it trains (5.5 -> about 4.1 in 8 steps)


@cuda
def test_deterministic_gpu_runs_repeat_bit_for_bit_graphed_or_not(token_file, tmp_path):
    """At a batch where cuDNN's attention backward varies between reruns (32 x 256 here; the
    tiny tests above pass without the setting), deterministic=true gives the same bits on a
    rerun, and the graphed run the eager run's."""
    from fp4lab.train.loop import train
    big = dict(steps=6, batch_size=32, seq_len=256, eval_every=3, deterministic=True)
    first = train(_config(token_file, tmp_path / "a", **big))
    again = train(_config(token_file, tmp_path / "b", **big))
    graphed = train(_config(token_file, tmp_path / "c", cuda_graph=True, **big))
    assert again.train_curve == first.train_curve and again.final.val_loss == first.final.val_loss
    assert graphed.train_curve == first.train_curve and graphed.final.val_loss == first.final.val_loss


@cuda
def test_a_stopped_deterministic_gpu_run_resumes_to_the_same_bits_graphed_or_not(token_file, tmp_path):
    """On a GPU a stopped run continues exactly once deterministic=true: stopped at step 3 and
    resumed (eager, and graphed: a new capture after the resume), every loss and evaluation equals
    the run done in one go."""
    from fp4lab.train.loop import train
    big = dict(steps=6, batch_size=32, seq_len=256, eval_every=3, deterministic=True)
    whole = train(_config(token_file, tmp_path / "whole", **big))
    for name, settings in (("eager", {}), ("graphed", {"cuda_graph": True})):
        first = train(_config(token_file, tmp_path / name, stop_at=3, **big, **settings))
        assert first.status == "stopped"
        rest = train(_config(token_file, tmp_path / name, **big, **settings), resume=True)
        assert rest.train_curve == whole.train_curve and rest.evals == whole.evals, name
        assert rest.final.fp4_forward_val_loss == whole.final.fp4_forward_val_loss is not None, name


def test_eager_fp4_experts_get_device_seeds_where_their_counts_can_stay_there(monkeypatch):
    """train.run.seeds_on_device: on CUDA, a compiled run, or an eager one whose FP4 experts keep the
    routing's counts on the device (which they do only with a SeedTable: else each MoE projection
    reads them on the host); not dense eager models, BF16 experts, a CPU run or FP4LAB_DEVICE_COUNTS=0."""
    from fp4lab.train.run import seeds_on_device
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")  # (the kernels' rule as on a GPU: interpreted here,
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the models' weights on the CPU, on a GPU host too)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    models = {}
    for name, recipe in (("moe", "nvfp4"), ("dense", "nvfp4"), ("moe_bf16", None)):
        torch.manual_seed(0)
        models[name] = GPT(model_config("tiny" if name == "dense" else "moe-tiny"))
        if recipe:
            quantize_model(models[name], preset(recipe))
    assert seeds_on_device(models["moe"], cuda, compiled=False)
    assert not seeds_on_device(models["dense"], cuda, compiled=False) and seeds_on_device(models["dense"], cuda,
                                                                                          compiled=True)
    assert not seeds_on_device(models["moe_bf16"], cuda, compiled=False)
    assert not seeds_on_device(models["moe"], cpu, compiled=False) and not seeds_on_device(models["moe"], cpu,
                                                                                           compiled=True)
    monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "0")  # (the host-counts fallback)
    assert not seeds_on_device(models["moe"], cuda, compiled=False)


def test_setup_gives_the_run_a_seed_table_where_the_rule_says_so(token_file, tmp_path, monkeypatch):
    """Where train.run.seeds_on_device says so (on CUDA; forced here, interpreted), setup() gives the
    run a SeedTable, and its FP4 experts then take the routing's counts as a device tensor; where
    it does not, no table and host counts. (The two runs' bits: the CUDA test below.)"""
    pytest.importorskip("triton")
    import fp4lab.train.run as run_module
    monkeypatch.setenv("FP4LAB_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moe = dict(model="moe-tiny", recipe_overrides={"keep_first": 0, "keep_last": 0})
    for forced in (False, True):
        monkeypatch.setattr(run_module, "seeds_on_device", lambda model, device, *, compiled: forced)
        run = run_module.setup(_config(token_file, tmp_path / str(forced), **moe))
        experts = run.model.moe_layers()[0].experts
        assert (run.context.seeds is not None) is forced
        assert experts._fp4_counts_kept(run.device, torch.bfloat16) is forced


@cuda
def test_an_eager_run_with_device_seeds_is_the_host_counts_run_bit_for_bit(token_file, tmp_path, monkeypatch):
    """An eager CUDA run whose FP4 experts keep the routing's counts on the device (the trainer's
    SeedTable: train.run.seeds_on_device) is the run whose experts read them on the host
    (FP4LAB_DEVICE_COUNTS=0: no table) bit for bit, with gradient accumulation: every train loss
    and evaluation."""
    from fp4lab.train.loop import train
    from fp4lab.train.run import setup
    moe = dict(model="moe-tiny", grad_accum=2, recipe_overrides={"keep_first": 0, "keep_last": 0})
    run = setup(_config(token_file, tmp_path / "setup", **moe))
    assert run.context.seeds is not None and run.model.moe_layers()[0].experts._fp4_counts_kept(
        run.device, torch.bfloat16)  # (else both arms would read host counts)
    del run
    monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "0")
    plain = train(_config(token_file, tmp_path / "plain", **moe))
    monkeypatch.delenv("FP4LAB_DEVICE_COUNTS")
    tabled = train(_config(token_file, tmp_path / "tabled", **moe))
    assert tabled.status == plain.status == "ok"
    assert tabled.train_curve == plain.train_curve
    assert [e.val_loss for e in tabled.evals] == [e.val_loss for e in plain.evals]
