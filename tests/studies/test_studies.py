"""The training studies: each runs at smoke scale, resumes, reports; verdicts are paired-interval decisions."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp4lab.cli import main
from fp4lab.studies.catalog import SCALES, STUDIES
from fp4lab.studies.study import StudyRuns, arm_configs, load_study, run_study, write_report
from fp4lab.train.stats import CONTRADICTED, NOT_RESOLVED, REPRODUCED, VERDICTS
from tests.train.receipts import make_receipt


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
        receipt = runs[arm.name][0]  # {seed: receipt}
        assert receipt.config["recipe"] == arm.recipe
        assert receipt.recipe["seed"] == receipt.seed == 0
        for key, value in arm.train.items():
            assert receipt.config[key] == value
    text, files = write_report(study, tmp_path)
    assert {f.name for f in files} == {"report.md", "headline.json", "loss.png", "gap.png"} - (
        set() if any(a.bf16 for a in study.arms) else {"gap.png"})
    headline = json.loads((tmp_path / "headline.json").read_text())
    assert headline["verdict"] in VERDICTS + ("not run",) and headline["claim"] == study.claim
    assert study.claim in text and all(f"| {a.name} |" in text for a in study.arms)


def test_a_finished_run_is_kept_and_a_changed_one_refused_unless_replaced(tmp_path):
    study = STUDIES["formats"]
    run_study(study, SCALES["smoke"], tmp_path)
    stamp = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/receipt.json")}
    run_study(study, SCALES["smoke"], tmp_path)  # nothing to do
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/receipt.json")} == stamp
    # another budget where finished runs lie (e.g. another scale's committed results): refused, untouched
    with pytest.raises(ValueError, match=r"bf16-seed0 holds a finished run of other settings \(eval_every 5, "
                                         r"wanted 4; \d+ such runs in all\).*--replace"):
        run_study(study, SCALES["smoke"], tmp_path, steps=5, eval_every=4)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/receipt.json")} == stamp
    configs = run_study(study, SCALES["smoke"], tmp_path, steps=5, eval_every=5, replace=True)  # asked: rerun
    assert all(json.loads((tmp_path / f"{a.name}-seed0" / "receipt.json").read_text())["final"]["steps"] == 5
               for a in study.arms)
    assert [c.steps for c in configs] == [5] * len(study.arms)
    # a run of another budget left beside them (another seed, so nothing overwrote it) is refused
    stray = json.loads((tmp_path / "bf16-seed0" / "receipt.json").read_text())
    stray["config"]["steps"], stray["name"], stray["seed"] = 7, "bf16-seed9", 9
    (tmp_path / "bf16-seed9").mkdir()
    (tmp_path / "bf16-seed9" / "receipt.json").write_text(json.dumps(stray))
    with pytest.raises(ValueError, match="steps is 5 in .* but 7 in bf16-seed9"):
        load_study(study, tmp_path)
    # one driven another way (graphed, compiled, deterministic) is the same run: it is read in
    stray["config"].update(steps=5, cuda_graph=True, compile=True, deterministic=True)
    (tmp_path / "bf16-seed9" / "receipt.json").write_text(json.dumps(stray))
    assert 9 in load_study(study, tmp_path)["bf16"]
    # one stopped part-way (stop_at) is no result yet: left out, not read as diverged
    stray.update(status="stopped")
    stray["config"].update(stop_at=3)
    (tmp_path / "bf16-seed9" / "receipt.json").write_text(json.dumps(stray))
    assert 9 not in load_study(study, tmp_path)["bf16"] and 0 in load_study(study, tmp_path)["bf16"]


def test_a_run_serves_another_arm_only_with_the_same_arithmetic(tmp_path):
    """A study reuses another study's run when the recipe it trained resolves to the arm's (the
    fidelity study's mxfp4_hadamard is wgrad-interventions' det_hadamard, under another preset's
    name and overrides; fidelity's mxfp4 is gemm-progression's fprop_dgrad_wgrad, whose unrotated
    wgrad names another Hadamard size); a run of other arithmetic under an arm's name (the
    Hadamard-rotated mxfp4 where gemm-progression wants plain MXFP4) is refused, by the runner and
    by the report, nothing overwritten."""
    run_study(STUDIES["fidelity"], SCALES["smoke"], tmp_path / "fidelity", arms=("mxfp4_hadamard", "mxfp4", "bf16"))

    def serve(run: str, study: str, arm: str) -> Path:
        receipt = json.loads((tmp_path / "fidelity" / f"{run}-seed0" / "receipt.json").read_text())
        receipt["name"] = f"{arm}-seed0"
        (tmp_path / study / f"{arm}-seed0").mkdir(parents=True)
        path = tmp_path / study / f"{arm}-seed0" / "receipt.json"
        path.write_text(json.dumps(receipt))
        return path

    served = serve("mxfp4_hadamard", "wgrad", "det_hadamard")
    stamp = served.stat().st_mtime_ns
    run_study(STUDIES["wgrad-interventions"], SCALES["smoke"], tmp_path / "wgrad", arms=("det_hadamard",))
    assert served.stat().st_mtime_ns == stamp  # kept, not retrained
    kept = load_study(STUDIES["wgrad-interventions"], tmp_path / "wgrad")["det_hadamard"][0]
    assert kept.config["recipe"] == "mxfp4_hadamard" and kept.config["recipe_overrides"] == {"seed": 0}

    plain = serve("mxfp4", "progression", "fprop_dgrad_wgrad")
    stamp = plain.stat().st_mtime_ns
    run_study(STUDIES["gemm-progression"], SCALES["smoke"], tmp_path / "progression", arms=("fprop_dgrad_wgrad",))
    assert plain.stat().st_mtime_ns == stamp
    assert load_study(STUDIES["gemm-progression"], tmp_path / "progression")["fprop_dgrad_wgrad"][0].config["recipe"] == "mxfp4"

    bf16 = serve("bf16", "stiction", "bf16")  # a BF16 run samples no FP4 codes: fidelity's serves stiction
    stamp = bf16.stat().st_mtime_ns
    run_study(STUDIES["stiction"], SCALES["smoke"], tmp_path / "stiction", arms=("bf16",))
    assert bf16.stat().st_mtime_ns == stamp

    wrong = serve("mxfp4_hadamard", "progression-rotated", "fprop_dgrad_wgrad")
    stamp = wrong.stat().st_mtime_ns
    with pytest.raises(ValueError, match="fprop_dgrad_wgrad-seed0 holds a finished run of other settings"):
        run_study(STUDIES["gemm-progression"], SCALES["smoke"], tmp_path / "progression-rotated",
                  arms=("fprop_dgrad_wgrad",))
    with pytest.raises(ValueError, match="ran recipe mxfp4_hadamard with {}, but arm fprop_dgrad_wgrad"):
        load_study(STUDIES["gemm-progression"], tmp_path / "progression-rotated")
    assert wrong.stat().st_mtime_ns == stamp


def test_seeds_vary_init_data_and_rounding_together(tmp_path):
    configs = arm_configs(STUDIES["stiction"], SCALES["gpu-small"], tmp_path)
    assert sorted({c.seed for c in configs}) == [0, 1, 2]
    assert all(c.recipe_overrides["seed"] == c.seed for c in configs)
    assert all(c.stiction_every == (0 if c.recipe == "bf16" else 5) and c.model == "d6" for c in configs)
    moe = arm_configs(STUDIES["gains"], SCALES["gpu-small"], tmp_path)
    assert all(c.model == "moe64" for c in moe)


def test_gpu_scales_graph_the_runs_a_graph_can_replay(tmp_path, monkeypatch):
    """At the GPU scales, on a CUDA machine, every dense run replays its steps from a CUDA graph
    (weight dither included: its seed is a slot of the table); so does every MoE run on sm_90: BF16
    experts on torch._grouped_mm, FP4 experts under NVIDIA's recipe with the counts on the device,
    compiled or not (not under FP4LAB_DEVICE_COUNTS=0); --set cuda_graph=false keeps all eager, the
    smoke scale never graphs, and graphing leaves a run's identity alone."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    stiction = {c.out.split("/")[-1]: c.cuda_graph for c in arm_configs(STUDIES["stiction"], SCALES["gpu-stable"],
                                                                         tmp_path, seeds=(0,))}
    assert stiction == {"bf16-seed0": True, "rtne-seed0": True, "dither-seed0": True, "sr-seed0": True}
    gains = {c.out.split("/")[-1]: c.cuda_graph for c in arm_configs(STUDIES["gains"], SCALES["gpu-stable"],
                                                                      tmp_path, seeds=(0,))}
    arms = ("unit", "embed", "logits", "old_pair", "bf16", "bf16_embed", "bf16_logits", "bf16_old_pair")
    assert gains == {f"{arm}-seed0": True for arm in arms}
    compiled = {c.out.split("/")[-1]: c.cuda_graph for c in arm_configs(STUDIES["gains"], SCALES["gpu-stable"],
                                                                         tmp_path, seeds=(0,), compile=True)}
    assert compiled == gains  # the compiled custom ops take the counts as a tensor too
    monkeypatch.setenv("FP4LAB_DEVICE_COUNTS", "0")  # the counts read on the host by choice
    held = {c.out.split("/")[-1]: c.cuda_graph for c in arm_configs(STUDIES["gains"], SCALES["gpu-stable"],
                                                                     tmp_path, seeds=(0,))}
    assert held == {f"{arm}-seed0": arm.startswith("bf16") for arm in arms}
    monkeypatch.delenv("FP4LAB_DEVICE_COUNTS")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # no torch._grouped_mm
    # (NVIDIA's recipe keeps moe64's last block in BF16: its experts need torch._grouped_mm too)
    assert not any(c.cuda_graph for c in arm_configs(STUDIES["gains"], SCALES["gpu-stable"], tmp_path, seeds=(0,)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert all(c.cuda_graph for c in arm_configs(STUDIES["gap-closers"], SCALES["gpu-small"], tmp_path))
    assert not any(c.cuda_graph for c in arm_configs(STUDIES["gap-closers"], SCALES["gpu-stable"], tmp_path,
                                                     cuda_graph=False))
    asked = {c.out.split("/")[-1]: c.cuda_graph for c in arm_configs(STUDIES["stiction"], SCALES["smoke"], tmp_path,
                                                                      seeds=(0,), cuda_graph=True)}
    assert asked == stiction  # asked for at any scale: still only where a graph can replay the run
    assert all(c.cuda_graph for c in arm_configs(STUDIES["gains"], SCALES["smoke"], tmp_path, arms=("unit",),
                                                 cuda_graph=True))  # FP4 experts, asked for: their counts stay
    assert not any(c.cuda_graph for c in arm_configs(STUDIES["fidelity"], SCALES["smoke"], tmp_path))
    graphed = arm_configs(STUDIES["fidelity"], SCALES["gpu-stable"], tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    eager = arm_configs(STUDIES["fidelity"], SCALES["gpu-stable"], tmp_path)
    assert [c.identity() for c in graphed] == [c.identity() for c in eager]
    assert not any(c.cuda_graph for c in eager) and all(c.cuda_graph for c in graphed)


def test_the_stable_scale_keeps_the_protocol_token_budgets_with_qk_norm(tmp_path):
    def tokens(c):
        return c.steps * c.batch_size * c.seq_len
    for name in ("fidelity", "fidelity-d12"):
        medium = arm_configs(STUDIES[name], SCALES["gpu-medium"], tmp_path / "m")
        stable = arm_configs(STUDIES[name], SCALES["gpu-stable"], tmp_path / "s")
        assert [tokens(c) for c in stable] == [tokens(c) for c in medium]
        assert all(c.model_overrides == {"qk_norm": True} for c in stable)
    # d6 takes twice the batch in half the steps; d12 keeps its batch (twice ended worse)
    d6 = zip(arm_configs(STUDIES["fidelity"], SCALES["gpu-stable"], tmp_path / "s"),
             arm_configs(STUDIES["fidelity"], SCALES["gpu-medium"], tmp_path / "m"))
    assert all(s.batch_size == 2 * m.batch_size for s, m in d6)
    d12 = arm_configs(STUDIES["fidelity-d12"], SCALES["gpu-stable"], tmp_path / "s")
    assert {(c.batch_size, c.steps) for c in d12} == {(32, 1526)}


def _runs(finals: dict[str, tuple], flips: dict[str, tuple] | None = None) -> StudyRuns:
    """{arm: final val per seed} (None: diverged) -> StudyRuns of minimal receipts."""
    def receipt(arm, seed, value):
        status = "ok" if value is not None else "diverged"
        return make_receipt(f"{arm}-seed{seed}", seed=seed, final=value, status=status,
                            flip_rate=[(5, (flips or {}).get(arm, (0.0,) * 9)[seed])])
    return StudyRuns({arm: {s: receipt(arm, s, v) for s, v in enumerate(vals)} for arm, vals in finals.items()})


def _verdict(name, finals, flips=None):
    return STUDIES[name].verdict(_runs(finals, flips))


def test_gains_verdict_needs_intervals_on_the_claimed_side():
    finals = {"unit": (3.00, 3.10, 3.05), "embed": (2.90, 3.01, 2.94), "logits": (3.20, 3.31, 3.24),
              "old_pair": (3.05, 3.14, 3.10)}
    text, verdict = _verdict("gains", finals)
    assert verdict == REPRODUCED and "embed - unit -0.1000" in text
    finals["embed"] = (3.02, 3.08, 3.06)  # one seed better, two worse: the interval covers 0
    assert _verdict("gains", finals)[1] == NOT_RESOLVED
    finals["logits"] = (2.80, 2.91, 2.84)  # logits-only clearly best: contradicted
    assert _verdict("gains", finals)[1] == CONTRADICTED
    finals = {"unit": (3.0,), "embed": (2.5,), "logits": (3.5,), "old_pair": (3.1,)}
    assert _verdict("gains", finals)[1] == NOT_RESOLVED  # one seed resolves nothing, however large


def test_gains_report_the_interaction_with_the_bf16_control():
    finals = {"unit": (3.00, 3.10, 3.05), "embed": (2.90, 3.01, 2.94), "logits": (3.20, 3.31, 3.24),
              "old_pair": (3.05, 3.14, 3.10), "bf16": (2.95, 3.05, 3.00), "bf16_embed": (2.87, 2.98, 2.91)}
    text, _ = _verdict("gains", finals)  # the gain helps NVFP4 0.02 more than BF16, on every seed
    assert "effect on NVFP4 minus its effect on BF16 -0.0200" in text and "helps NVFP4 more" in text


def test_every_arm_is_compared_with_its_own_baseline():
    baselines = STUDIES["expert-lane"].baselines()
    assert baselines["nvfp4_muon"] == "bf16_embed_muon" and baselines["nvfp4_adamw"] == "bf16_embed_adamw"
    assert baselines["bf16_embed_muon"] == "bf16_muon" and baselines["bf16_muon"] == "bf16_adamw"
    assert STUDIES["gains"].baselines()["embed"] == "bf16_embed"
    assert STUDIES["gemm-progression"].baselines()["fprop_dgrad_wgrad"] == "fprop_dgrad"
    finals = {"nvfp4_adamw": (3.30, 3.40, 3.35), "nvfp4_muon": (3.24, 3.34, 3.29),
              "bf16_adamw": (3.50, 3.60, 3.55), "bf16_muon": (3.44, 3.54, 3.49),
              "bf16_embed_adamw": (3.25, 3.35, 3.30), "bf16_embed_muon": (3.20, 3.30, 3.25)}
    text, verdict = _verdict("expert-lane", finals)
    # lane-matched, same gain: +0.04 (against plain BF16 of the lane it reads -0.20; against bf16_adamw -0.26)
    assert verdict == REPRODUCED and "on muon (the better lane) +0.0400" in text
    assert "on muon: -0.2000" in text


def test_progression_verdict_is_a_paired_contrast_of_increments():
    finals = {"bf16": (3.00, 3.10, 3.05), "fprop": (3.01, 3.11, 3.07), "fprop_dgrad": (3.02, 3.12, 3.08),
              "fprop_dgrad_wgrad": (3.20, 3.29, 3.27)}
    assert _verdict("gemm-progression", finals)[1] == REPRODUCED
    finals["fprop_dgrad_wgrad"] = (3.035, 3.12, 3.09)  # Wgrad adds about as little as the others
    assert _verdict("gemm-progression", finals)[1] == NOT_RESOLVED
    finals["fprop"] = (3.20, 3.30, 3.24)  # Fprop the costliest: contradicted
    finals["fprop_dgrad"], finals["fprop_dgrad_wgrad"] = (3.21, 3.31, 3.25), (3.22, 3.32, 3.26)
    assert _verdict("gemm-progression", finals)[1] == CONTRADICTED


def test_wgrad_and_ablation_verdicts_say_what_a_diverged_run_did():
    finals = {"bf16": (3.0, 3.1, 3.05), "none": (3.2, None, 3.25), "sr": (3.21, 3.3, 3.26),
              "random_hadamard": (3.19, 3.29, 3.25), "det_hadamard": (3.1, 3.2, 3.15)}
    text, verdict = _verdict("wgrad-interventions", finals)
    assert verdict == REPRODUCED and "diverged (left out of the pairs): none" in text
    full = (3.10, 3.20, 3.15)
    finals = {"bf16": (3.0, 3.1, 3.05), "full": full, "bf16_late": tuple(v - 0.05 for v in full),
              "no_bf16_layers": (3.15, 3.24, 3.21), "no_rht": (3.13, 3.22, 3.19),
              "no_2d_weights": (3.12, 3.22, 3.17), "no_sr": (3.11, 3.19, 3.16)}
    text, verdict = _verdict("nvidia-ablation", finals)
    assert verdict == NOT_RESOLVED and "3/4 removals hurt" in text  # no_sr: +0.01, -0.01, +0.01


def test_stiction_formats_and_fidelity_verdicts():
    finals = {"bf16": (3.0, 3.1, 3.05), "rtne": (3.2, 3.3, 3.25), "dither": (3.1, 3.21, 3.14),
              "sr": (3.25, 3.33, 3.3)}
    flips = {"rtne": (0.01, 0.011, 0.012), "dither": (0.03, 0.031, 0.033), "sr": (0.02, 0.022, 0.021)}
    assert _verdict("stiction", finals, flips)[1] == REPRODUCED  # dither: a smaller gap
    same = {arm: (0.01, 0.011, 0.012) for arm in flips}  # flips are reported, not judged
    text, verdict = _verdict("stiction", finals, same)
    assert verdict == REPRODUCED and "flips/step" in text and "(not judged)" in text
    finals["dither"] = (3.25, 3.36, 3.3)
    assert _verdict("stiction", finals, flips)[1] == CONTRADICTED  # both arms' losses worse
    finals["dither"] = (3.2, 3.31, 3.24)
    assert _verdict("stiction", finals, flips)[1] == NOT_RESOLVED
    finals = {"nvfp4": (3.0, 3.1, 3.05), "mxfp4": (3.05, 3.14, 3.11)}
    text, verdict = _verdict("formats", finals)
    assert verdict == REPRODUCED and "out of reach" in text
    finals = {"bf16": (3.0, 3.1, 3.05), "nvfp4": (3.01, 3.11, 3.065)}  # +0.3% to +0.5%
    assert _verdict("fidelity", finals)[1] == REPRODUCED
    finals["nvfp4"] = (3.06, 3.16, 3.11)  # +2%
    assert _verdict("fidelity", finals)[1] == CONTRADICTED


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


def test_a_run_finished_elsewhere_counts_as_done_when_only_its_place_differs(tmp_path):
    # a study reuses another study's finished run of the same settings (fidelity's bf16 for
    # gap-closers'); where it was written, its progress bars and threads are not part of the run
    from dataclasses import replace

    from fp4lab.studies.study import _done
    from fp4lab.train.loop import TrainConfig
    cfg = TrainConfig(out=str(tmp_path / "here"), steps=7, lr=1e-3)
    (tmp_path / "here").mkdir()
    other = replace(cfg, out="runs/elsewhere", progress=False, threads=3)
    replace(make_receipt(), config=other.to_dict()).save(tmp_path / "here" / "receipt.json")
    assert _done(cfg)
    replace(make_receipt(), config=replace(other, lr=2e-3).to_dict()).save(tmp_path / "here" / "receipt.json")
    assert not _done(cfg)


def _pooled_rounds(monkeypatch, executor, record) -> list:
    """The runner on ``executor`` (a fake ProcessPoolExecutor) -> a list that gets record(slots)
    for each pooled round it runs."""
    from fp4lab.studies import study as study_module
    rounds, pooled = [], study_module._run_pooled
    monkeypatch.setattr(study_module, "_run_pooled", lambda todo, slots, *a: (rounds.append(record(slots)),
                                                                             pooled(todo, slots, *a))[1])
    monkeypatch.setattr(study_module, "ProcessPoolExecutor", executor)
    return rounds


def test_runs_out_of_memory_beside_others_are_retried_with_fewer_at_once(tmp_path, monkeypatch):
    # runs sharing a GPU can run out of memory at start; the runner tries those again in rounds of
    # half as many at once, down to one; other failures, a dead worker's included, are reported,
    # and a dead worker takes no other run with it (each run has a pool of its own)
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from fp4lab.studies import study as study_module
    monkeypatch.setattr(study_module.torch.cuda, "device_count", lambda: 0)  # (on a GPU host too)
    calls, pools = [], []

    class InlineExecutor:  # ProcessPoolExecutor's contract, run inline (monkeypatching does not cross spawn)
        def __init__(self, workers, mp_context=None, max_tasks_per_child=None):
            assert workers == 1 and max_tasks_per_child == 1  # its process exits with the run, GPU memory too
            self.submits = 0
            pools.append(self)
        def shutdown(self, wait=True):
            self.closed = True
        def submit(self, fn, cfg, card):
            assert card is None and not self.submits  # no GPU here: not pinned; one run per pool
            self.submits += 1
            future = Future()
            if cfg.out.endswith("mxfp4_hadamard-seed0"):
                future.set_exception(BrokenProcessPool("a worker died"))
            else:
                future.set_result(fn(cfg, card))
            return future

    def fake_run(cfg):
        calls.append((cfg.out, len(rounds)))
        if cfg.out.endswith(("mxfp4-seed0", "nvfp4_plain-seed0")) and len(rounds) == 1:
            return f"{cfg.out}: FAILED (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"
        if cfg.out.endswith("/nvfp4-seed0"):
            return f"{cfg.out}: FAILED (ValueError: bad data)"
        return f"{cfg.out}: ok, final val 1.0"
    rounds = _pooled_rounds(monkeypatch, InlineExecutor, len)
    monkeypatch.setattr(study_module, "_run_one", fake_run)
    with pytest.raises(RuntimeError, match="2 of 5 runs failed") as failure:
        run_study(STUDIES["fidelity"], SCALES["smoke"], tmp_path, jobs=4)
    assert "nvfp4-seed0: FAILED (ValueError" in str(failure.value)
    assert "mxfp4_hadamard-seed0: FAILED (BrokenProcessPool" in str(failure.value)
    assert rounds == [4, 2]  # the two crowded runs: a second round, half as many at once
    retried = sorted(out.rsplit("/", 1)[1] for out, n in calls if n == 2)
    assert retried == ["mxfp4-seed0", "nvfp4_plain-seed0"]
    assert [out for out, _ in calls].count(str(tmp_path / "nvfp4-seed0")) == 1  # not retried
    assert len(pools) == 7 and all(pool.closed for pool in pools)  # 5 runs and 2 retries, each pool shut


def test_runs_spread_over_every_visible_gpu_one_card_each(tmp_path, monkeypatch):
    # a host of several GPUs: jobs runs per card, each worker pinned to one card (the parent's
    # CUDA_VISIBLE_DEVICES entries kept), and a run starts on the card whose run just ended
    from concurrent.futures import Future

    from fp4lab.studies import study as study_module
    monkeypatch.setattr(study_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-ab12,7")  # more entries than cards: the first ones
    assert study_module._gpu_slots(2) == ["3", "GPU-ab12", "3", "GPU-ab12"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert study_module._gpu_slots(1) == ["0", "1"]
    monkeypatch.setattr(study_module.torch.cuda, "device_count", lambda: 1)
    assert study_module._gpu_slots(3) == [None] * 3  # one card (or none): workers are not pinned

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "parent")
    seen, pending, busy, most = [], [], {}, []

    class SlowPool:  # a run ends only when the runner waits, the newest first
        def __init__(self, workers, mp_context=None, max_tasks_per_child=None):
            pass
        def shutdown(self, wait=True):
            pass
        def submit(self, fn, cfg, card):
            busy[card] = busy.get(card, 0) + 1
            most.append(max(busy.values()))
            pending.append((Future(), fn, cfg, card))
            return pending[-1][0]

    def newest_done(futures, return_when):
        future, fn, cfg, card = pending.pop()
        future.set_result(fn(cfg, card))
        busy[card] -= 1
        return SimpleNamespace(done={future}, not_done=set(futures) - {future})

    def fake_run(cfg):
        seen.append(study_module.os.environ["CUDA_VISIBLE_DEVICES"])
        return f"{cfg.out}: ok, final val 1.0"
    monkeypatch.setattr(study_module, "ProcessPoolExecutor", SlowPool)
    monkeypatch.setattr(study_module, "wait", newest_done)
    monkeypatch.setattr(study_module, "_run_one", fake_run)
    lines = []
    todo = arm_configs(STUDIES["fidelity"], SCALES["smoke"], tmp_path)
    assert study_module._run_pooled(todo, ["0", "1"], lines.append, print) == []
    assert len(lines) == len(todo) == 5
    assert seen == ["1", "1", "1", "1", "0"]  # card 1's runs end first: card 1 takes each next run
    assert max(most) == 1  # never two runs on one card when each card has one slot
    # a worker where CUDA was set up before the pin still sees every card: its run fails, saying why
    monkeypatch.setattr(study_module.torch.cuda, "device_count", lambda: 2)
    assert "saw 2 cards when pinned to card 1" in study_module._run_on(todo[0], "1")


def test_on_several_gpus_a_run_out_of_memory_alone_ends_after_one_round_per_card(tmp_path, monkeypatch):
    # jobs=1 on two cards is a pooled round of one run per card; a run still out of memory there
    # runs once more alone (waiting out other processes' runs), then is reported: no endless rounds
    from concurrent.futures import Future

    from fp4lab.studies import study as study_module
    monkeypatch.setattr(study_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tries = {}

    class InlineExecutor:
        def __init__(self, workers, mp_context=None, max_tasks_per_child=None):
            pass
        def shutdown(self, wait=True):
            pass
        def submit(self, fn, cfg, card):
            future = Future()
            future.set_result(fn(cfg, card))
            return future

    def fake_run(cfg):
        tries[cfg.out] = tries.get(cfg.out, 0) + 1
        assert tries[cfg.out] <= 3, "pooled rounds without end"
        if cfg.out.endswith(("/mxfp4-seed0", "/nvfp4-seed0")):  # two: one left would run alone anyway
            return f"{cfg.out}: FAILED (OutOfMemoryError: CUDA out of memory. Tried to allocate 90.00 GiB)"
        return f"{cfg.out}: ok, final val 1.0"
    rounds = _pooled_rounds(monkeypatch, InlineExecutor, list)
    monkeypatch.setattr(study_module, "_run_on", lambda cfg, card: fake_run(cfg))  # (no pinning in-process)
    monkeypatch.setattr(study_module, "_run_one", fake_run)
    with pytest.raises(RuntimeError, match="2 of 5 runs failed"):
        run_study(STUDIES["fidelity"], SCALES["smoke"], tmp_path, jobs=1)
    assert rounds == [["0", "1"]]  # run_study asked for one slot per card, once
    assert tries[str(tmp_path / "mxfp4-seed0")] == tries[str(tmp_path / "nvfp4-seed0")] == 2  # pooled, then alone


def test_a_run_crowded_out_by_other_processes_waits_and_tries_again(tmp_path, monkeypatch):
    # one at a time, a run that meets another process's runs on the card (another study, another
    # campaign) cannot be helped by fewer at once: it waits for them; out of memory alone, it fails
    from fp4lab.studies import study as study_module
    crowd = ("FAILED (OutOfMemoryError: CUDA out of memory. Tried to allocate 48.00 MiB. Including non-PyTorch "
             "memory, this process has 15.84 GiB memory in use. Process 1964 has 19.77 GiB memory in use.)")
    alone = "FAILED (OutOfMemoryError: CUDA out of memory. Tried to allocate 90.00 GiB. this process has 1.00 GiB memory in use.)"
    tries, sleeps = {}, []

    def fake_run(cfg):
        n = tries[cfg.out] = tries.get(cfg.out, 0) + 1
        if cfg.out.endswith("/bf16-seed0"):
            return f"{cfg.out}: {crowd}" if n <= 2 else f"{cfg.out}: ok, final val 1.0"
        if cfg.out.endswith("/nvfp4-seed0"):
            return f"{cfg.out}: {alone}"
        return f"{cfg.out}: ok, final val 1.0"
    monkeypatch.setattr(study_module, "_run_one", fake_run)
    monkeypatch.setattr(study_module.time, "sleep", sleeps.append)
    with pytest.raises(RuntimeError, match="1 of 5 runs failed") as failure:
        run_study(STUDIES["fidelity"], SCALES["smoke"], tmp_path, jobs=1)
    assert tries[str(tmp_path / "bf16-seed0")] == 3 and sleeps == [study_module.CROWD_WAIT_S] * 2
    assert tries[str(tmp_path / "nvfp4-seed0")] == 1 and "nvfp4-seed0: FAILED (OutOfMemoryError" in str(failure.value)
    # what torch's message must say for a wait: this process apart from others that hold at least
    # the allocation asked for (another process's 300 MiB does not explain a 2 GiB request)
    small = "FAILED (OutOfMemoryError: Tried to allocate 2.00 GiB. this process has 70.00 GiB memory in use. Process 7 has 300.00 MiB memory in use.)"
    unnamed = "FAILED (OutOfMemoryError: Tried to allocate 48.00 MiB. Process 7 has 19.00 GiB memory in use.)"
    assert study_module._crowded_by_others(f"x: {crowd}")
    assert not study_module._crowded_by_others(f"x: {small}") and not study_module._crowded_by_others(f"x: {unnamed}")
    # a card that stays full: the run is reported after CROWD_TRIES waits, not retried forever
    monkeypatch.setattr(study_module, "_run_one", lambda cfg: f"{cfg.out}: {crowd}")
    sleeps.clear()
    cfg = arm_configs(STUDIES["fidelity"], SCALES["smoke"], tmp_path)[0]
    assert study_module._crowded_by_others(study_module._run_alone(cfg, print))
    assert len(sleeps) == study_module.CROWD_TRIES


def test_a_run_whose_resume_fails_is_reported_not_raised(tmp_path, monkeypatch):
    from fp4lab.studies import study as study_module
    cfg = arm_configs(STUDIES["fidelity"], SCALES["smoke"], tmp_path)[0]
    (tmp_path / "bf16-seed0" / "checkpoint").mkdir(parents=True)

    def fails(cfg, **kw):
        raise RuntimeError("CUDA error: out of memory")
    monkeypatch.setattr(study_module, "train", fails)
    line = study_module._run_one(cfg)
    assert line.endswith("FAILED (RuntimeError: CUDA error: out of memory)") and study_module._out_of_memory(line)


def test_gap_closers_verdict_and_the_goal_line():
    finals = {"bf16": (3.0, 3.1, 3.05), "nvfp4": (3.08, 3.18, 3.13), "four_over_six": (3.05, 3.151, 3.099),
              "late_bf16_all": (3.005, 3.106, 3.054)}
    text, verdict = _verdict("gap-closers", finals)
    assert verdict == REPRODUCED  # -0.03 on every seed
    assert "late_bf16_all - nvfp4" in text and "closest to BF16: late_bf16_all" in text and "met" in text
    assert "not met" not in text  # +0.13% to +0.20%: the whole interval is under 0.5%
    finals["four_over_six"] = (3.09, 3.17, 3.14)  # +0.01, -0.01, +0.01
    assert _verdict("gap-closers", finals)[1] == NOT_RESOLVED
    finals["late_bf16_all"] = (3.03, 3.13, 3.08)  # +1%
    assert "not met" in _verdict("gap-closers", finals)[0]


@pytest.mark.parametrize("attn, more", [("keep_attn", "keep_more"),
                                        ("stacked_keep_attn_late30", "stacked_keep_more_late30")])
def test_keep_attn_keeps_the_same_bf16_share_as_keep_more_elsewhere(tmp_path, attn, more):
    """gap-closers' keep_attn and keep_more put the same third of d6's block linears in BF16 (every
    GEMM's FLOPs split alike), keep_more as the last two blocks, keep_attn as every block's
    attention projections: the two arms differ only in where that third sits (and so do the
    stacked arms built on them, each judged against the other)."""
    from fp4lab.nn import model_config
    from fp4lab.nn.model import GPT
    from fp4lab.nn.swap import quantize_model
    from fp4lab.train.run import recipe_of

    configs = {Path(c.out).name.removesuffix("-seed0"): c for c in arm_configs(
        STUDIES["gap-closers"], SCALES["gpu-stable"], tmp_path, seeds=(0,), arms=(more, attn))}
    keep_more, keep_attn = (configs[more], configs[attn])
    overrides = [{k: v for k, v in c.recipe_overrides.items() if k not in ("keep_first", "keep_last", "keep_bf16",
                                                                           "keep_fraction")} for c in (keep_more, keep_attn)]
    assert keep_more.recipe == keep_attn.recipe and overrides[0] == overrides[1]  # nothing else differs
    assert {a.name: a.baseline for a in STUDIES["gap-closers"].arms}[attn] == more
    configs = {"keep_more": keep_more, "keep_attn": keep_attn}
    kept, fractions = {}, {}
    for arm, cfg in configs.items():
        model = GPT(model_config(cfg.model, vocab_size=512, seq_len=64, **cfg.model_overrides))
        quantize_model(model, recipe_of(cfg))
        kept[arm] = {name for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and getattr(m, "recipe", None) is None}
        fractions[arm] = model.fp4_coverage["flop_fraction"]
    for gemm, split in fractions["keep_more"].items():
        assert fractions["keep_attn"][gemm] == pytest.approx(split)
    block_kept = {arm: {n for n in names if n.startswith("blocks.")} for arm, names in kept.items()}
    assert block_kept["keep_more"] == {f"blocks.{i}.{p}" for i in (4, 5)
                                       for p in ("attn.qkv", "attn.proj", "ffn.gate", "ffn.up", "ffn.down")}
    assert block_kept["keep_attn"] == {f"blocks.{i}.attn.{p}" for i in range(6) for p in ("qkv", "proj")}
