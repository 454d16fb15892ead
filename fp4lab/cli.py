"""``fp4lab`` command line: parses arguments, then calls the library. Nothing else lives here.

Every subcommand is registered one way: an ``add_parser(subparsers)`` function adds its parser
and sets its ``handler`` (parsed arguments -> exit code) as a default; ``main`` calls each and
then ``args.handler(args)``. This module's own subcommands (inspect, demo, train, report, study,
convert) have theirs below; generate's is ``generate.add_parser``, verify's is
``verify.cli.add_parser`` (its handler ``verify.cli.run``). The errors a user's input
causes (a bad setting, a missing or corrupt file, a checkpoint of another run, a second writer
of a run folder, an optional dependency not installed: ValueError, CheckpointError, RunLockedError,
MissingDependency) and those of the file system
(OSError: a missing file, no permission, a full disk) print as one line with exit code 2;
anything else is a bug, and its traceback surfaces.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from .train.errors import CheckpointError, MissingDependency, RunLockedError


def _block(text: str) -> int | tuple[int, int]:
    if text in ("16", "1x16"):
        return 16
    if text == "16x16":
        return (16, 16)
    raise argparse.ArgumentTypeError(f"block must be 16 or 16x16, got {text!r}")


def _add_encoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["nvfp4", "mxfp4", "both"], default="both",
                   help="FP4 format to measure (default: both)")
    p.add_argument("--profile", choices=["te", "torchao"], default="te", help="NVFP4 profile")
    p.add_argument("--mode", choices=["floor", "ceil", "even", "rceil"], default="floor",
                   help="MXFP4 scale mode")
    p.add_argument("--block", type=_block, default=16, help="NVFP4 block: 16 or 16x16 (2D tensors)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")


def _inspect_file(path: Path, args: argparse.Namespace) -> int:
    from .inspect import InspectConfig, format_table, inspect_tensors, load_tensors

    tensors = load_tensors(path)
    formats = ["nvfp4", "mxfp4"] if args.format == "both" else [args.format]
    rows = []
    for fmt in formats:
        config = InspectConfig(format=fmt, profile=args.profile, mode=args.mode, block=args.block)
        rows += inspect_tensors(tensors, config)
    if args.json:
        print(json.dumps({"file": str(path), "tensors": rows}, indent=1))
    else:
        print(f"{path}: {len(tensors)} tensors")
        print(format_table(rows))
    return 0


def _study(args: argparse.Namespace) -> int:
    from .studies import catalog, conversion

    if args.list or args.name is None:
        print(f"conversion  MXFP4 -> NVFP4 on {len(conversion.SCENARIOS)} scenarios; arms: "
              f"{', '.join(conversion.METHODS)}; CPU, about a minute")
        for study in catalog.STUDIES.values():
            print(f"{study.name:<20} {study.title}\n{'':<20} claim: {study.claim} ({study.source})")
            print(f"{'':<20} arms: {', '.join(a.name for a in study.arms)}")
            cost = "; ".join(f"{s.name} {len(study.arms) * len(s.seeds)} runs ~"
                             f"{len(study.arms) * len(s.seeds) * s.minutes_per_run[study.size]:.0f} min ({s.where})"
                             for s in catalog.SCALES.values())
            print(f"{'':<20} cost: {cost}")
        return 0
    out = args.out or Path("results") / args.name
    if args.name == "conversion":
        receipt = conversion.run(out, mx_mode=args.mx_mode)
        print(conversion.report(receipt))
        print(f"wrote {out / 'receipt.json'} and {out / 'table.md'}")
        return 0
    from .studies.study import run_study, write_report
    study = catalog.study(args.name)
    if not args.report_only:
        seeds = tuple(args.seeds) if args.seeds else None
        arms = tuple(args.arms) if args.arms else None
        try:
            run_study(study, catalog.scale(args.scale), out, seeds=seeds, arms=arms, jobs=args.jobs,
                      replace=args.replace, **_settings(args.set))
        except RuntimeError as err:  # some runs failed: report what finished, then fail
            print(err, file=sys.stderr)
            write_report(study, out)
            return 1
    text, files = write_report(study, out)
    print(text)
    print("wrote " + ", ".join(map(str, files)))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.demo is None:
        if args.file is None:
            raise ValueError("give a FILE to inspect, or --demo")
        if args.file.is_dir():
            return _inspect_checkpoint(args.file, args)
        return _inspect_file(args.file, args)
    from .inspect import write_demo_tensors
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_tensors(Path(tmp) / "demo.safetensors" if args.demo is True else args.demo)
        return _inspect_file(path, args)


def _inspect_checkpoint(root: Path, args: argparse.Namespace) -> int:
    """An FP4 model directory: its stored numbers per module, then the doctor's verdict (NVFP4)."""
    from .hub import MXFP4, read_checkpoint
    from .hub.inspect import checkpoint_rows, format_rows
    from .verify.checkpoint import check_checkpoint
    from .verify.cli import print_findings

    findings = None
    try:
        ckpt = read_checkpoint(root)
    except ValueError:  # refused: show the doctor's findings, which say why
        ckpt = None
    if ckpt is None or ckpt.layout != MXFP4:
        findings = check_checkpoint(root)
    rows = checkpoint_rows(ckpt) if ckpt is not None else []
    if args.json:
        print(json.dumps({"checkpoint": str(root), "layout": ckpt and ckpt.layout, "modules": rows,
                          "findings": [f.as_dict() for f in findings or []]}, indent=1))
    else:
        if ckpt is not None:
            print(f"{root}: {ckpt.layout}, {len(rows)} quantized modules, {len(ckpt.dense)} other tensors"
                  + (", W4A4" if ckpt.w4a4 else ""))
            print(format_rows(rows))
        if findings is not None:
            return print_findings(findings, f"checkpoint doctor, {root}")
    return 1 if findings and any(f.level == "error" for f in findings) else 0


def _quantize(args: argparse.Namespace) -> int:
    from .hub import quantize_model_dir
    from .verify.checkpoint import check_checkpoint
    from .verify.cli import print_findings

    calibration = None
    if args.calibration is not None:
        if not args.calibration.is_file():
            raise FileNotFoundError(f"no such calibration text: {args.calibration}")
        calibration = args.calibration.read_text(errors="replace")
    ckpt = quantize_model_dir(args.src, args.dst, layout=args.layout, exclude=tuple(args.exclude),
                              calibration=calibration)
    kind = "W4A4 NVFP4, activation scales calibrated" if ckpt.w4a4 else "weight-only NVFP4"
    print(f"{args.src} -> {args.dst} ({args.layout}, {kind}): {len(ckpt.weights)} modules quantized, "
          f"{len(ckpt.dense)} tensors kept")
    return print_findings(check_checkpoint(args.dst), f"checkpoint doctor, {args.dst}")


def _eval(args: argparse.Namespace) -> int:
    from .hub.evaluate import evaluate, format_report, plot_layer_error

    if not args.text.is_file():
        raise FileNotFoundError(f"no such text file: {args.text}")
    report = evaluate(args.checkpoint, args.text.read_text(errors="replace"), reference=args.reference,
                      seq_len=args.seq_len, max_windows=args.max_windows, device=args.device)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eval.json").write_text(json.dumps(report, indent=1))
        if "layer_error" in report:
            plot_layer_error(report, args.out / "layer_error.png")
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert.checkpoint import convert_checkpoint
    from .verify.checkpoint import check_checkpoint
    from .verify.cli import print_findings

    result = convert_checkpoint(args.src, args.dst, layout=args.layout, method=args.method)
    for base, r in result.report.items():
        cost = "lossless" if r["lossless"] else f"mse {r['mse']:.3g}"
        print(f"{base}: {r['method']}, spread {r['spread']}, m {r['m']}, {cost}")
    print(f"wrote {args.dst}: {', '.join(result.written)} ({len(result.report)} tensors converted)")
    if result.left_out:
        print(f"not carried over: {', '.join(result.left_out)}")
    # the doctor checks every output; --verify adds every value against the source
    return print_findings(check_checkpoint(args.dst, reference=args.src if args.verify else None),
                          f"verify checkpoint {args.dst}")


def _value(text: str):
    """--set values: JSON when it parses (numbers, true, lists), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set: expected key=value, got {pair!r}")
        out[key.strip()] = _value(value.strip())
    return out


def _train(args: argparse.Namespace) -> int:
    import tomllib

    from .nn.recipe import dotted_keys
    from .train.loop import TrainConfig, train
    from .train.report import gap_table

    cfg = TrainConfig()
    if args.config:  # the file first, then the flags and --set over it; an error names its source
        try:
            cfg = cfg.with_overrides(dotted_keys(tomllib.loads(args.config.read_text())))
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file {args.config}: not valid TOML: {err}") from None
        except ValueError as err:
            raise ValueError(f"config file {args.config}: {err}") from None
    flags = {key: getattr(args, key) for key in ("model", "recipe", "out", "data", "steps")
             if getattr(args, key) is not None}
    cfg = cfg.with_overrides(flags)
    settings = _settings(args.set)
    try:
        cfg = cfg.with_overrides(settings)
    except ValueError as err:
        raise ValueError(f"--set: {err}") from None
    receipt = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one rank reports
        print(gap_table([receipt]))
        print(f"wrote {cfg.out}/receipt.json")
    return 0 if receipt.status in ("ok", "stopped") else 1


def _report(args: argparse.Namespace) -> int:
    from .train.report import report

    runs = [Path(r).parent if Path(r).name == "receipt.json" else Path(r) for r in args.runs]
    # one run: its own folder; several: the folder they share (a study's)
    out = args.out or (runs[0] if len(runs) == 1 else Path(os.path.commonpath([r.resolve() for r in runs])))
    table, files = report(args.runs, out, title=args.title, baseline=args.baseline)
    print(table)
    print("wrote " + ", ".join(map(str, files)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .train.demo import run_demo

    changes = {"steps": args.steps} if args.steps else {}
    table, files = run_demo(args.out, gpu=None if args.device == "auto" else args.device == "gpu", **changes)
    print(table)
    print("wrote " + ", ".join(map(str, files)))
    return 0


# ---- registration: one add_parser per subcommand, each setting its handler --------------------

def _add_inspect(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("file", type=Path, nargs="?", help="a .safetensors file or a torch file of tensors, or an FP4 "
                   "model directory (NVFP4 ModelOpt / compressed-tensors, gpt-oss MXFP4): its stored scales per "
                   "module and the checkpoint doctor's verdict")
    p.add_argument("--demo", type=Path, nargs="?", const=True, default=None,
                   help="inspect generated LLM-shaped tensors instead (optionally kept at this path)")
    _add_encoding_args(p)
    p.set_defaults(handler=_inspect)
    return p


def _add_demo(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="run and report folder (default runs/demo)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                   help="which default size to use (auto: gpu when CUDA is available)")
    p.add_argument("--steps", type=int, default=None, help="override the number of steps")
    p.set_defaults(handler=_demo)
    return p


def _add_train(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("--config", type=Path, help="a TOML file of TrainConfig fields (with [model_overrides] and "
                   "[recipe_overrides] tables)")
    p.add_argument("--model", help="model preset (tiny, moe-tiny, d6, d12, d16, moe64)")
    p.add_argument("--recipe", help="recipe preset or .toml/.json file")
    p.add_argument("--data", help="built-in corpus (python, stdlib) or a token-shard path")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", help="run directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting: lr=1e-3, model.depth=4, recipe.wgrad.hadamard=random")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run the directory already holds")
    p.set_defaults(handler=_train)
    return p


def _add_report(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("runs", nargs="+", type=Path, help="run directories (or receipt.json files)")
    p.add_argument("--out", type=Path, default=None, help="where report.md and the plots go (default: the run's "
                   "folder, or the folder several runs share)")
    p.add_argument("--title", default="fp4lab")
    p.add_argument("--baseline", default=None, help="the arm every gap is taken to (default: the plain BF16 arm; "
                   "runs named ARM-seedK are seed K of ARM)")
    p.set_defaults(handler=_report)
    return p


def _add_verify(sub, name: str, help: str) -> argparse.ArgumentParser:
    from .verify import cli as verify_cli
    return verify_cli.add_parser(sub, name, help)  # sets its handler, verify.cli.run


def _add_generate(sub, name: str, help: str) -> argparse.ArgumentParser:
    from . import generate
    return generate.add_parser(sub, name, help)  # sets its handler, cli_generate


def _add_study(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("name", nargs="?", help="the study to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the studies with their arms and cost")
    p.add_argument("--scale", default="smoke", help="smoke (CPU, seconds), gpu-small, gpu-medium, gpu-stable "
                   "(the measurement protocol's settings; --list gives each scale's cost)")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds to run (default: the scale's)")
    p.add_argument("--arms", nargs="+", help="run only these arms (default: all; the report covers what is there)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once on each visible GPU, in subprocesses "
                   "(small models; with several GPUs each run is pinned to one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a training setting of every run, e.g. steps=100")
    p.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from the receipts")
    p.add_argument("--replace", action="store_true",
                   help="rerun finished runs of other settings in --out over them (refused otherwise)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/<name>)")
    p.add_argument("--mx-mode", choices=["floor", "ceil", "even", "rceil"], default="rceil",
                   help="MXFP4 encoder of the conversion study's inputs")
    p.set_defaults(handler=_study)
    return p


def _add_convert(sub, name: str, help: str) -> argparse.ArgumentParser:
    # MXFP4 -> NVFP4 is the one conversion there is, so no target-format option
    p = sub.add_parser(name, help=help,
                       description="Converts every MXFP4 tensor pair <base>_blocks (uint8 [..., out, in/32, 16]) "
                       "and <base>_scales (uint8 UE8M0 [..., out, in/32]) of the model directory (or .safetensors "
                       "file) SRC to NVFP4 in the new model directory DST: shards, index, config.json with the "
                       "layout's quantization_config (and ModelOpt's hf_quant_config.json), the other files of "
                       "SRC carried over; other tensors are copied. Then checks DST with the checkpoint doctor "
                       "(fp4lab verify checkpoint); exit code 1 if it finds an error. Formats: "
                       "docs/checkpoints.md and docs/numerics.md \"MXFP4 -> NVFP4 conversion\".",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("src", type=Path, help="the MXFP4 model directory or .safetensors file")
    p.add_argument("dst", type=Path, help="the NVFP4 model directory to write (new or empty)")
    _add_layout(p)
    p.add_argument("--method", choices=["requant", "verbatim-mid", "verbatim-search", "hybrid", "best"],
                   default="best", help="how each block's scale is chosen (best: the smallest exact MSE of the candidates)")
    p.add_argument("--verify", action="store_true", help="also check every output value against SRC")
    p.set_defaults(handler=_convert)
    return p


def _add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=["modelopt", "compressed-tensors"], default="modelopt",
                   help="the NVFP4 tensor names and scale conventions written (docs/checkpoints.md)")


def _add_quantize(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Post-training quantization to NVFP4 (weight-only, or W4A4 with "
                       "--calibration), round to nearest even, of the linear layers of the Hugging Face model "
                       "directory SRC; embeddings, lm_head, MoE routers and norms stay as they are; q/k/v and gate/up share one global scale. "
                       "Writes the model directory DST and checks it with the checkpoint doctor.")
    p.add_argument("src", type=Path, help="a model directory with config.json and .safetensors weights")
    p.add_argument("dst", type=Path, help="the NVFP4 model directory to write (new or empty)")
    p.add_argument("--format", choices=["nvfp4"], default="nvfp4")
    _add_layout(p)
    p.add_argument("--exclude", nargs="*", default=[], metavar="PATTERN",
                   help="module names (fnmatch wildcards) to keep in high precision")
    p.add_argument("--calibration", type=Path, default=None, metavar="TEXT",
                   help="a text file: quantize activations too (W4A4), their global scales from the largest "
                   "input each Linear sees on it (needs transformers)")
    p.set_defaults(handler=_quantize)
    return p


def _add_eval(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Builds the NVFP4 checkpoint's model with Hugging Face transformers, its "
                       "quantized Linears computing from the stored codes and scales (FP32 accumulation; "
                       "activations quantized too in a W4A4 checkpoint), and reports perplexity on TEXT; with "
                       "--reference (the BF16 model), also its perplexity, top-1 agreement and each layer's "
                       "relative output error on the reference's inputs.")
    p.add_argument("checkpoint", type=Path, help="an NVFP4 model directory (ModelOpt or compressed-tensors)")
    p.add_argument("--text", type=Path, required=True, help="a UTF-8 text file to score")
    p.add_argument("--reference", type=Path, default=None, help="the high-precision model directory")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--out", type=Path, default=None, help="write eval.json and layer_error.png here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_eval)
    return p


SUBCOMMANDS = {
    "inspect": ("quantize each floating tensor of a file and tabulate the error", _add_inspect),
    "demo": ("train a tiny GPT in BF16, NVFP4 and MXFP4 on the built-in corpus; print the gap table, "
             "plot the curves", _add_demo),
    "train": ("train one run: fp4lab train --model tiny --recipe nvfp4 --set lr=1e-3", _add_train),
    "report": ("tables and plots from run receipts", _add_report),
    "verify": ("check FP4 GEMMs, the swizzled scale layout and quantizers against fp4lab's reference, "
               "with a diagnosis of the first failure", _add_verify),
    "generate": ("generate text from a trained run; --quantize nvfp4 also post-training quantizes it and "
                 "reports the cost", _add_generate),
    "study": ("run a published FP4 finding as a study (fp4lab study --list)", _add_study),
    "quantize": ("quantize a Hugging Face model's linear layers to an NVFP4 checkpoint (ModelOpt or "
                 "compressed-tensors layout)", _add_quantize),
    "eval": ("evaluate an NVFP4 checkpoint on CPU/Hopper by emulation: perplexity, and against its BF16 "
             "reference top-1 agreement and per-layer error", _add_eval),
    "convert": ("convert a gpt-oss-style MXFP4 checkpoint to an NVFP4 model directory (ModelOpt or "
                "compressed-tensors) and check it", _add_convert),
}
"""Every subcommand: its one-line help and its add_parser, in the order ``fp4lab --help`` lists them."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s full subparser and one-line stubs for the others (None:
    every subparser in full). Building a subparser imports what its command needs (torch,
    Triton), so ``fp4lab --help`` and another command's errors answer without them."""
    parser = argparse.ArgumentParser(prog="fp4lab", description="Bit-exact FP4 (NVFP4, MXFP4) research tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help, add_parser) in SUBCOMMANDS.items():
        if command in (None, name):
            add_parser(sub, name, help)
        else:
            sub.add_parser(name, help=help)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # fp4lab has no global options
    args = build_parser(command if command in SUBCOMMANDS else "").parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError, CheckpointError, RunLockedError, MissingDependency) as exc:  # see the module doc
        print(f"fp4lab {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
