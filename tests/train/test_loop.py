"""The trainer: receipts, exact resume, loud checkpoints, divergence, reports, the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from fp4lab.cli import main
from fp4lab.train.checkpoint import CheckpointError
from fp4lab.train.loop import RunState, TrainConfig, train
from fp4lab.train.receipt import Receipt
from fp4lab.train.report import gap_table, load_receipts, report

from .distributed import torchrun


def _cfg(token_file, out, **kw) -> TrainConfig:
    base = dict(out=str(out), model="tiny", data=str(token_file), steps=12, batch_size=8, seq_len=32,
                lr=3e-3, warmup=2, eval_every=6, eval_batches=2, log_every=3, progress=False)
    return TrainConfig(**{**base, **kw})


RECEIPT_KEYS = {"schema", "name", "status", "message", "config", "recipe", "recipe_text", "model", "params",
                "active_params", "data", "seed", "world", "git", "device", "versions", "evals", "train_curve",
                "final", "wall_s", "tokens_per_s", "mfu", "flip_rate", "coverage", "backend"}


def test_receipt_is_complete_and_loss_falls(token_file, tmp_path):
    receipt = train(_cfg(token_file, tmp_path / "run", steps=30, eval_every=10, recipe="nvfp4_plain",
                         stiction_every=10))
    on_disk = json.loads((tmp_path / "run" / "receipt.json").read_text())
    assert set(on_disk) == RECEIPT_KEYS and on_disk == receipt.to_dict() and on_disk["schema"] == 5
    assert Receipt.load(tmp_path / "run") == receipt  # what is read back is what was written
    assert receipt.status == "ok" and receipt.final.steps == 30
    assert [e.step for e in receipt.evals] == [10, 20, 30]
    assert receipt.evals[-1].val_loss < receipt.evals[0].val_loss - 0.3
    assert receipt.recipe["name"] == "nvfp4_plain" and "fprop" in receipt.recipe_text
    assert receipt.data.tokens == 40_000 and receipt.versions["torch"]
    split = receipt.data.split  # no end-of-text id in these tokens: held-out chunks
    assert split["train_tokens"] + split["val_tokens"] == 40_000 and split["val_docs"] >= 1
    assert receipt.data.epochs == pytest.approx(30 * 8 * 32 / split["train_tokens"], rel=0.05)
    assert receipt.coverage["linears"]["fp4"] > 0 and receipt.coverage["fp4_param_fraction"] > 0.5
    assert set(on_disk["git"]) == {"sha", "dirty", "diff_sha256"}
    assert receipt.backend == "reference"  # CPU tensors: the FP4 GEMMs ran fp4lab.formats' reference
    assert [s for s, _ in receipt.flip_rate] == [10, 20, 30]
    assert all(0 < rate < 1 for _, rate in receipt.flip_rate)  # codes move, not all of them
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "val_loss" in l] == [10, 20, 30]
    assert {"all", "blocks.0.attn.qkv"} <= set(next(l["flip_rate"] for l in lines if "flip_rate" in l))
    assert all({"train_loss", "lr_mult", "grad_norm", "tokens_per_s"} <= set(l) for l in lines if "train_loss" in l)
    # the final weights once more with a BF16 forward: another number, near the FP4 forward's
    served = receipt.final.bf16_forward_val_loss
    assert served is not None and served != receipt.final.val_loss and abs(served - receipt.final.val_loss) < 0.2
    assert [l["val_loss_bf16_forward"] for l in lines if "val_loss_bf16_forward" in l] == [served]


@pytest.mark.parametrize("weights", [{}, {"fprop.b.dither": 1.0, "dgrad.b.dither": 1.0},
                                     {"fprop.b.rounding": "stochastic", "dgrad.b.rounding": "stochastic"}],
                         ids=["rtne", "dither", "sr"])
def test_measuring_stiction_changes_no_step(token_file, tmp_path, weights):
    """The stiction study compares flips and losses of one run: reading the weights' codes around
    the optimizer step must leave the run as it is without the meter, bit for bit (random weight
    rounding too: the meter may not draw from or advance its stream)."""
    runs = [train(_cfg(token_file, tmp_path / f"every{every}", steps=8, eval_every=4, recipe="nvfp4_plain",
                       recipe_overrides=weights, stiction_every=every)) for every in (0, 2)]
    assert [s for s, _ in runs[1].flip_rate] == [2, 4, 6, 8] and not runs[0].flip_rate
    assert runs[0].train_curve == runs[1].train_curve and runs[0].evals == runs[1].evals


def test_a_late_switch_is_scored_again_through_the_fp4_forward_it_left(token_file, tmp_path):
    """A run whose forward switched to BF16 late is evaluated once more with the FP4 forward it
    trained with: bit for bit what its final weights give under the recipe without the switch.
    A run without a switch records none."""
    from fp4lab.train.parallel import load_model_state
    from fp4lab.train.loop import _evaluate
    from fp4lab.train.run import setup
    nv = {"keep_first": 0, "keep_last": 0}
    switched = train(_cfg(token_file, tmp_path / "switch", recipe="nvfp4", steps=8, eval_every=4,
                          recipe_overrides={**nv, "bf16_after": 0.75, "bf16_scope": "forward"}))
    served = switched.final.fp4_forward_val_loss
    assert served is not None and served != switched.final.val_loss
    assert switched.final.bf16_forward_val_loss is None  # its last forward is BF16 already
    lines = [json.loads(l) for l in (tmp_path / "switch" / "metrics.jsonl").read_text().splitlines()]
    assert [l["val_loss_fp4_forward"] for l in lines if "val_loss_fp4_forward" in l] == [served]
    run = setup(_cfg(token_file, tmp_path / "unswitched", recipe="nvfp4", steps=8, recipe_overrides=nv))
    load_model_state(run.model, load_file(str(tmp_path / "switch" / "checkpoint" / "model.safetensors")))
    run.context.progress = 7 / 8  # where the final evaluation runs
    assert _evaluate(run, full=True) == served
    assert run.context.progress == 7 / 8 and not run.context.forward_bf16
    plain = train(_cfg(token_file, tmp_path / "plain", recipe="nvfp4", steps=8, eval_every=4, recipe_overrides=nv))
    assert plain.final.fp4_forward_val_loss is None and plain.final.bf16_forward_val_loss is not None


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_resume_continues_bit_identically(token_file, tmp_path, recipe):
    # nvfp4: stochastic rounding on gradients, seeded by the step: a resumed run must replay its bits
    overrides = {"keep_first": 0, "keep_last": 0} if recipe == "nvfp4" else {}
    whole = train(_cfg(token_file, tmp_path / "whole", recipe=recipe, recipe_overrides=overrides))
    first = train(_cfg(token_file, tmp_path / "split", recipe=recipe, recipe_overrides=overrides, stop_at=5))
    assert first.status == "stopped" and first.final.steps == 5
    saved = RunState.from_checkpoint(json.loads((tmp_path / "split" / "checkpoint" / "state.json").read_text()))
    assert (saved.step, saved.evals, saved.last_ckpt) == (5, list(first.evals), 5)  # what the checkpoint holds
    assert saved.train_curve == [list(point) for point in first.train_curve]
    with open(tmp_path / "split" / "metrics.jsonl", "a") as f:  # what a crash after the checkpoint leaves
        f.write(json.dumps({"step": 6, "train_loss": 99.0}) + "\n")
    rest = train(_cfg(token_file, tmp_path / "split", recipe=recipe, recipe_overrides=overrides), resume=True)
    assert rest.status == "ok"
    assert rest.train_curve == whole.train_curve  # every loss, to the last bit
    assert rest.evals == whole.evals
    def logged(run):  # the metrics but their timings: the interrupted line is gone, nothing repeats
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "mfu")} for line in lines]
    assert logged("split") == logged("whole")
    a = load_file(str(tmp_path / "whole" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert rest.final.bf16_forward_val_loss == whole.final.bf16_forward_val_loss
    assert (whole.final.bf16_forward_val_loss is None) == (recipe == "bf16")
    again = train(_cfg(token_file, tmp_path / "split", recipe=recipe, recipe_overrides=overrides), resume=True)
    assert again.final == rest.final  # resuming a finished run keeps its BF16-forward evaluation


def test_corrupt_or_foreign_checkpoints_are_refused(token_file, tmp_path):
    cfg = _cfg(token_file, tmp_path / "run", steps=4, eval_every=4)
    train(cfg)
    ckpt = tmp_path / "run" / "checkpoint"
    with pytest.raises(CheckpointError, match="recipe"):
        train(_cfg(token_file, tmp_path / "run", steps=8, recipe="mxfp4"), resume=True)
    with pytest.raises(CheckpointError, match="model"):
        train(_cfg(token_file, tmp_path / "run", steps=8, model_overrides={"depth": 3}), resume=True)
    saved = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(saved[:-7] + bytes(7))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        train(_cfg(token_file, tmp_path / "run", steps=8), resume=True)
    (ckpt / "model.safetensors").write_bytes(saved)
    (ckpt / "optim.pt").unlink()
    with pytest.raises(CheckpointError, match="optim.pt is missing"):
        train(_cfg(token_file, tmp_path / "run", steps=8), resume=True)
    (ckpt / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt JSON"):
        train(_cfg(token_file, tmp_path / "run", steps=8), resume=True)


def test_an_interrupted_save_leaves_the_previous_checkpoint(token_file, tmp_path, monkeypatch):
    from fp4lab.train import checkpoint as ckpt_mod
    train(_cfg(token_file, tmp_path / "run", steps=8, eval_every=4, stop_at=4))
    before = (tmp_path / "run" / "checkpoint" / "state.json").read_text()

    def boom(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(ckpt_mod, "_fsync_dir", boom)
    with pytest.raises(OSError, match="disk full"):
        train(_cfg(token_file, tmp_path / "run", steps=8, eval_every=4), resume=True)
    assert (tmp_path / "run" / "checkpoint" / "state.json").read_text() == before


def test_a_save_cut_between_its_renames_is_recovered_on_resume(token_file, tmp_path, monkeypatch):
    """The crash window of an atomic save: the previous checkpoint moved aside, the new one not yet
    in place. --resume puts the previous one back and continues exactly as an uninterrupted run."""
    from pathlib import Path

    full = train(_cfg(token_file, tmp_path / "full", steps=8, eval_every=4, ckpt_every=4))
    train(_cfg(token_file, tmp_path / "run", steps=8, eval_every=4, ckpt_every=4, stop_at=4))
    real_rename = Path.rename

    def crash_after_moving_aside(self, target):
        result = real_rename(self, target)
        if ".old-" in Path(target).name:
            raise KeyboardInterrupt("killed between the renames")
        return result
    monkeypatch.setattr(Path, "rename", crash_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(token_file, tmp_path / "run", steps=8, eval_every=4, ckpt_every=4), resume=True)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "checkpoint").exists()  # the window the test is about
    from fp4lab.train import loop as loop_mod
    loaded = []
    real_load = loop_mod.load_checkpoint
    monkeypatch.setattr(loop_mod, "load_checkpoint", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    resumed = train(_cfg(token_file, tmp_path / "run", steps=8, eval_every=4, ckpt_every=4), resume=True)
    assert [state["step"] for state in loaded] == [4]  # continued from the restored checkpoint
    assert resumed.final == full.final and resumed.evals == full.evals
    assert not list((tmp_path / "run").glob(".checkpoint.old-*"))


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(token_file, tmp_path):
    receipt = train(_cfg(token_file, tmp_path / "run", steps=40, lr=30.0, clip=0.0, warmup=1, ckpt_every=1,
                         diverge_loss=8.0))
    assert receipt.status == "diverged" and "diverged at step" in receipt.message
    bad = receipt.final.steps
    assert bad < 40
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == bad  # the step before the bad one, intact and loadable
    assert f"checkpoint (step {bad}) is kept" in receipt.message


def test_report_is_rebuilt_from_receipts_alone(token_file, tmp_path):
    for recipe in ("bf16", "mxfp4"):
        train(_cfg(token_file, tmp_path / recipe, steps=6, recipe=recipe))
    for recipe in ("bf16", "mxfp4"):  # nothing but the receipts remains
        for item in (tmp_path / recipe).iterdir():
            if item.name != "receipt.json":
                shutil.rmtree(item) if item.is_dir() else item.unlink()
    table, files = report([tmp_path / "bf16", tmp_path / "mxfp4"], tmp_path / "report")
    assert {f.name for f in files} == {"report.md", "loss.png", "gap.png"}
    receipts = load_receipts([tmp_path / "bf16", tmp_path / "mxfp4"])
    gap = receipts[1].final.val_loss - receipts[0].final.val_loss
    row = next(line for line in table.splitlines() if line.startswith("| mxfp4 | mxfp4 | 0 |"))
    assert f"{gap:+.4f} vs bf16" in row  # the same seed's BF16 run
    assert gap_table(receipts) in table and (tmp_path / "report" / "report.md").read_text() == table
    with pytest.raises(FileNotFoundError, match="receipt"):
        load_receipts([tmp_path / "missing"])


def test_cli_train_resume_and_report(token_file, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["train", "--data", str(token_file), "--out", str(out), "--steps", "4", "--set", "batch_size=8",
            "--set", "seq_len=32", "--set", "eval_every=2", "--set", "progress=false", "--recipe", "mxfp4"]
    assert main(args + ["--set", "stop_at=2"]) == 0
    assert main(args + ["--resume"]) == 0
    assert Receipt.load(out).final.steps == 4
    assert main(["report", str(out)]) == 0
    assert "| cli | mxfp4 |" in capsys.readouterr().out
    assert (out / "report.md").is_file() and not (tmp_path / "report.md").exists()  # into the run's folder
    assert main(["train", "--data", str(token_file), "--set", "nonsense=1"]) == 2
    assert "unknown training setting 'nonsense'" in capsys.readouterr().err
    assert main(args + ["--recipe", "bf16", "--resume"]) == 2
    assert "belongs to another run" in capsys.readouterr().err


@pytest.mark.parametrize("model, recipe, tol", [("tiny", "bf16", 1e-4), ("tiny", "nvfp4_plain", 1e-2),
                                                ("moe-tiny", "bf16", 1e-4)])
def test_two_ranks_match_one_with_the_same_global_batch(token_file, tmp_path, model, recipe, tol):
    """torchrun, 2 CPU ranks (gloo): each reads half of every global batch and DDP averages the
    gradients, so BF16 matches 1 rank up to float summation order. FP4 is close, not equal: each
    rank takes its tensor scales (amax) over its own half of the batch, as TE does per rank."""
    args = ["train", "--data", str(token_file), "--steps", "6", "--model", model, "--recipe", recipe,
            "--set", "batch_size=8",
            "--set", "seq_len=32", "--set", "eval_every=3", "--set", "progress=false"]
    for n in (1, 2):  # (a free port each: fixed ones collided between parallel test processes)
        torchrun(n, "-m", "fp4lab", *args, "--out", str(tmp_path / f"r{n}"))
    one, two = (Receipt.load(tmp_path / f"r{n}") for n in (1, 2))
    assert two.world == 2 and one.world == 1 and two.config == one.config | {"out": two.config["out"]}
    for (s1, l1), (s2, l2) in zip(one.train_curve, two.train_curve, strict=True):
        assert s1 == s2 and abs(l1 - l2) < tol * l1
    assert abs(one.final.val_loss - two.final.val_loss) < tol * one.final.val_loss


def test_cli_train_reads_a_toml_config(token_file, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'data = "{token_file}"\nsteps = 3\nbatch_size = 8\nseq_len = 32\neval_every = 3\n'
                      'progress = false\nrecipe = "nvfp4"\n[recipe_overrides]\nkeep_first = 0\n[model_overrides]\ndepth = 1\n')
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 0
    receipt = Receipt.load(tmp_path / "run")
    assert receipt.recipe["keep_first"] == 0 and receipt.model["depth"] == 1 and receipt.final.steps == 3


def test_a_second_writer_of_a_run_folder_is_refused_and_threads_are_restored(token_file, tmp_path):
    import torch

    from fp4lab.train.lock import RunLock, RunLockedError
    before = torch.get_num_threads()
    with RunLock(tmp_path / "run"):  # another writer holds the folder
        with pytest.raises(RunLockedError, match="is being written by pid"):
            train(_cfg(token_file, tmp_path / "run", steps=2))
    assert not (tmp_path / "run" / "receipt.json").exists()
    receipt = train(_cfg(token_file, tmp_path / "run", steps=2, threads=1))
    assert receipt.status == "ok" and receipt.config["threads"] == 1
    assert torch.get_num_threads() == before  # the run's CPU thread count does not leak out


@pytest.mark.parametrize("model", ["tiny", "moe-tiny"])
def test_deterministic_runs_give_the_default_bits_on_a_cpu_and_the_setting_does_not_leak(token_file, tmp_path,
                                                                                          model):
    """On a CPU every run is reproducible already: deterministic=true must change no bit (its
    ops all have deterministic kernels, MoE routing included), and torch's global switch is
    back where it was once the run ends."""
    import torch
    plain = train(_cfg(token_file, tmp_path / "plain", model=model, recipe="nvfp4", steps=4, eval_every=2))
    strict = train(_cfg(token_file, tmp_path / "strict", model=model, recipe="nvfp4", steps=4, eval_every=2,
                        deterministic=True))
    assert strict.train_curve == plain.train_curve and strict.final.val_loss == plain.final.val_loss
    assert strict.config["deterministic"] is True and not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # a caller's own setting comes back as it was
    try:
        train(_cfg(token_file, tmp_path / "again", model=model, steps=1, eval_every=1, deterministic=True))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_run_folder_is_never_replaced_silently(token_file, tmp_path, capsys):
    run = tmp_path / "run"
    first = train(_cfg(token_file, run, steps=2))
    with pytest.raises(ValueError, match=r"already holds a run \(receipt.json, metrics.jsonl, checkpoint\); "
                                         r"--resume continues it, --overwrite replaces it"):
        train(_cfg(token_file, run, steps=2, seed=1))
    assert json.loads((run / "receipt.json").read_text())["seed"] == 0  # untouched
    shutil.rmtree(run / "checkpoint")
    with pytest.raises(ValueError, match="holds a run .* but no checkpoint to resume; --overwrite starts it over"):
        train(_cfg(token_file, run, steps=2), resume=True)
    second = train(_cfg(token_file, run, steps=2, seed=1), overwrite=True)
    assert second.seed == 1 and first.seed == 0
    capsys.readouterr()
    fresh = train(_cfg(token_file, tmp_path / "new", steps=2), resume=True)
    assert fresh.status == "ok" and "no checkpoint in" in capsys.readouterr().out


def test_text_data_is_tokenized_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "texts"  # a directory of text files: each file is a document of the split
    text.mkdir()
    for d in range(40):
        (text / f"doc{d}.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {d}\n\n" for i in range(100)))
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(text), vocab_size=300, steps=2, batch_size=4, seq_len=32,
                      eval_every=2, eval_batches=1, progress=False, val_fraction=0.2)
    receipt = train(cfg)
    assert receipt.status == "ok" and receipt.data.vocab_size == 300 and receipt.data.tokens > 1000
    assert "datasets" in receipt.data.path  # the cache, not the .txt


def test_checkpoint_files_get_the_permissions_of_plain_files(token_file, tmp_path):
    import os
    umask = os.umask(0o022)
    try:
        train(_cfg(token_file, tmp_path / "run", steps=2))
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "run" / "checkpoint").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}


def test_a_compiled_run_compiles_its_own_graphs(token_file, tmp_path, monkeypatch):
    """Each compiled run starts from an empty dynamo cache: an earlier run's frames (other seeds,
    autocast's cast cache, its evaluations) would count toward dynamo's recompile limit, past
    which a frame runs eager (a graphed step's capture included) and a second run in the process
    would not train as a first one."""
    import torch
    resets, reset = [], torch.compiler.reset
    monkeypatch.setattr(torch.compiler, "reset", lambda: (resets.append(len(resets)), reset()))
    train(_cfg(token_file, tmp_path / "eager", steps=2, eval_every=2))
    assert not resets
    result = train(_cfg(token_file, tmp_path / "compiled", steps=2, eval_every=2, compile=True))
    assert result.status == "ok" and resets == [0]


def test_the_cpp_wrapper_setting_reaches_inductor_and_needs_compile(token_file, tmp_path, monkeypatch):
    import torch
    asked = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: (asked.append(kw), model)[1])
    assert train(_cfg(token_file, tmp_path / "run", steps=1, eval_every=1, compile=True,
                      cpp_wrapper=True)).status == "ok"
    assert asked == [{"options": {"cpp_wrapper": True}}]
    with pytest.raises(ValueError, match="cpp_wrapper=true .* needs compile=true"):
        _cfg(token_file, tmp_path / "other", cpp_wrapper=True)
    assert "cpp_wrapper" not in _cfg(token_file, tmp_path / "x", compile=True, cpp_wrapper=True).identity()
