"""Text from a trained fp4lab run, and what post-training quantization to FP4 costs it.

A run directory (train.loop) holds ``receipt.json`` and ``checkpoint/`` (model.safetensors,
state.json whose identity holds the ModelConfig and the training recipe). ``load_run`` rebuilds
the GPT from them, strictly, with the training recipe's gains applied
(``x = wte(idx) * embed_gain``, ``logits = lm_head(rms(x)) * logits_gain``, as
nn.swap.quantize_model sets them), and no FP4 layers: the high-precision ("BF16") model. For a
BF16 run that is the trained function exactly; for an FP4 run it is the master weights with
the gains, i.e. the trained function with its GEMMs un-quantized. The tokenizer is the
dataset's tokenizer.json (the receipt's data path).

Post-training quantization (PTQ), ``post_training_quantize``: a deep copy whose every linear
runs its forward GEMM in FP4, built with the recipe machinery (``recipe.fprop(fmt)``):

    y = x @ W^T   ->   y = dq(q(x)) @ dq(q(W))^T       both operands along K (features in)
    nvfp4: q = quantize_nvfp4, 1x16 blocks, E4M3 block scales, FP32 tensor scale, RTNE, te profile
    mxfp4: q = quantize_mxfp4, 1x32 blocks, UE8M0 scales (OCP floor rule), RTNE

dgrad and wgrad stay BF16 (inference runs fprop only). Every transformer block is quantized
(keep_first = keep_last = 0); ``lm_head`` and MoE routers stay BF16 (the recipe's default
``keep_bf16``); MoE experts follow through quantize_model (GroupedExperts.use_recipe). The
weights are quantized from the high-precision weights on each call (RTNE: deterministic), not
stored. The gains carry over into the copy's recipe.

``ptq_report`` compares the two models on the run's validation split (data.TokenStream rebuilt
with the run's seq_len, micro-batch, held-out fraction and end-of-text id: the documents
loop.train evaluated on; the first ``batches`` batches, or all of them):

    val loss      L = mean over tokens of cross-entropy(logits, targets)
                  (the loop's eval; MoE auxiliary losses are left out)
    increase      L_fp4 - L_bf16, and 100 * (L_fp4 - L_bf16) / L_bf16 %
    agreement     fraction of positions where argmax(logits_bf16) == argmax(logits_fp4)

Generation recomputes the full context every token (no KV cache), cropped to the model's last
``seq_len`` tokens; greedy at temperature 0, else softmax(logits / T) over the top-k, drawn
from a seeded torch.Generator. It stops early at <|endoftext|>. On CUDA the forward passes run
under bf16 autocast (as the training loop); on CPU in fp32.

Public: ``load_run``, ``post_training_quantize``, ``sample_tokens``, ``generate``,
``ptq_report``, ``format_report``, ``add_parser``, ``cli_generate``.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .formats import Format
from .nn import GPT, ModelConfig, Recipe, quantize_model
from .nn.recipe import fprop
from .train.corpus import EOT
from .train.data import TokenStream, load_tokens
from .train.receipt import Receipt

PTQ_FORMATS = ("nvfp4", "mxfp4")


def _run_paths(path: str | Path) -> tuple[Path, Path]:
    """A run directory or its checkpoint directory -> (run_dir, checkpoint_dir)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run directory {str(path)!r}")
    if (path / "checkpoint" / "state.json").is_file():
        return path, path / "checkpoint"
    if (path / "state.json").is_file():
        return path.parent, path
    raise FileNotFoundError(f"{path}: no checkpoint (expected {path / 'checkpoint' / 'state.json'}); "
                            "train the run to its end, or pass the run or checkpoint directory")


def _receipt(run_dir: Path) -> Receipt:
    path = run_dir / "receipt.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no receipt.json (its data entry names the dataset and tokenizer)")
    return Receipt.load(path)


def _data_dir(receipt: Receipt, run_dir: Path) -> Path:
    path = Path(receipt.data.path)
    if not str(path) or not path.exists():
        raise FileNotFoundError(f"dataset {str(path)!r} named by {run_dir / 'receipt.json'} does not exist")
    return path if path.is_dir() else path.parent


def load_run(run_dir: str | Path, *, tokenizer: str | Path | None = None, device: str | torch.device = "cpu"):
    """Rebuild a run's model -> (model: GPT in eval mode, tokenizer: tokenizers.Tokenizer, receipt:
    train.receipt.Receipt).

    ``run_dir``: the run directory or its checkpoint directory. ``tokenizer``: a tokenizer.json
    to use instead of the dataset's. Raises FileNotFoundError (no checkpoint, receipt or
    tokenizer), ValueError (a tokenizer larger than the model's vocabulary) and
    train.checkpoint.CheckpointError (files that fail their sha256)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from .train.checkpoint import read_state

    run, ckpt = _run_paths(run_dir)
    receipt = _receipt(run)
    identity = read_state(ckpt)["identity"]
    cfg = ModelConfig.from_dict(identity["model"])
    recipe = Recipe.from_dict(identity["recipe"])
    tok_path = Path(tokenizer) if tokenizer is not None else _data_dir(receipt, run) / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"no tokenizer {str(tok_path)!r}: the run trained on bare token shards, or the "
                                "dataset moved; pass a tokenizer.json (--tokenizer)")
    tok = Tokenizer.from_file(str(tok_path))
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tok.get_vocab_size()} tokens, the model only "
                         f"{cfg.vocab_size}: not this run's tokenizer")
    model = GPT(cfg)
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=True)
    model.embed_gain, model.logits_gain = recipe.embed_gain, recipe.logits_gain
    return model.to(device).eval(), tok, receipt


def post_training_quantize(model: nn.Module, fmt: str = "nvfp4") -> nn.Module:
    """A copy of ``model`` whose forward GEMMs run in ``fmt`` (nvfp4 or mxfp4; see the module
    doc); ``model`` itself is untouched. The copy's recipe is at ``copy.fp4_recipe``."""
    if fmt not in PTQ_FORMATS:
        raise ValueError(f"post-training quantization format must be one of {PTQ_FORMATS}, got {fmt!r}")
    precision = Format.parse(fmt)
    gains = (getattr(model, "embed_gain", 1.0), getattr(model, "logits_gain", 1.0))
    recipe = fprop(precision).override({"name": f"ptq_{fmt}", "embed_gain": gains[0], "logits_gain": gains[1]})
    qmodel = copy.deepcopy(model)
    quantize_model(qmodel, recipe)  # sets the copy's gains from the recipe
    return qmodel.eval()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def sample_tokens(model: GPT, ids: list[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_k: int | None = None, seed: int = 0, stop: int | None = None) -> list[int]:
    """ids: prompt token ids (at least one) -> up to ``max_new_tokens`` new ids (without ``stop``,
    where generation ended). Greedy at temperature 0, else seeded top-k sampling."""
    if not ids:
        raise ValueError("sample_tokens needs at least one prompt token")
    if max_new_tokens < 0 or temperature < 0:
        raise ValueError(f"max_new_tokens and temperature must be >= 0, got {max_new_tokens}, {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    device = _device(model)
    gen = torch.Generator(device=device).manual_seed(seed)
    seq, new = list(ids), []
    for _ in range(max_new_tokens):
        idx = torch.tensor([seq[-model.cfg.seq_len:]], dtype=torch.long, device=device)  # [1, T]
        with _autocast(device):
            logits = model(idx)[0, -1].float()  # [V]
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        if token == stop:
            break
        seq.append(token)
        new.append(token)
    return new


def generate(model: GPT, tokenizer, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> str:
    """The continuation of ``prompt`` (decoded new tokens only; an empty prompt starts a new
    document at <|endoftext|>), stopping early at <|endoftext|>."""
    ids, eot = _prompt_ids(tokenizer, prompt)
    new = sample_tokens(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        seed=seed, stop=eot)
    return tokenizer.decode(new)


def _prompt_ids(tokenizer, prompt: str) -> tuple[list[int], int | None]:
    eot = tokenizer.token_to_id(EOT)
    ids = tokenizer.encode(prompt).ids or ([eot] if eot is not None else [])
    if not ids:
        raise ValueError(f"empty prompt and the tokenizer has no {EOT} token to start from")
    return ids, eot


def _stream(source: Any, model: GPT, batch_size: int | None) -> TokenStream:
    if isinstance(source, (str, Path)):
        run, _ = _run_paths(source)
        receipt = _receipt(run)
        cfg = receipt.config
        tokens = load_tokens(Path(receipt.data.path))
        micro = batch_size or cfg["batch_size"] // cfg["grad_accum"]
        return TokenStream(tokens, seq_len=cfg["seq_len"], batch_size=micro, seed=cfg["seed"],
                           val_fraction=cfg.get("val_fraction", 0.02), eot=receipt.data.eot_id)
    tokens = source.cpu().numpy() if isinstance(source, torch.Tensor) else np.asarray(source)
    return TokenStream(tokens, seq_len=model.cfg.seq_len, batch_size=batch_size or 8)


@torch.no_grad()
def ptq_report(model: GPT, qmodel: GPT, run_dir_or_tokens: Any, *, batches: int | None = 8,
               batch_size: int | None = None) -> dict[str, Any]:
    """Compare ``model`` and its quantized copy on validation windows (see the module doc).

    ``run_dir_or_tokens``: a run (or checkpoint) directory, whose validation split is used with
    the run's settings; or a 1D token array, split with the model's seq_len. -> {"recipe",
    "batches", "tokens", "val_loss_bf16", "val_loss_fp4", "val_loss_increase",
    "val_loss_increase_pct", "top1_agreement", "top1_acc_bf16", "top1_acc_fp4"} ("recipe": the
    name of qmodel's recipe, e.g. ptq_nvfp4; top1_acc: fraction of argmax == target)."""
    stream = _stream(run_dir_or_tokens, model, batch_size)
    device = _device(model)
    losses = torch.zeros(2, dtype=torch.float64)
    agree = correct_bf16 = correct_fp4 = n_tokens = n_batches = 0
    for x, y in stream.val_batches(batches):  # x, y: [B, T]
        x, y = x.to(device), y.to(device)
        with _autocast(device):
            logits = model(x).float(), qmodel(x).float()  # [B, T, V] each
        for i, lg in enumerate(logits):
            losses[i] += float(F.cross_entropy(lg.view(-1, lg.shape[-1]), y.reshape(-1))) * y.numel()
        top = [lg.argmax(-1) for lg in logits]  # [B, T]
        agree += int((top[0] == top[1]).sum())
        correct_bf16, correct_fp4 = correct_bf16 + int((top[0] == y).sum()), correct_fp4 + int((top[1] == y).sum())
        n_tokens, n_batches = n_tokens + y.numel(), n_batches + 1
    if not n_batches:
        raise ValueError(f"no validation batch of {stream.batch_size} x {stream.seq_len} tokens: "
                         f"{len(stream.val_windows)} validation windows")
    loss_bf16, loss_fp4 = (float(v) / n_tokens for v in losses)
    recipe = getattr(qmodel, "fp4_recipe", None)
    return {"recipe": recipe.name if recipe is not None else "unknown", "batches": n_batches, "tokens": n_tokens,
            "val_loss_bf16": loss_bf16, "val_loss_fp4": loss_fp4, "val_loss_increase": loss_fp4 - loss_bf16,
            "val_loss_increase_pct": 100 * (loss_fp4 - loss_bf16) / loss_bf16,
            "top1_agreement": agree / n_tokens, "top1_acc_bf16": correct_bf16 / n_tokens,
            "top1_acc_fp4": correct_fp4 / n_tokens}


def format_report(report: dict[str, Any]) -> str:
    """ptq_report's dict as a small text table."""
    r = report
    return "\n".join([
        f"{r['recipe']} vs bf16 on {r['batches']} validation batches ({r['tokens']} tokens)",
        f"  {'':<16}{'val loss':>10}{'top-1 acc':>11}",
        f"  {'bf16':<16}{r['val_loss_bf16']:>10.4f}{r['top1_acc_bf16']:>11.3f}",
        f"  {r['recipe']:<16}{r['val_loss_fp4']:>10.4f}{r['top1_acc_fp4']:>11.3f}",
        f"  {'increase':<16}{r['val_loss_increase']:>+10.4f}  ({r['val_loss_increase_pct']:+.2f}%)",
        f"  {'top-1 agreement':<16}{r['top1_agreement']:>10.3f}",
    ])


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))


def add_parser(subparsers, name: str = "generate", help: str | None = None) -> argparse.ArgumentParser:
    """Register ``generate`` on an argparse subparsers object -> its parser (handler: cli_generate)."""
    p = subparsers.add_parser(name, help=help)
    p.add_argument("run", type=Path, help="run directory (or its checkpoint directory)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--quantize", choices=["none", *PTQ_FORMATS], default="none",
                   help="also generate with a post-training-quantized copy and report val loss / agreement")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--compare", action="store_true", help="also say where the two generations first differ "
                   "(implies --quantize nvfp4 unless another format is given)")
    p.add_argument("--batches", type=int, default=8, help="validation batches for the report")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json, if not the dataset's")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.set_defaults(handler=cli_generate)
    return p


def cli_generate(args: argparse.Namespace) -> int:
    """``fp4lab generate``: print the BF16 model's continuation, and with --quantize the FP4
    copy's and the ptq_report table."""
    model, tok, receipt = load_run(args.run, tokenizer=args.tokenizer, device=args.device)
    fmt = "nvfp4" if args.compare and args.quantize == "none" else args.quantize
    final = receipt.final
    val = f"{final.val_loss:.4f}" if final.val_loss is not None else "n/a"
    print(f"{args.run}: {model.num_params():,} parameters, trained with recipe {receipt.recipe['name']} "
          f"for {final.steps} steps, val loss {val}")
    models = {"bf16": model}
    if fmt != "none":
        models[fmt] = post_training_quantize(model, fmt)
    ids, eot = _prompt_ids(tok, args.prompt)
    new = {}
    for name, m in models.items():
        new[name] = sample_tokens(m, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, seed=args.seed, stop=eot)
        print(f"--- {name} ---\n{args.prompt}{tok.decode(new[name])}")
    if fmt == "none":
        return 0
    if args.compare:
        a, b = new.values()
        print(f"--- the generations agree on their first {_first_difference(a, b)} tokens "
              f"(bf16 {len(a)}, {fmt} {len(b)} new tokens)")
    print(format_report(ptq_report(model, models[fmt], args.run, batches=args.batches)))
    return 0
