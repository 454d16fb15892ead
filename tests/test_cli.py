"""`fp4lab inspect` and `fp4lab demo` as a user runs them; how subcommands register and fail."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from fp4lab.cli import main


def test_demo_prints_a_table_for_both_formats(capsys):
    assert main(["inspect", "--demo"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4/te/1x16" in out and "mxfp4/floor" in out and "SQNR dB" in out


def test_inspect_safetensors_json(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(32, 48), "ids": torch.arange(5), "odd": torch.randn(3, 20)}, str(path))
    assert main(["inspect", str(path), "--format", "nvfp4", "--block", "16x16", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["w"]["encoding"] == "nvfp4/te/16x16" and 15 < rows["w"]["sqnr_db"] < 25
    assert "skipped" in rows["ids"] and rows["odd"]["shape"] == [3, 20]
    save_file({"norm": torch.randn(64)}, str(path))
    assert main(["inspect", str(path), "--format", "nvfp4", "--block", "16x16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["encoding"] == "nvfp4/te/1x16"  # 1-D


def test_inspect_nested_torch_file(tmp_path, capsys):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"a": torch.randn(4, 32).bfloat16()}, "step": torch.tensor(3.0), "ids": torch.arange(3)}, path)
    assert main(["inspect", str(path), "--format", "mxfp4", "--mode", "rceil"]) == 0
    out = capsys.readouterr().out
    assert "model.a" in out and "mxfp4/rceil" in out and "scalar or empty" in out and "int64" in out


def test_corrupt_and_missing_files_get_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    assert main(["inspect", str(bad)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nope.pt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_every_subcommand_is_registered_one_way_with_a_handler():
    from fp4lab.cli import build_parser
    sub = build_parser()._subparsers._group_actions[0]
    assert set(sub.choices) == {"inspect", "demo", "train", "report", "verify", "generate", "study", "convert",
                                 "quantize", "eval"}
    assert all(callable(p.get_default("handler")) for p in sub.choices.values())
    assert "--to" not in sub.choices["convert"].format_help()  # one conversion: nothing to choose


def test_help_and_argument_errors_answer_without_torch():
    # a fresh interpreter: `fp4lab --help` and another command's usage error import no torch
    code = ("import sys\nfrom fp4lab.cli import main\n"
            "for argv in (['--help'], ['train', '--resume', '--steps', 'x']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr
    assert "usage: fp4lab" in out.stdout and "convert a gpt-oss-style MXFP4" in out.stdout
    assert "argument --steps: invalid int value: 'x'" in out.stderr


def test_bad_settings_are_errors_and_bugs_show_their_traceback(tmp_path, capsys, monkeypatch):
    assert main(["train", "--data", str(tmp_path), "--set", "steps=abc"]) == 2
    assert "training setting steps='abc' must be int" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path), "--set", "model.depth=two"]) == 2
    assert "model setting depth='two' must be int" in capsys.readouterr().err

    from fp4lab.train import loop

    def bug(*args, **kwargs):
        raise TypeError("a bug, not the user's input")
    monkeypatch.setattr(loop, "train", bug)
    with pytest.raises(TypeError, match="a bug"):
        main(["train", "--data", str(tmp_path)])


@pytest.mark.parametrize("config,args,message", [
    ("lr = \n", [], "config file {cfg}: not valid TOML: Invalid value (at line 1, column 6)"),
    ('lr = "abc"\n', [], "config file {cfg}: training setting lr='abc' must be float, not str"),
    ('[model_overrides]\ndepth = "two"\n', [], "config file {cfg}: model setting depth='two' must be int, not str"),
    ("", ["--set", "seq_len=1.5"], "--set: training setting seq_len=1.5 must be int, not float"),
    ("", ["--set", "lr=abc"], "--set: training setting lr='abc' must be float, not str"),
    ("", ["--set", "batch_size=-4"], "--set: training setting batch_size=-4 must be at least 1"),
    ("", ["--set", "steps=0"], "--set: training setting steps=0 must be at least 1"),
    ("", ["--set", "lr=NaN"], "--set: training setting lr=nan must be positive and finite"),
    ("", ["--set", "val_fraction=1"], "--set: training setting val_fraction=1 must be between 0 and 1"),
    ("", ["--set", "schedule=linear"], "--set: training setting schedule='linear' must be one of cosine, wsd"),
    ("", ["--set", "model.width=3"], "--set: unknown model setting width; fields: vocab_size"),
    ("", ["--set", "lr"], "--set: expected key=value, got 'lr'"),
    ("", ["--model", "d7"], "training setting model='d7' must be one of tiny"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_config_errors_name_their_source_key_and_expectation(config, args, message, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(config)
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"),
                 *(["--config", str(cfg)] if config else []), *args]) == 2
    err = capsys.readouterr().err
    assert message.format(cfg=cfg) in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused at the door: nothing was started
