"""Checkpoint conversion on small synthetic gpt-oss-style MXFP4 files."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4lab.cli import main
from fp4lab.convert.checkpoint import convert_checkpoint, verify_checkpoint
from fp4lab.formats import quantize_mxfp4


def gpt_oss_file(path, spread_outlier=False):
    g = torch.Generator().manual_seed(0)
    tensors = {"model.norm.weight": torch.randn(64, generator=g).bfloat16(),
               "model.embed.weight": torch.randn(10, 64, generator=g)}
    for name, (e, out, inp) in {"model.layers.0.mlp.experts.gate_up_proj": (2, 48, 64),
                                "model.layers.0.mlp.experts.down_proj": (2, 64, 32)}.items():
        w = torch.randn(e, out, inp, generator=g) * 0.02
        if spread_outlier and "down" in name:
            w[0, 0, 0] = 1e4  # exponent spread > 17: not lossless
        q = quantize_mxfp4(w, mode="rceil")
        tensors[name + "_blocks"] = q.codes.reshape(e, out, inp // 32, 16)
        tensors[name + "_scales"] = q.scales
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_convert_round_trip(tmp_path, layout):
    src, dst = tmp_path / "mx.safetensors", tmp_path / "out" / "nv.safetensors"
    gpt_oss_file(src, spread_outlier=True)
    report = convert_checkpoint(src, dst, layout=layout)
    assert report["model.layers.0.mlp.experts.gate_up_proj"]["lossless"]
    assert not report["model.layers.0.mlp.experts.down_proj"]["lossless"]
    diffs = verify_checkpoint(src, dst, layout=layout)
    assert diffs["model.layers.0.mlp.experts.gate_up_proj"] == 0
    with safe_open(str(dst), framework="pt") as f:
        keys = set(f.keys())
        codes = "weight" if layout == "modelopt" else "weight_packed"
        assert f"model.layers.0.mlp.experts.gate_up_proj.{codes}" in keys and "model.norm.weight" in keys
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj.weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj.weight_scale").shape == (2, 48, 4)
    config = "hf_quant_config.json" if layout == "modelopt" else "quantization_config.json"
    assert "NVFP4" in (tmp_path / "out" / config).read_text().upper()


def test_cli_convert_and_verify(tmp_path, capsys):
    src, dst = tmp_path / "mx.safetensors", tmp_path / "nv.safetensors"
    gpt_oss_file(src)
    assert main(["convert", str(src), str(dst), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "lossless" in out
    report = json.loads((tmp_path / "nv.conversion_report.json").read_text())
    assert all(r["lossless"] for r in report.values())


def test_nan_scales_and_corrupt_input_are_refused_without_output(tmp_path, capsys):
    src, dst = tmp_path / "mx.safetensors", tmp_path / "nv.safetensors"
    tensors = gpt_oss_file(src)
    tensors["model.layers.0.mlp.experts.down_proj_scales"][0, 0, 0] = 0xFF
    save_file(tensors, str(src))
    with pytest.raises(ValueError, match="down_proj_scales holds 1 NaN"):
        convert_checkpoint(src, dst)
    assert sorted(tmp_path.iterdir()) == [src]  # nothing partial left behind, no temporary either
    src.write_bytes(src.read_bytes()[:100])
    assert main(["convert", str(src), str(dst)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_an_input_without_mxfp4_tensors_is_an_error_not_zero_conversions(tmp_path, capsys):
    src, dst = tmp_path / "plain.safetensors", tmp_path / "nv.safetensors"
    save_file({"model.embed.weight": torch.randn(4, 8)}, str(src))
    assert main(["convert", str(src), str(dst)]) == 2
    assert "holds no MXFP4 tensor pair" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == [src]


def test_a_write_failure_leaves_no_output_and_one_clear_line(tmp_path, capsys, monkeypatch):
    import errno

    from fp4lab.convert import checkpoint
    src, out = tmp_path / "mx.safetensors", tmp_path / "out"
    gpt_oss_file(src)

    def full_disk(value):  # the last file of the three (the report) hits a full disk
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint, "_json", full_disk)
    assert main(["convert", str(src), str(out / "nv.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err
    assert list(out.iterdir()) == []  # not the tensors, not a config, not a 0-byte report
    monkeypatch.undo()

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(out))
    monkeypatch.setattr(checkpoint.Path, "mkdir", read_only)
    assert main(["convert", str(src), str(out / "nv.safetensors")]) == 2
    assert "Permission denied" in capsys.readouterr().err
