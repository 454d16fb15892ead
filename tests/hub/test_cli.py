"""fp4lab quantize and fp4lab inspect DIR from the command line."""

import json

import torch
from safetensors.torch import load_file, save_file

from fp4lab.cli import main

from ..convert.gpt_oss import gpt_oss_dir
from .test_checkpoint import llama_dir


def test_quantize_then_inspect(tmp_path, capsys):
    src, _ = llama_dir(tmp_path / "hf")
    assert main(["quantize", str(src), str(tmp_path / "nv"), "--layout", "compressed-tensors",
                 "--exclude", "model.layers.1.mlp.*"]) == 0
    out = capsys.readouterr().out
    assert "11 modules quantized" in out and "PASS (0 errors" in out
    assert main(["inspect", str(tmp_path / "nv"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"] == "compressed-tensors" and report["findings"] == []
    rows = {r["module"]: r for r in report["modules"]}
    assert "model.layers.1.mlp.down_proj" not in rows and len(rows) == 11
    r = rows["model.layers.0.mlp.down_proj"]
    # every 1x16 block's amax lands on +-6 (te scales round to nearest): at least 1 in 16 elements
    assert r["format"] == "nvfp4" and r["blocks"] == 64 * 8 and r["zero_blocks"] == 0 and r["at_6_pct"] >= 100 / 16
    assert 0 < r["scale_min"] <= r["scale_median"] <= r["scale_max"] <= 448


def test_inspect_counts_zero_blocks_and_names_a_broken_checkpoint(tmp_path, capsys):
    src, t = llama_dir(tmp_path / "hf")
    t["model.layers.0.mlp.up_proj.weight"][:4, :16] = 0  # four all-zero blocks
    save_file(t, str(src / "model.safetensors"))
    assert main(["quantize", str(src), str(tmp_path / "nv")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "nv")]) == 0
    out = capsys.readouterr().out
    assert "| model.layers.0.mlp.up_proj | nvfp4 | 128x64 |" in out and "| 4 (0.78%) |" in out
    weights = load_file(str(tmp_path / "nv" / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight_scale_2"] = torch.tensor(-1.0)
    save_file(weights, str(tmp_path / "nv" / "model.safetensors"))
    assert main(["inspect", str(tmp_path / "nv")]) == 1
    assert "global-scale-not-positive" in capsys.readouterr().out


def test_inspect_reads_mxfp4(tmp_path, capsys):
    assert main(["inspect", str(gpt_oss_dir(tmp_path / "mx"))]) == 0
    out = capsys.readouterr().out
    assert "mxfp4" in out and "experts.gate_up_proj" in out and "doctor" not in out


def test_quantize_refuses_a_bad_directory_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["quantize", str(tmp_path / "empty"), str(tmp_path / "out")]) != 0
    assert "no .safetensors" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_missing_transformers_is_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    import fp4lab.hub.ptq as ptq
    from fp4lab.train.errors import MissingDependency

    def missing():
        raise MissingDependency("this builds the model with Hugging Face transformers: pip install 'fp4lab[hub]'")
    monkeypatch.setattr(ptq, "has_transformers", lambda: False)
    monkeypatch.setattr(ptq, "transformers_module", missing)
    src, _ = llama_dir(tmp_path / "hf")
    (tmp_path / "calib.txt").write_text("some text")
    assert main(["quantize", str(src), str(tmp_path / "nv"), "--calibration", str(tmp_path / "calib.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'fp4lab[hub]'" in err and "Traceback" not in err
    assert not (tmp_path / "nv").exists()
