"""fp4lab eval on a model of 100M+ parameters, timed: PTQ (weight-only and W4A4) of a Llama-style
model with random weights, then the emulated NVFP4 model against its BF16 reference.

    python benchmarks/bench_hub_eval.py [--layers 12 --hidden 768 --ffn 3072] [--device cuda]

Nothing can be downloaded on the GPU machine, so the model is built as the tests build theirs:
a transformers LlamaConfig with random weights (seed 0; 118.8M parameters at the defaults, of
which 106.2M in the quantized Linears), with a byte-level BPE tokenizer (vocab 8192) trained on the text
scored, which is this Python's standard library source (the same files on any machine with the
same Python). A random model's perplexity means nothing; what is measured is the time of each
stage, the emulated model's throughput against the reference's on the same device, and how far
the emulation lands from the reference (top-1 agreement, per-layer output error). Saves
benchmarks/results/hub_eval.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp4lab.hub import quantize_model_dir  # noqa: E402
from fp4lab.hub.evaluate import evaluate  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def stdlib_text(max_bytes: int) -> str:
    """The standard library's .py files in sorted order, up to max_bytes."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or size >= max_bytes:
            continue
        text = path.read_text(errors="replace")
        parts.append(text)
        size += len(text)
    return "\n".join(parts)[:max_bytes]


def build_model(root: Path, text: str, args) -> int:
    """A random-weight Llama with a BPE tokenizer trained on ``text`` in ``root``; -> parameters."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), tokenizers.trainers.BpeTrainer(
        vocab_size=args.vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(root)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=args.hidden // 128, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(root)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=16, help="windows scored")
    parser.add_argument("--text-mb", type=float, default=4.0, help="text to train the tokenizer on and score")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hub_eval.json")
    args = parser.parse_args()

    text = stdlib_text(int(args.text_mb * 1e6))
    result: dict = {"config": vars(args) | {"out": str(args.out)}, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "bf16"
        start = time.perf_counter()
        result["parameters"] = build_model(hf, text, args)
        result["build_s"] = time.perf_counter() - start
        for name, calibration in (("w4a16", None), ("w4a4", text[:200_000])):
            start = time.perf_counter()
            ckpt = quantize_model_dir(hf, Path(tmp) / name, calibration=calibration, seq_len=args.seq_len)
            quantize_s = time.perf_counter() - start
            start = time.perf_counter()
            report = evaluate(Path(tmp) / name, text, reference=hf, seq_len=args.seq_len, max_windows=args.windows,
                              device=args.device)
            report.update(quantize_s=quantize_s, eval_s=time.perf_counter() - start,
                          quantized_parameters=sum(q.codes.numel() * 2 for q in ckpt.weights.values()))
            report["layer_error_max"] = max(report.pop("layer_error").values())
            report.pop("checkpoint"), report.pop("reference")
            result[name] = report
            print(f"{name}: quantize {quantize_s:.1f} s, eval {report['eval_s']:.1f} s on {report['device']}: "
                  f"{report['emulated_tokens_per_s']:,.0f} tokens/s emulated vs "
                  f"{report['reference_tokens_per_s'] or 0:,.0f} reference "
                  f"({report['reference_tokens_per_s'] / report['emulated_tokens_per_s'] if report['reference_tokens_per_s'] else 0:.2f}x slower), "
                  f"nll {report['nll']:.4f} vs {report['reference_nll']:.4f}, top-1 agreement "
                  f"{100 * report['top1_agreement']:.1f}%, worst layer error {report['layer_error_max']:.4f}",
                  flush=True)
    print(f"{result['parameters'] / 1e6:.1f}M parameters")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
