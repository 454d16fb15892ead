"""``fp4lab`` command line: parses arguments, then calls the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


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


def _inspect(path: Path, args: argparse.Namespace) -> int:
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
    from .studies import conversion

    if args.list or args.name is None:
        print(f"conversion  MXFP4 -> NVFP4 on {len(conversion.SCENARIOS)} scenarios; arms: "
              f"{', '.join(conversion.METHODS)}; CPU, about a minute")
        return 0
    out = args.out or Path("results") / args.name
    receipt = conversion.run(out, mx_mode=args.mx_mode)
    print(conversion.report(receipt))
    print(f"wrote {out / 'receipt.json'} and {out / 'table.md'}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert.checkpoint import convert_checkpoint, verify_checkpoint

    report = convert_checkpoint(args.src, args.dst, layout=args.layout, method=args.method)
    for base, r in report.items():
        cost = "lossless" if r["lossless"] else f"mse {r['mse']:.3g}"
        print(f"{base}: {r['method']}, spread {r['spread']}, m {r['m']}, {cost}")
    print(f"wrote {args.dst} ({len(report)} tensors converted)")
    if args.verify:
        diffs = verify_checkpoint(args.src, args.dst, layout=args.layout)
        bad = [b for b, d in diffs.items() if report[b]["lossless"] and d != 0]
        if bad:
            print(f"verify FAILED: {bad}", file=sys.stderr)
            return 1
        print(f"verified: every copied tensor equal; {sum(r['lossless'] for r in report.values())} converted "
              "tensors bit-exact to the MXFP4 values, the rest within their reported MSE")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp4lab", description="Bit-exact FP4 (NVFP4, MXFP4) research tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="quantize each floating tensor of a file and tabulate the error")
    p.add_argument("file", type=Path, help="a .safetensors file or a torch file of tensors")
    _add_encoding_args(p)
    p = sub.add_parser("demo", help="generate LLM-shaped tensors and inspect them in NVFP4 and MXFP4")
    p.add_argument("--out", type=Path, default=None, help="where to write the demo tensors")
    _add_encoding_args(p)
    p = sub.add_parser("study", help="run a published FP4 finding as a study (today: conversion)")
    p.add_argument("name", nargs="?", choices=["conversion"], help="the study to run")
    p.add_argument("--list", action="store_true", help="list the studies with their arms")
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/<name>)")
    p.add_argument("--mx-mode", choices=["floor", "ceil", "even", "rceil"], default="rceil",
                   help="MXFP4 encoder of the conversion study's inputs")
    p = sub.add_parser("convert", help="convert a gpt-oss-style MXFP4 safetensors checkpoint to NVFP4")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--to", choices=["nvfp4"], default="nvfp4")
    p.add_argument("--layout", choices=["modelopt", "compressed-tensors"], default="modelopt")
    p.add_argument("--method", choices=["requant", "verbatim-mid", "verbatim-search", "hybrid", "best"],
                   default="best")
    p.add_argument("--verify", action="store_true", help="read the output back and check every tensor")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            return _convert(args)
        if args.command == "inspect":
            return _inspect(args.file, args)
        if args.command == "study":
            return _study(args)
        from .inspect import write_demo_tensors
        with tempfile.TemporaryDirectory() as tmp:
            path = write_demo_tensors(args.out or Path(tmp) / "demo.safetensors")
            return _inspect(path, args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"fp4lab {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
