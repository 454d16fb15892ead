"""``fp4lab verify gemm | layout | quantizer | checkpoint``: the verifiers from the command line.

By default each verb checks fp4lab's own implementations, so the command doubles as a self-test:

    fp4lab verify gemm        reference (formats.scaled_mm), emulated (formats.emulated_mm) and
                              kernels.fp4_mm (``--backend``, default the CPU reference backend),
                              for NVFP4 and MXFP4, plain and swizzled scales
    fp4lab verify layout      formats.swizzle_scales / unswizzle_scales on odd shapes
    fp4lab verify quantizer   the te vs torchao NVFP4 profiles (or two MX modes) on a seeded
                              random tensor with some all-zero and tiny blocks; prints the diff
    fp4lab verify checkpoint DIR  the checkpoint doctor: DIR against the NVFP4 layout its config
                              declares, one line per finding (``--json``: a JSON list);
                              ``--reference SRC`` also checks every value against the MXFP4 source

Exit code: 0 when every check passes (quantizer: always, unless ``--expect-equal`` and they
differ; checkpoint: no finding of level error), 1 otherwise. Wire it into a parent parser with ``add_parser(subparsers)`` and call
``run(args)`` for the ``verify`` command.

Public: ``add_parser``, ``run``, ``print_findings``.
"""

from __future__ import annotations

import argparse

import torch

IMPLS = ("reference", "emulated", "kernels")
QUANTIZERS = {"te": ("nvfp4", "profile"), "torchao": ("nvfp4", "profile"), "floor": ("mxfp4", "mode"),
              "ceil": ("mxfp4", "mode"), "even": ("mxfp4", "mode"), "rceil": ("mxfp4", "mode")}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 64x128, got {text!r}") from None


def _shapes(text: str) -> list[tuple[int, ...]]:
    shapes = [_shape(s) for s in text.split(",")]
    if any(len(s) != 3 for s in shapes):
        raise argparse.ArgumentTypeError(f"GEMM shapes are MxNxK, got {text!r}")
    return shapes


def add_parser(subparsers, name: str = "verify", help: str | None = None) -> argparse.ArgumentParser:
    """Register ``verify`` and its verbs on an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(name, help=help)
    verbs = p.add_subparsers(dest="verify_verb", required=True)
    g = verbs.add_parser("gemm", help="run the exact-case ladder and random shapes on FP4 GEMMs")
    g.add_argument("--impl", choices=IMPLS, action="append", help="GEMM(s) to check (default: all three)")
    g.add_argument("--backend", choices=["reference", "triton", "auto"], default="reference",
                   help="kernels.fp4_mm backend (triton: CUDA, or TRITON_INTERPRET=1 on CPU)")
    g.add_argument("--format", choices=["nvfp4", "mxfp4", "both"], default="both")
    g.add_argument("--layout", choices=["plain", "swizzled", "both"], default="both")
    g.add_argument("--shapes", type=_shapes, default=None, help="random shapes, e.g. 7x5x64,130x70x160")
    g.add_argument("--exact-shape", type=_shapes, default=None, help="MxNxK of the exact rungs")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--verbose", action="store_true", help="print the details of passing checks too")
    lay = verbs.add_parser("layout", help="swizzle round trip: every scale byte where the 128x4 layout says")
    lay.add_argument("--rows", type=_ints, default=None, help="comma-separated row counts")
    lay.add_argument("--cols", type=_ints, default=None, help="comma-separated column counts")
    q = verbs.add_parser("quantizer", help="where two quantizers disagree, and which rule explains it")
    q.add_argument("--a", choices=list(QUANTIZERS), default="te", help="NVFP4 profile or MX mode")
    q.add_argument("--b", choices=list(QUANTIZERS), default="torchao")
    q.add_argument("--shape", type=_shape, default=(256, 1024))
    q.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--examples", type=int, default=4, help="differing blocks to print")
    q.add_argument("--expect-equal", action="store_true", help="exit 1 if they differ")
    c = verbs.add_parser("checkpoint", help="check an NVFP4 model directory against its declared layout "
                         "(ModelOpt or compressed-tensors) and name each deviation")
    c.add_argument("dir", help="the model directory (config.json, *.safetensors)")
    c.add_argument("--reference", help="the MXFP4 checkpoint it was converted from: check every value too")
    c.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``verify`` command; print the results; return the exit code."""
    return {"gemm": _gemm, "layout": _layout, "quantizer": _quantizer,
            "checkpoint": _checkpoint}[args.verify_verb](args)


def print_findings(findings: list, subject: str, as_json: bool = False) -> int:
    """Print the doctor's findings (one line each, or JSON); -> 1 if any is an error, else 0."""
    import json

    errors = sum(f.level == "error" for f in findings)
    if as_json:
        print(json.dumps([f.as_dict() for f in findings], indent=1))
    else:
        for finding in findings:
            print(finding)
        print(f"{subject}: {'FAIL' if errors else 'PASS'} ({errors} errors, {len(findings) - errors} warnings)")
    return 1 if errors else 0


def _checkpoint(args: argparse.Namespace) -> int:
    from .checkpoint import check_checkpoint

    return print_findings(check_checkpoint(args.dir, reference=args.reference), args.dir, args.json)


def _gemm(args: argparse.Namespace) -> int:
    from . import check_gemm, emulated_gemm, kernels_gemm, reference_gemm
    from .gemm import DEFAULT_SHAPES, EXACT_SHAPE

    fns = {"reference": reference_gemm, "emulated": emulated_gemm, "kernels": kernels_gemm(args.backend)}
    device = "cuda" if args.backend != "reference" and torch.cuda.is_available() else "cpu"
    ok = True
    for impl in args.impl or IMPLS:
        for fmt in ("nvfp4", "mxfp4") if args.format == "both" else (args.format,):
            for layout in ("plain", "swizzled") if args.layout == "both" else (args.layout,):
                result = check_gemm(fns[impl], fmt=fmt, layout=layout, shapes=args.shapes or DEFAULT_SHAPES,
                                    exact_shape=(args.exact_shape or [EXACT_SHAPE])[0], seed=args.seed,
                                    device=device if impl == "kernels" else "cpu")
                ok &= result.ok
                print(result if args.verbose or not result.ok else f"{result.subject}: PASS  {result.message}")
    return 0 if ok else 1


def _layout(args: argparse.Namespace) -> int:
    from .layout import DEFAULT_COLS, DEFAULT_ROWS, check_layout

    result = check_layout(rows=args.rows or DEFAULT_ROWS, cols=args.cols or DEFAULT_COLS)
    print(result)
    return 0 if result.ok else 1


def _quantizer(args: argparse.Namespace) -> int:
    from ..formats import quantize_mxfp4, quantize_nvfp4
    from .quantizer import diff_quantizers

    (fa, ka), (fb, kb) = QUANTIZERS[args.a], QUANTIZERS[args.b]
    if fa != fb:
        raise ValueError(f"--a {args.a} is {fa} and --b {args.b} is {fb}: compare two quantizers of one format")
    quantize = quantize_nvfp4 if fa == "nvfp4" else quantize_mxfp4
    g = torch.Generator().manual_seed(args.seed)
    rows = args.shape[0]
    # Gaussian rows with log-normal magnitudes (some blocks underflow), and a few all-zero blocks
    x = torch.randn(args.shape, generator=g) * torch.exp(2 * torch.randn(rows, *[1] * (len(args.shape) - 1),
                                                                         generator=g))
    x.view(rows, -1)[: max(1, rows // 64), :32] = 0
    x = x.to(getattr(torch, args.dtype))
    diff = diff_quantizers(lambda t: quantize(t, pad=True, **{ka: args.a}),
                           lambda t: quantize(t, pad=True, **{kb: args.b}), x,
                           names=(args.a, args.b), max_examples=args.examples)
    print(f"x: {list(args.shape)} {args.dtype}, seed {args.seed}")
    print(diff)
    return 1 if args.expect_equal and not diff.ok else 0
