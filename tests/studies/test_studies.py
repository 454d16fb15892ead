"""The seven training studies: each runs at smoke scale, resumes, reports; verdicts judge data."""

from __future__ import annotations

import json

import pytest

from fp4lab.cli import main
from fp4lab.studies.catalog import SCALES, STUDIES, tokens_to_reach
from fp4lab.studies.study import arm_configs, load_study, run_study, write_report


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FP4LAB_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.mark.parametrize("name", list(STUDIES))
def test_every_study_runs_at_smoke_scale_and_reports(name, tmp_path):
    study = STUDIES[name]
    configs = run_study(study, SCALES["smoke"], tmp_path)
    assert len(configs) == len(study.arms) * len(SCALES["smoke"].seeds)
    runs = load_study(study, tmp_path)
    assert set(runs) == {a.name for a in study.arms}
    for arm in study.arms:  # each arm ran its own recipe diff, recorded in the receipt
        receipt = runs[arm.name][0]
        assert receipt["config"]["recipe"] == arm.recipe
        assert receipt["recipe"]["seed"] == receipt["seed"] == 0
        for key, value in arm.train.items():
            assert receipt["config"][key] == value
    text, files = write_report(study, tmp_path)
    assert {f.name for f in files} == {"report.md", "headline.json", "loss.png", "gap.png"} - (
        set() if any(a.bf16 for a in study.arms) else {"gap.png"})
    headline = json.loads((tmp_path / "headline.json").read_text())
    assert headline["reproduced"] in ("yes", "no", "partly") and headline["claim"] == study.claim
    assert study.claim in text and all(f"| {a.name} |" in text for a in study.arms)


def test_a_finished_run_is_kept_and_a_changed_one_rerun(tmp_path):
    study = STUDIES["formats"]
    run_study(study, SCALES["smoke"], tmp_path)
    stamp = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/receipt.json")}
    run_study(study, SCALES["smoke"], tmp_path)  # nothing to do
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/receipt.json")} == stamp
    configs = run_study(study, SCALES["smoke"], tmp_path, steps=5, eval_every=5)  # another budget: rerun
    assert all(json.loads((tmp_path / f"{a.name}-seed0" / "receipt.json").read_text())["final"]["steps"] == 5
               for a in study.arms)
    assert [c.steps for c in configs] == [5] * len(study.arms)
    # a run of another budget left beside them (another seed, so nothing overwrote it) is refused
    stray = json.loads((tmp_path / "bf16-seed0" / "receipt.json").read_text())
    stray["config"]["steps"], stray["name"] = 7, "bf16-seed9"
    (tmp_path / "bf16-seed9").mkdir()
    (tmp_path / "bf16-seed9" / "receipt.json").write_text(json.dumps(stray))
    with pytest.raises(ValueError, match="steps is 5 in .* but 7 in bf16-seed9"):
        load_study(study, tmp_path)


def test_seeds_vary_init_data_and_rounding_together(tmp_path):
    configs = arm_configs(STUDIES["stiction"], SCALES["gpu-small"], tmp_path)
    assert sorted({c.seed for c in configs}) == [0, 1]
    assert all(c.recipe_overrides["seed"] == c.seed for c in configs)
    assert all(c.stiction_every == 5 and c.model == "d6" for c in configs)
    moe = arm_configs(STUDIES["gains"], SCALES["gpu-small"], tmp_path)
    assert all(c.model == "moe64" for c in moe)


def _receipts(finals):
    return {arm: [{"flip_rate": [[1, 0.01 * (i + 1)]]} for _ in vals] for i, (arm, vals) in enumerate(finals.items())}


@pytest.mark.parametrize("finals, verdict", [
    ({"unit": [3.0, 3.1], "embed": [2.8, 2.9], "logits": [3.2, 3.2], "old_pair": [3.1, 3.0]}, "yes"),
    ({"unit": [3.0], "embed": [3.1], "logits": [3.2], "old_pair": [3.3]}, "partly"),
    ({"unit": [3.0], "embed": [3.1], "logits": [2.9], "old_pair": [2.8]}, "no"),
])
def test_gains_verdict(finals, verdict):
    assert STUDIES["gains"].verdict(finals, {})[1] == verdict


def test_progression_verdict_finds_the_costliest_gemm():
    finals = {"bf16": [3.0], "fprop": [3.01], "fprop_dgrad": [3.02], "fprop_dgrad_wgrad": [3.2]}
    text, verdict = STUDIES["gemm-progression"].verdict(finals, {})
    assert verdict == "yes" and "+wgrad +0.180" in text
    finals["fprop_dgrad_wgrad"] = [3.03]
    assert STUDIES["gemm-progression"].verdict(finals, {})[1] == "no"


def test_wgrad_verdict_counts_divergence_as_worst():
    finals = {"bf16": [3.0], "none": [float("inf")], "sr": [3.3], "random_hadamard": [3.4], "det_hadamard": [3.1]}
    text, verdict = STUDIES["wgrad-interventions"].verdict(finals, {})
    assert verdict == "yes" and "diverged: none" in text


def test_a_diverged_seed_counts_as_the_worst_result_not_as_missing():
    inf = float("inf")
    finals = {"bf16": [3.0, 3.0], "full": [3.1, 3.1], "no_bf16_layers": [3.2, 3.2], "no_rht": [inf, 3.1],
              "no_2d_weights": [3.12, 3.12], "no_sr": [3.15, 3.15], "bf16_late": [3.04, 3.04]}
    text, verdict = STUDIES["nvidia-ablation"].verdict(finals, {})
    assert verdict == "yes" and "no_rht +inf" in text
    finals = {"bf16": [3.0], "fprop": [3.01], "fprop_dgrad": [3.02], "fprop_dgrad_wgrad": [inf]}
    text, verdict = STUDIES["gemm-progression"].verdict(finals, {})
    assert verdict == "yes" and "diverged: fprop_dgrad_wgrad" in text


def test_ablation_and_stiction_verdicts():
    finals = {"bf16": [3.0], "full": [3.1], "no_bf16_layers": [3.2], "no_rht": [3.15], "no_2d_weights": [3.12],
              "no_sr": [3.05], "bf16_late": [3.04]}
    text, verdict = STUDIES["nvidia-ablation"].verdict(finals, {})
    assert verdict == "partly" and "3/4 removals hurt" in text and "+0.040" in text
    finals = {"bf16": [3.0], "rtne": [3.3], "dither": [3.2], "sr": [3.1]}  # flips rise rtne < dither < sr
    assert STUDIES["stiction"].verdict(finals, _receipts(finals))[1] == "yes"
    finals["sr"] = [3.25]
    assert STUDIES["stiction"].verdict(finals, _receipts(finals))[1] == "no"


def test_tokens_to_reach_interpolates_between_evals():
    receipt = {"evals": [{"tokens": 100, "val_loss": 4.0}, {"tokens": 200, "val_loss": 3.0},
                         {"tokens": 300, "val_loss": 2.5}]}
    assert tokens_to_reach(receipt, 3.5) == 150
    assert tokens_to_reach(receipt, 4.5) == 100
    assert tokens_to_reach(receipt, 2.0) is None
    finals = {"nvfp4": [2.75], "mxfp4": [2.9]}
    runs = {"nvfp4": [{"final": {"val_loss": 2.75}, "evals": [{"tokens": 200, "val_loss": 2.75}]}],
            "mxfp4": [dict(receipt, final={"val_loss": 2.5})]}
    text, verdict = STUDIES["formats"].verdict(finals, runs)  # MXFP4 reaches 2.75 at 250 tokens of 200
    assert verdict == "yes" and "mxfp4 needs +25% tokens" in text
    runs["mxfp4"][0]["evals"] = receipt["evals"][:2]  # never gets there
    text, verdict = STUDIES["formats"].verdict(finals, runs)
    assert verdict == "yes" and "does not reach" in text
    runs["nvfp4"][0]["evals"][0]["tokens"] = 300  # MXFP4 gets there first
    runs["mxfp4"][0]["evals"] = receipt["evals"]
    assert STUDIES["formats"].verdict(finals, runs)[1] == "no"


def test_cli_lists_studies_and_refuses_unknown_ones(capsys, tmp_path):
    assert main(["study", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in STUDIES) and "gpu-small" in out
    assert main(["study", "nonsense"]) == 2
    assert "unknown study 'nonsense'" in capsys.readouterr().err
    assert main(["study", "formats", "--report-only", "--out", str(tmp_path)]) == 2


def test_set_refuses_runner_owned_and_unknown_settings(tmp_path):
    study, smoke = STUDIES["formats"], SCALES["smoke"]
    with pytest.raises(ValueError, match="set by the study runner.*--seeds"):
        arm_configs(study, smoke, tmp_path, seed=3)
    with pytest.raises(ValueError, match="unknown training setting 'stepz'.*steps"):
        arm_configs(study, smoke, tmp_path, stepz=3)
    assert {c.steps for c in arm_configs(study, smoke, tmp_path, steps=5)} == {5}
