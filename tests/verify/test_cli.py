"""``verify`` as the fp4lab CLI will run it: add_parser on a parent parser, then run(args)."""

import argparse

import pytest

from fp4lab.verify import cli


def verify(*argv):
    parser = argparse.ArgumentParser(prog="fp4lab")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return cli.run(parser.parse_args(["verify", *argv]))


def test_gemm_verb_checks_fp4lab_gemms(capsys):
    assert verify("gemm", "--format", "mxfp4", "--layout", "swizzled", "--shapes", "7x5x64",
                  "--exact-shape", "40x24x64") == 0
    out = capsys.readouterr().out
    for name in ("scaled_mm", "emulated_mm", "kernels.fp4_mm[reference]"):
        assert f"check_gemm {name} mxfp4/swizzled: PASS" in out
    assert verify("gemm", "--impl", "reference", "--format", "nvfp4", "--layout", "plain", "--shapes", "7x5x64",
                  "--exact-shape", "40x24x64", "--verbose") == 0
    assert "exact_shape: 40x24x64" in capsys.readouterr().out


def test_layout_verb(capsys):
    assert verify("layout", "--rows", "1,130", "--cols", "3,4") == 0
    assert "check_layout swizzle_scales: PASS" in capsys.readouterr().out


def test_quantizer_verb(capsys):
    assert verify("quantizer", "--shape", "64x256", "--examples", "1") == 0
    out = capsys.readouterr().out
    assert "te vs torchao (nvfp4): differ" in out and "scale_floor" in out
    assert verify("quantizer", "--shape", "64x256", "--expect-equal") == 1
    assert verify("quantizer", "--a", "rceil", "--b", "rceil", "--shape", "64x256", "--expect-equal") == 0
    assert "identical" in capsys.readouterr().out
    with pytest.raises(ValueError, match="one format"):
        verify("quantizer", "--a", "te", "--b", "floor")


def test_bad_shape_text_is_a_usage_error():
    with pytest.raises(SystemExit):
        verify("gemm", "--shapes", "7x5")
