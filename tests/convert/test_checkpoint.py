"""Checkpoint conversion: a gpt-oss-style MXFP4 model directory to a complete NVFP4 one."""

import errno
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4lab.cli import main
from fp4lab.convert.checkpoint import convert_checkpoint
from fp4lab.verify.checkpoint import check_checkpoint

from .gpt_oss import CONFIG, gpt_oss_dir, gpt_oss_tensors

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_a_gpt_oss_directory_converts_to_one_the_doctor_passes(tmp_path, layout):
    src, dst = gpt_oss_dir(tmp_path / "mx", spread_outlier=True), tmp_path / "nv"
    result = convert_checkpoint(src, dst, layout=layout)
    assert result.report[GATE_UP]["lossless"]
    assert not result.report["model.layers.0.mlp.experts.down_proj"]["lossless"]
    assert check_checkpoint(dst, reference=src) == []
    # every non-tensor file carried over byte for byte; the subdirectory named, not copied
    for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert result.left_out == ["original/"] and not (dst / "original").exists()
    assert not (dst / "quantization_config.json").exists()
    config = json.loads((dst / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == \
        {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    assert config["quantization_config"]["quant_method"] == layout
    assert "modules_to_not_convert" not in json.dumps(config)
    assert (dst / "hf_quant_config.json").exists() == (layout == "modelopt")
    # the index names every output tensor in the shard that holds it
    weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in set(weight_map.values()):
        with safe_open(str(dst / shard), framework="pt") as f:
            assert {k for k, v in weight_map.items() if v == shard} == set(f.keys())
    assert sorted(p.name for p in dst.iterdir() if p.name.startswith(".")) == []  # no temporaries


def test_autoconfig_reads_the_output(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = gpt_oss_dir(tmp_path / "mx")
    for layout in ("modelopt", "compressed-tensors"):
        convert_checkpoint(src, tmp_path / layout, layout=layout)
        config = transformers.AutoConfig.from_pretrained(str(tmp_path / layout))
        assert config.model_type == "gpt_oss"
        assert config.quantization_config["quant_method"] == layout


def test_cli_convert_checks_its_output(tmp_path, capsys):
    src, dst = gpt_oss_dir(tmp_path / "mx"), tmp_path / "nv"
    assert main(["convert", str(src), str(dst), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "lossless" in out and "not carried over: original/" in out and "PASS (0 errors" in out
    report = json.loads((dst / "conversion_report.json").read_text())
    assert all(r["lossless"] for r in report.values())
    assert main(["convert", str(src), str(dst)]) == 2  # an existing output is never overwritten
    assert "not an empty directory" in capsys.readouterr().err


def test_a_single_file_converts_too(tmp_path):
    src = tmp_path / "mx.safetensors"
    save_file(gpt_oss_tensors(), str(src))
    result = convert_checkpoint(src, tmp_path / "nv", layout="compressed-tensors")
    assert (tmp_path / "nv" / "mx.safetensors").exists() and result.left_out == []
    assert json.loads((tmp_path / "nv" / "config.json").read_text())["quantization_config"]["format"] == \
        "nvfp4-pack-quantized"
    assert check_checkpoint(tmp_path / "nv", reference=src) == []


def test_nan_scales_and_corrupt_input_are_refused_without_output(tmp_path, capsys):
    tensors = gpt_oss_tensors()
    tensors["model.layers.0.mlp.experts.down_proj_scales"][0, 0, 0] = 0xFF
    src, dst = gpt_oss_dir(tmp_path / "mx", tensors=tensors), tmp_path / "nv"
    with pytest.raises(ValueError, match="down_proj_scales holds 1 NaN"):
        convert_checkpoint(src, dst)
    assert not dst.exists()  # nothing partial left behind, no temporary either
    shard = sorted(src.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["convert", str(src), str(dst)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_an_input_without_mxfp4_tensors_is_an_error_not_zero_conversions(tmp_path, capsys):
    src, dst = tmp_path / "plain.safetensors", tmp_path / "nv"
    save_file({"model.embed.weight": torch.randn(4, 8)}, str(src))
    assert main(["convert", str(src), str(dst)]) == 2
    assert "holds no MXFP4 tensor pair" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == [src]


def test_a_write_failure_leaves_no_output_and_one_clear_line(tmp_path, capsys, monkeypatch):
    from fp4lab.convert import checkpoint
    src, out = gpt_oss_dir(tmp_path / "mx"), tmp_path / "out"

    def full_disk(path, stream):  # a carried-over file hits a full disk, after the shards are written
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint, "_copy", full_disk)
    assert main(["convert", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err
    assert not out.exists()  # not the shards, not a config, not a 0-byte report
    monkeypatch.undo()

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(out))
    monkeypatch.setattr(checkpoint.Path, "mkdir", read_only)
    assert main(["convert", str(src), str(out)]) == 2
    assert "Permission denied" in capsys.readouterr().err
