"""fp4lab.generate: load a trained run, generate text, post-training quantize to FP4, report the cost.

Two tiny runs share one module fixture: a BF16 run (40 steps) and an NVFP4-trained run with
embedding / logit gains (6 steps), both on a small BPE dataset built from generated text.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fp4lab.generate import (add_parser, generate, load_run, post_training_quantize, ptq_report,
                             sample_tokens)
from fp4lab.nn import GPT, ModelConfig, fp4_modules, model_config, quantize_model
from fp4lab.nn.recipe import Recipe
from fp4lab.train.corpus import build_dataset, text_files
from fp4lab.train.loop import TrainConfig, train

EVAL_BATCHES = 4
GAINS = {"embed_gain": 4.0, "logits_gain": 0.5}


def _english(rng: random.Random) -> str:
    who = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird"]
    did = ["sat on", "looked at", "ran to", "jumped over", "talked to", "waited for"]
    what = ["the mat", "the door", "a red ball", "the river", "the green hill", "a tall tree"]
    lines = [f"{rng.choice(who).capitalize()} {rng.choice(did)} {rng.choice(what)}." for _ in range(1500)]
    return "\n".join(lines) + "\n"


def _python(rng: random.Random) -> str:
    out = []
    for _ in range(700):
        name, k = rng.choice(["add", "scale", "shift", "mix"]), rng.randint(1, 9)
        op = {"add": "+", "scale": "*", "shift": "-", "mix": "^"}[name]
        out.append(f"def {name}_{k}(x):\n    return x {op} {k}\n\n")
    return "".join(out)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these models are tiny, and on a shared 2-core machine two threads
    contend with other jobs (measured: 4 FP4 training steps 4 s on one thread, 61 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(_one_thread, tmp_path_factory):
    """{"data", "bf16", "fp4"}: the dataset directory and two trained run directories."""
    root = tmp_path_factory.mktemp("generate")
    text = root / "text"
    text.mkdir()
    rng = random.Random(0)
    for i in range(2):
        (text / f"english_{i}.txt").write_text(_english(rng))
        (text / f"code_{i}.py").write_text(_python(rng))
    data = build_dataset(text_files(text), root / "data", vocab_size=300)
    base = dict(model="tiny", data=str(data), batch_size=8, seq_len=64, lr=3e-3, warmup=5, eval_every=1000,
                eval_batches=EVAL_BATCHES, log_every=1000, progress=False)
    train(TrainConfig(out=str(root / "bf16"), steps=40, **base))
    train(TrainConfig(out=str(root / "fp4"), steps=6, recipe="nvfp4",
                      recipe_overrides={"keep_first": 0, "keep_last": 0, **GAINS}, **base))
    return {"data": data, "bf16": root / "bf16", "fp4": root / "fp4"}


def _by_hand(run_dir) -> GPT:
    """The trained model rebuilt from the checkpoint without fp4lab.generate."""
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    model = GPT(ModelConfig.from_dict(state["identity"]["model"]))
    model.load_state_dict(load_file(str(run_dir / "checkpoint" / "model.safetensors")))
    return model.eval()


def _x(model: GPT) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=torch.Generator().manual_seed(1))


def test_load_run_reproduces_the_trained_bf16_model(runs):
    model, tok, receipt = load_run(runs["bf16"])
    ref = _by_hand(runs["bf16"])
    assert not model.training and (model.embed_gain, model.logits_gain) == (1.0, 1.0)
    assert torch.equal(model(_x(model)), ref(_x(model)))
    assert tok.get_vocab_size() == model.cfg.vocab_size == 300 and tok.token_to_id("<|endoftext|>") is not None
    assert receipt.recipe["name"] == "bf16"
    # the checkpoint directory works too, and the run's own eval is reproduced to the bit
    again, _, _ = load_run(runs["bf16"] / "checkpoint")
    assert torch.equal(again(_x(model)), ref(_x(model)))
    report = ptq_report(model, model, runs["bf16"], batches=None)  # the final eval: the whole split
    assert report["val_loss_bf16"] == receipt.final.val_loss
    assert report["top1_agreement"] == 1.0 and report["val_loss_increase"] == 0.0


def test_load_run_applies_the_gains_of_an_fp4_run(runs):
    model, _, receipt = load_run(runs["fp4"])
    assert (model.embed_gain, model.logits_gain) == (GAINS["embed_gain"], GAINS["logits_gain"])
    assert not fp4_modules(model)  # the high-precision model: master weights and gains
    # putting the training recipe back on it gives the very function the run evaluated
    trained = _by_hand(runs["fp4"])
    quantize_model(trained, Recipe.from_dict(receipt.recipe))
    assert (trained.embed_gain, trained.logits_gain) == (model.embed_gain, model.logits_gain)
    report = ptq_report(model, trained, runs["fp4"], batches=None)  # the final eval: the whole split
    assert report["val_loss_fp4"] == receipt.final.val_loss
    # without its gains the same weights are another function
    bare = _by_hand(runs["fp4"])
    assert not torch.allclose(bare(_x(bare)), model(_x(bare)), atol=1e-2)


def test_generation_is_deterministic_and_bounded(runs):
    model, tok, _ = load_run(runs["bf16"])
    greedy = generate(model, tok, "The cat", max_new_tokens=20)
    assert greedy == generate(model, tok, "The cat", max_new_tokens=20) and greedy
    ids = tok.encode("def add_3(x):").ids
    for n in (0, 1, 7):
        assert len(sample_tokens(model, ids, max_new_tokens=n)) == n  # no stop token given: exactly n
    sampled = [generate(model, tok, "The", max_new_tokens=24, temperature=1.0, top_k=20, seed=s) for s in (0, 0, 1, 2)]
    assert sampled[0] == sampled[1]
    assert len(set(sampled)) > 1  # three seeds give at least two different texts
    # a prompt longer than seq_len is cropped to the model's context
    long_ids = (ids * 40)[: 2 * model.cfg.seq_len]
    assert len(sample_tokens(model, long_ids, max_new_tokens=3)) == 3
    assert generate(model, tok, "", max_new_tokens=5) == generate(model, tok, "", max_new_tokens=5)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ptq_changes_the_model_a_little_and_leaves_the_original(runs, fmt):
    model, _, _ = load_run(runs["bf16"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _x(model)
    ref = model(x).detach()
    qmodel = post_training_quantize(model, fmt)
    assert not fp4_modules(model) and torch.equal(model(x), ref)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    quantized = fp4_modules(qmodel)
    assert "lm_head" not in quantized and len(quantized) == 2 * 5  # qkv, proj, gate, up, down per block
    recipe = qmodel.fp4_recipe
    assert recipe.fprop.a.format == recipe.fprop.b.format == fmt
    assert not recipe.dgrad.quantized and not recipe.wgrad.quantized
    out = qmodel(x).detach()
    rel = float((out - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.2, rel
    report = ptq_report(model, qmodel, runs["bf16"], batches=EVAL_BATCHES)
    # measured (this tiny model, 40 steps, 4 x 8 x 64 = 2048 validation tokens, val loss 0.7895):
    # nvfp4 agreement 0.972, val loss +0.0049 (+0.63%); mxfp4 agreement 0.957, +0.0165 (+2.08%)
    assert report["top1_agreement"] > 0.9, report
    assert 0.0 < report["val_loss_increase"] < 0.05 and report["val_loss_increase_pct"] < 5, report
    assert set(report) == {"recipe", "batches", "tokens", "val_loss_bf16", "val_loss_fp4", "val_loss_increase",
                           "val_loss_increase_pct", "top1_agreement", "top1_acc_bf16", "top1_acc_fp4"}
    assert report["tokens"] == EVAL_BATCHES * 8 * 64 and report["recipe"] == f"ptq_{fmt}"


def test_ptq_keeps_the_gains_for_either_format(runs):
    model, _, _ = load_run(runs["fp4"])
    for fmt in ("nvfp4", "mxfp4"):
        qmodel = post_training_quantize(model, fmt)
        assert (qmodel.embed_gain, qmodel.logits_gain) == (model.embed_gain, model.logits_gain)
    with pytest.raises(ValueError, match="one of"):
        post_training_quantize(model, "int4")


def test_ptq_reaches_moe_experts_and_keeps_the_router():
    torch.manual_seed(0)
    model = GPT(model_config("moe-tiny", vocab_size=64, seq_len=32)).eval()
    qmodel = post_training_quantize(model, "nvfp4")
    names = set(fp4_modules(qmodel))
    assert "blocks.1.ffn.experts" in names and "blocks.1.ffn.shared.up" in names
    assert not any("router" in n for n in names) and not fp4_modules(model)
    x = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        ref, out = model(x), qmodel(x)
    assert not torch.equal(ref, out) and float((out - ref).norm() / ref.norm()) < 0.2


def test_cli_prints_both_generations_and_the_report(runs, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", str(runs["bf16"]), "--prompt", "The dog", "--quantize", "nvfp4",
                              "--max-new-tokens", "12", "--batches", "2", "--compare"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "--- bf16 ---\nThe dog" in out and "--- nvfp4 ---\nThe dog" in out
    assert "top-1 agreement" in out and "increase" in out and "agree on their first" in out
    args = parser.parse_args(["generate", str(runs["bf16"]), "--prompt", "def "])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "--- bf16 ---" in out and "nvfp4" not in out


def test_missing_checkpoint_receipt_or_tokenizer_is_a_clear_error(runs, tmp_path):
    with pytest.raises(FileNotFoundError, match="no run directory"):
        load_run(tmp_path / "nowhere")
    run = tmp_path / "run"
    shutil.copytree(runs["bf16"], run)
    shutil.rmtree(run / "checkpoint")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_run(run)
    shutil.copytree(runs["bf16"], run, dirs_exist_ok=True)
    receipt = json.loads((run / "receipt.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    receipt["data"]["path"] = str(bare)
    (run / "receipt.json").write_text(json.dumps(receipt))
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_run(run)
    model, tok, _ = load_run(run, tokenizer=runs["data"] / "tokenizer.json")
    assert tok.get_vocab_size() == model.cfg.vocab_size
    (run / "receipt.json").unlink()
    with pytest.raises(FileNotFoundError, match="receipt.json"):
        load_run(run)
