"""The README's main command: BF16 at two seeds (the noise band), NVFP4 and MXFP4 at equal BF16 coverage."""

from __future__ import annotations

from fp4lab.nn.recipe import NVIDIA_KEEP
from fp4lab.train.demo import demo_configs, noise_verdicts, run_demo
from tests.train.receipts import make_receipt


def test_demo_runs_pair_seeds_and_keep_equal_bf16_blocks(tmp_path):
    configs = demo_configs(tmp_path, gpu=True)
    assert [(c.recipe, c.seed) for c in configs] == [("bf16", 0), ("nvfp4", 0), ("mxfp4", 0), ("bf16", 1)]
    fp4 = [c for c in configs if c.recipe != "bf16"]
    assert all(c.recipe_overrides["keep_fraction"] == list(NVIDIA_KEEP) for c in fp4)
    assert all(c.recipe_overrides["seed"] == c.seed for c in configs)


def _receipt(name, final):
    return make_receipt(name, final=final)


def test_a_gap_inside_the_noise_band_is_not_resolved():
    lines = noise_verdicts([_receipt("bf16-seed0", 3.00), _receipt("nvfp4-seed0", 2.98),
                            _receipt("mxfp4-seed0", 3.10), _receipt("bf16-seed1", 3.03)])
    assert lines[0] == "noise band (BF16 seed 1 vs seed 0): 0.0300"
    assert "nvfp4-seed0: gap to BF16 -0.0200" in lines[1] and "not resolved" in lines[1]
    assert "mxfp4-seed0: gap to BF16 +0.1000" in lines[2] and "worse than BF16, beyond" in lines[2]


def test_the_demo_runs_end_to_end_on_a_small_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "cache"))
    text, files = run_demo(tmp_path / "demo", gpu=False, steps=3, eval_every=3, data_max_bytes=300_000,
                           vocab_size=512, batch_size=4, seq_len=64, warmup=1)
    assert {f.name for f in files} == {"report.md", "loss.png", "gap.png"}
    assert "noise band (BF16 seed 1 vs seed 0)" in text and "nvfp4-seed0: gap to BF16" in text
    assert "- noise band" in (tmp_path / "demo" / "report.md").read_text()
