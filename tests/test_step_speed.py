"""benchmarks/step_speed.py: the step-speed table read from the benchmarks' JSON files."""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
step_speed = importlib.import_module("benchmarks.step_speed")


def _write(root: Path, name: str, git: str, **body) -> None:
    (root / name).write_text(json.dumps({"git": git, "date": "2026-11-26", "device": "H100", **body}))


def _row(text: str, label: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith(f"| {label} |")).split(" | ")


def test_the_table_divides_the_runs_judges_the_targets_and_names_each_run(tmp_path):
    arms = {"bf16/eager": {"step_ms": 10.0}, "nvfp4/eager": {"step_ms": 12.0},
            "bf16/compiled": {"step_ms": 5.0}, "nvfp4/compiled": {"step_ms": 9.0},
            "nvfp4:cpp/compiled": {"step_ms": 6.0},
            "bf16/compiled_graphed": {"step_ms": 4.0}, "nvfp4/compiled_graphed": {"step_ms": 5.0}}
    _write(tmp_path, "model.json", "abc1234", arms=arms)
    _write(tmp_path, "model_moe64.json", "abc1234",
           arms={"bf16/eager": {"step_ms": 50.0, "tokens_per_s": 160e3}})
    _write(tmp_path, "quantize.json", "abc1234", cases={"nvfp4_rtne": {"over_copy": 0.4}})
    text = step_speed.table(tmp_path)
    eager = _row(text, "d12 step, NVFP4 / BF16, eager (16 x 1024 tokens)")
    assert eager[1] == "1.20x" and eager[3] == "yes" and "abc1234" in eager[5]
    assert eager[4] == "-"  # (no graphed arms in the run: no GPU-alone figure)
    compiled = _row(text, "d12 step, compiled, against compiled BF16")
    assert compiled[1:4] == ["1.80x", "at most 1.30x", "no"]
    assert compiled[4] == "1.25x the GPU's work alone (both graphed)"  # the compiled + graphed arms' 5 / 4
    cpp = _row(text, "the same, FP4 compiled under Inductor's C++ wrapper (`cpp_wrapper=true`)")
    assert cpp[1:4] == ["1.20x", "at most 1.30x", "yes"]  # against the Python wrapper's BF16 (as users compile)
    assert _row(text, "d12 step, graphed")[1] == "not measured"  # the mode was not run
    tokens = _row(text, "moe64 step in BF16, eager (8 x 1024 tokens), tokens/s")
    assert tokens[1] == "160.0k tokens/s" and tokens[3] == "yes"  # at least 150k: met
    amax = _row(text, "quantize incl. amax, over copy bandwidth")
    assert amax[3] == "no" and "0.56" in amax[4]
    assert "linear.json: missing" in text
    assert "One device run" in text  # the files there agree on their commit
    _write(tmp_path, "linear.json", "def5678", shapes={})
    assert "Not one run: the files come from commits abc1234, def5678" in step_speed.table(tmp_path)


def test_main_writes_the_table_beside_the_results(tmp_path, capsys):
    _write(tmp_path, "model.json", "abc1234", arms={})
    step_speed.main(["--results", str(tmp_path)])
    assert (tmp_path / "step_speed.md").read_text().startswith("# Step speed against the targets")
    assert "| figure | measured |" in capsys.readouterr().out


def test_bench_model_keeps_the_other_modes_of_the_same_commits_run(tmp_path, monkeypatch):
    """bench_model.py split over calls (a time-limited machine): the second call's file keeps the
    first call's modes when the commit, device, model and batch agree; a mode measured again is
    replaced whole (a ratio never divides two runs' times), a missing ratio writes no key, and
    another commit starts afresh."""
    import argparse
    bench = importlib.import_module("benchmarks.bench_model")
    common = importlib.import_module("benchmarks.common")
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    env = {"device": "H100", "torch": "2", "triton": "3", "date": "2026-11-27", "git": "abc1234"}
    monkeypatch.setattr(bench, "environment", lambda: dict(env))
    args = argparse.Namespace(model="d12", batch=16, seq=1024, rounds=3, steps=20)
    row = lambda arm, mode, ms, ratio=1.5: {f"{arm}/{mode}": {"arm": arm, "mode": mode, "step_ms": ms,
                                                               "over_bf16": ratio, "tokens_per_s": 1.0}}
    bench.save_rows(args, {**row("bf16", "compiled", 36.0), **row("nvfp4", "compiled", 54.0),
                           **row("bf16", "eager", 60.0), **row("nvfp4", "eager", 100.0)})
    bench.save_rows(args, {**row("nvfp4", "compiled", 60.0, None), **row("bf16", "graphed", 50.0)})
    arms = json.loads((tmp_path / "model.json").read_text())["arms"]
    assert set(arms) == {"nvfp4/compiled", "bf16/eager", "nvfp4/eager", "bf16/graphed"}  # compiled: this run's
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["model_nvfp4_step_over_bf16"] == 1.5 and "model_bf16_tokens_per_s_graphed" in latest
    assert latest["model_nvfp4_step_over_bf16_compiled"] == 1.5  # the first call's key, not overwritten by None
    compiled = _row(step_speed.table(tmp_path), "d12 step, compiled, against compiled BF16")
    assert compiled[1] == "not measured"  # no ratio of two runs' times
    env["git"] = "def5678"
    bench.save_rows(args, row("bf16", "eager", 61.0))
    assert set(json.loads((tmp_path / "model.json").read_text())["arms"]) == {"bf16/eager"}


def test_the_pair_sweeps_d12_mix_is_a_d12_steps_pair_calls(monkeypatch):
    """benchmarks/sweep_pair.py weights its per-shape times by D12_CALLS: one CPU step of d12
    under the nvfp4 preset (a short sequence: the calls do not depend on the tokens) makes those
    pair calls, with the settings the sweep times (x: RTNE rows, TE-sign RHT columns; dy: SR both)."""
    import collections
    import torch
    from fp4lab import kernels
    from fp4lab.formats.hadamard import HadamardSigns
    from fp4lab.formats.types import Rounding
    from fp4lab.nn import GPT, model_config, quantize_model
    from fp4lab.nn.recipe import preset
    sweep = importlib.import_module("benchmarks.sweep_pair")
    calls, real = collections.Counter(), kernels.quantize_values_pair

    def counted(x, fmt, **kw):
        sr = Rounding.parse(kw["rows"].get("rounding", "rtne")) is Rounding.STOCHASTIC
        tensor = "dy" if sr else "x"
        rows, columns = sweep.SETTINGS[tensor]
        assert HadamardSigns.parse(kw["columns"]["hadamard"]) is HadamardSigns.parse(columns["hadamard"])
        assert (Rounding.parse(kw["columns"].get("rounding", "rtne")) is Rounding.STOCHASTIC) == sr
        calls[(tensor, x.shape[1])] += 1
        return real(x, fmt, **kw)
    monkeypatch.setattr(kernels, "quantize_values_pair", counted)
    torch.manual_seed(0)
    model = GPT(model_config("d12", seq_len=16))
    quantize_model(model, preset("nvfp4"))
    tokens = torch.randint(0, 1000, (1, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert dict(calls) == sweep.D12_CALLS


def test_latest_json_stamps_each_key_with_the_run_that_wrote_it(tmp_path, monkeypatch):
    """benchmarks/common.save: latest.json holds keys from many calls; each key's run is under
    run_of (no file-wide stamp, which would date keys another call wrote)."""
    common = importlib.import_module("benchmarks.common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / "latest.json").write_text(json.dumps({"git": "0000000", "old_key": 1.0}))
    env = {"device": "H100", "torch": "2", "triton": "3", "date": "2026-12-07"}
    common.save("a", {**env, "git": "abc1234"}, {"a_key": 1.5})
    common.save("b", {**env, "git": "def5678"}, {"b_key": 0.5})
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert "git" not in latest and latest["a_key"] == 1.5 and latest["b_key"] == 0.5 and latest["old_key"] == 1.0
    assert "git abc1234" in latest["run_of"]["a_key"] and "git def5678" in latest["run_of"]["b_key"]
    assert "old_key" not in latest["run_of"]


def test_bench_quantize_cases_merge_only_the_same_run_and_keep_another_runs_file(tmp_path, monkeypatch):
    """bench_quantize.py --cases: the file's other cases stay where the file is the same run (commit,
    device, shape, torch and Triton); a file from another run is kept as quantize_<git>.json and
    the new file holds only this call's cases."""
    bench = importlib.import_module("benchmarks.bench_quantize")
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    run = {"git": "abc1234", "device": "H100", "shape": [8, 16], "torch": "2", "triton": "3"}
    def call(payload: dict, rows: dict, pair: dict) -> dict:  # (as main: merge, then save)
        payload = {**payload, "cases": dict(rows), "pair_over_two_copies": pair}
        bench._merge(payload, rows, pair)
        (tmp_path / "quantize.json").write_text(json.dumps(payload))
        return payload

    call(run, {"old": {"ms": 1.0}}, {"x": 0.8})
    merged = call(run, {"new": {"ms": 2.0}}, {"dy": 0.9})
    assert set(merged["cases"]) == {"old", "new"} and merged["pair_over_two_copies"] == {"x": 0.8, "dy": 0.9}
    other = call({**run, "triton": "4"}, {"new": {"ms": 3.0}}, {})
    assert set(other["cases"]) == {"new"} and other["pair_over_two_copies"] == {}
    assert json.loads((tmp_path / "quantize_abc1234.json").read_text())["cases"] == merged["cases"]
    call(run, {"third": {"ms": 4.0}}, {})  # the same commit again, on the first software: another name
    assert json.loads((tmp_path / "quantize_abc1234_2.json").read_text())["triton"] == "4"
