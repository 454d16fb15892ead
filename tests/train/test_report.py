"""Reports pair every gap by seed, with synthetic receipts (no training needed)."""

from __future__ import annotations

import json

import pytest

from fp4lab.train.receipt import Receipt
from fp4lab.train.report import (arm_table, gap_table, paired_gap, provenance, report, runs_by_arm, served_bf16,
                                 served_fp4, served_lines)
from tests.train.receipts import make_receipt as receipt
from tests.train.receipts import receipt_dict


def test_each_seed_is_compared_with_its_own_baseline_seed():
    runs = [receipt("bf16-seed0", "bf16", 0, 3.00), receipt("bf16-seed1", "bf16", 1, 3.10),
            receipt("nvfp4-seed0", "nvfp4", 0, 3.02), receipt("nvfp4-seed1", "nvfp4", 1, 3.13),
            receipt("nvfp4-seed2", "nvfp4", 2, 3.05)]
    table = gap_table(runs)
    row = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert "+0.0200 vs bf16-seed0" in row["nvfp4-seed0"]
    assert "+0.0300 vs bf16-seed1" in row["nvfp4-seed1"]  # not against seed 0 (which would read +0.1300)
    assert "no bf16 run for seed 2" in row["nvfp4-seed2"]
    assert "vs" not in row["bf16-seed1"].split(" | ")[5]  # the baseline has no gap to itself
    iv = paired_gap(runs_by_arm(runs)["nvfp4"], runs_by_arm(runs)["bf16"])
    assert iv.seeds == (0, 1) and iv.mean == pytest.approx(0.025)
    assert row["nvfp4-seed0"].split(" | ")[8] == "1.00"  # tokens/s against its baseline's (both 100)


def test_a_graphed_run_beside_an_eager_baseline_gets_no_speed_ratio():
    graphed = receipt_dict("nvfp4-seed0", "nvfp4", 0, 3.02)
    graphed["config"]["cuda_graph"], graphed["tokens_per_s"] = True, 250.0
    table = gap_table([receipt("bf16-seed0", "bf16", 0, 3.00), Receipt.from_dict(graphed)])
    cells = table.splitlines()[-1].split(" | ")
    assert cells[7:9] == ["250 (graphed)", "-"]  # not 2.50: the graph's speed-up is not the recipe's


def test_a_diverged_seed_is_left_out_of_the_pairs_and_said():
    runs = runs_by_arm([receipt("bf16-seed0", "bf16", 0, 3.0), receipt("bf16-seed1", "bf16", 1, 3.1),
                        receipt("mxfp4-seed0", "mxfp4", 0, 3.05),
                        receipt("mxfp4-seed1", "mxfp4", 1, None, status="diverged")])
    iv = paired_gap(runs["mxfp4"], runs["bf16"])
    assert iv.seeds == (0,)
    text = arm_table(runs, {"bf16": "bf16", "mxfp4": "bf16"})
    assert "1 of 2 diverged" in text and "1 seed: not resolved" in text


def test_two_runs_of_one_arm_and_seed_are_an_error():
    with pytest.raises(ValueError, match="two runs of arm 'bf16' with seed 0"):
        runs_by_arm([receipt("bf16", "bf16", 0, 3.0), receipt("bf16-seed0", "bf16", 0, 3.0)])


def test_report_writes_intervals_and_band_plots(tmp_path):
    finals = {"bf16": (3.00, 3.10, 3.05), "nvfp4": (3.03, 3.12, 3.09)}
    dirs = []
    for arm, values in finals.items():
        for seed, value in enumerate(values):
            d = tmp_path / f"{arm}-seed{seed}"
            d.mkdir()
            (d / "receipt.json").write_text(json.dumps(receipt_dict(d.name, arm, seed, value)))
            dirs.append(d)
    text, files = report(dirs, tmp_path / "out")
    assert {f.name for f in files} == {"report.md", "loss.png", "gap.png"}
    # gaps 0.03, 0.02, 0.04: mean 0.03, sd 0.01, half 4.303 * 0.01 / sqrt(3) = 0.0248
    assert "| nvfp4 | nvfp4 | 3 |" in text and "+0.0300 [+0.0052, +0.0548]" in text and "| worse |" in text
    with pytest.raises(ValueError, match="baseline arm 'fp8'"):
        report(dirs, tmp_path / "out", baseline="fp8")


def test_provenance_names_every_device_and_commit_once():
    # a study's arms can come from campaigns on different commits (and machines): none may hide
    runs = [receipt_dict(f"bf16-seed{s}", seed=s) for s in (0, 1)] + [receipt_dict("nvfp4-seed0", "nvfp4")]
    runs[2]["git"]["sha"] = "ab" * 20
    runs[2]["device"] = "NVIDIA H200"
    text = provenance([Receipt.from_dict(r) for r in runs])
    assert text == f"device cpu, NVIDIA H200; git {'0' * 12}, {'ab' * 6}"


def test_an_fp4_gap_splits_into_its_forward_and_its_weights_by_hand():
    # seed 0: FP4 forward 3.05, the same weights in BF16 3.02, BF16's run 3.00; seed 1: 3.16, 3.12, 3.10
    runs = runs_by_arm([receipt("bf16-seed0", "bf16", 0, 3.00), receipt("bf16-seed1", "bf16", 1, 3.10),
                        receipt("nvfp4-seed0", "nvfp4", 0, 3.05, served=3.02),
                        receipt("nvfp4-seed1", "nvfp4", 1, 3.16, served=3.12)])
    lines = served_lines(runs, {"nvfp4": "bf16", "bf16": "bf16"})
    (row,) = [line for line in lines if line.startswith("| nvfp4 |")]
    cells = row.split(" | ")
    assert cells[1] == "2" and cells[2].startswith("3.0700 ± ")
    assert cells[3].startswith("+0.0350 [")  # (0.03 + 0.04) / 2: the forward's share
    assert cells[4].startswith("+0.0200 [")  # (0.02 + 0.02) / 2: the weights' share, sd 0
    assert "[+0.0200, +0.0200]" in cells[4]
    # receipts without the evaluation (schema 2, BF16 arms) add nothing
    assert served_lines(runs_by_arm([receipt("bf16-seed0", "bf16", 0, 3.0), receipt("nvfp4-seed0", "nvfp4", 0, 3.1)]),
                        {"nvfp4": "bf16"}) == []


def test_an_arm_against_an_fp4_baseline_gets_no_split():
    # the baseline's own FP4 forward would hide in the weights' column: no row rather than a wrong one
    runs = runs_by_arm([receipt("fprop-seed0", "fprop", 0, 3.05, served=3.02),
                        receipt("fprop_dgrad-seed0", "fprop_dgrad", 0, 3.08, served=3.03),
                        receipt("nvfp4-seed0", "nvfp4", 0, 3.1, served=float("nan"))])
    lines = served_lines(runs, {"fprop_dgrad": "fprop", "nvfp4": "fprop"})
    assert not [line for line in lines if line.startswith(("| fprop_dgrad |", "| nvfp4 |"))]
    # compared instead with both served in BF16 (nvfp4's NaN evaluation leaves it out)
    (row,) = [line for line in lines if line.startswith("| fprop_dgrad - fprop |")]
    assert row.split(" | ")[3].startswith("+0.0100 (1 seed") and not [line for line in lines if "| nvfp4 - " in line]


def test_a_late_bf16_switch_is_compared_at_the_same_forward():
    """A late switch ends with a BF16 forward: its final loss is already a BF16-forward score, so
    against NVIDIA's recipe it is compared with that recipe's weights served in BF16, not with its
    FP4 forward (which would credit the switch with the evaluation's precision)."""
    late = [receipt_dict(f"late-seed{s}", "nvfp4", s, final) for s, final in ((0, 3.00), (1, 3.11))]
    old = receipt_dict("old-seed0", "nvfp4", 0, 3.2)  # an FP4 forward without the evaluation: no score
    for r in late:
        r["recipe"].update(bf16_after=0.8, bf16_scope="all")
    runs = runs_by_arm([receipt("bf16-seed0", "bf16", 0, 2.95), receipt("bf16-seed1", "bf16", 1, 3.05),
                        receipt("nvfp4-seed0", "nvfp4", 0, 3.08, served=3.02),
                        receipt("nvfp4-seed1", "nvfp4", 1, 3.19, served=3.12),
                        *map(Receipt.from_dict, late), Receipt.from_dict(old)])
    assert [served_bf16(r) for r in runs["late"].values()] == [3.00, 3.11] and served_bf16(runs["old"][0]) is None
    lines = served_lines(runs, {"nvfp4": "bf16", "late": "nvfp4", "old": "nvfp4"})
    (row,) = [line for line in lines if line.startswith("| late - nvfp4 |")]
    cells = row.split(" | ")
    assert cells[3].startswith("-0.0150 [")  # (-0.02 - 0.01) / 2, not (-0.08 - 0.08) / 2 against the FP4 forward
    assert cells[5].startswith("+0.0550 [")  # the weights against BF16: (0.05 + 0.06) / 2
    assert not [line for line in lines if line.startswith("| old - ")]


def test_a_late_switch_served_in_fp4_is_compared_with_its_fp4_baseline_as_run():
    """A late switch's receipt also scores its weights through the FP4 forward it left: against
    NVIDIA's recipe as run (an FP4 forward too), paired by seed; a switched run without that
    score (an older receipt) is left out, and arms that never switched get no such row."""
    late = [receipt_dict(f"late-seed{s}", "nvfp4", s, final, served_fp4=fp4)
            for s, final, fp4 in ((0, 3.00, 3.05), (1, 3.11, 3.20))]
    old = receipt_dict("late-seed2", "nvfp4", 2, 3.0)  # switched, before the FP4-forward score existed
    for r in (*late, old):
        r["recipe"].update(bf16_after=0.8, bf16_scope="forward")
    runs = runs_by_arm([receipt("bf16-seed0", "bf16", 0, 2.95), receipt("bf16-seed1", "bf16", 1, 3.05),
                        receipt("bf16-seed2", "bf16", 2, 3.0),
                        *(receipt(f"nvfp4-seed{s}", "nvfp4", s, loss, served=loss - 0.06)
                          for s, loss in ((0, 3.08), (1, 3.19), (2, 3.1))),
                        *(receipt(f"fos-seed{s}", "nvfp4", s, 3.1) for s in (0, 1)),
                        *map(Receipt.from_dict, (*late, old))])
    assert [served_fp4(r) for r in runs["late"].values()] == [3.05, 3.20, None]
    assert served_fp4(runs["nvfp4"][0]) == 3.08  # its last forward was FP4: its own final loss
    lines = served_lines(runs, {"nvfp4": "bf16", "late": "nvfp4", "fos": "nvfp4"})
    (row,) = [line for line in lines if line.startswith("| late - nvfp4 |") and line.count("|") == 6]  # FP4 table
    cells = row.split(" | ")
    assert cells[1] == "2" and cells[3].startswith("-0.0100 [")  # (-0.03 + 0.01) / 2: seed 2 has no score
    assert not [line for line in lines if line.startswith("| fos - ") and line.count("|") == 6]


def test_an_fp4_baseline_without_its_bf16_evaluation_gets_no_split():
    # an older receipt of an FP4 baseline has no BF16-forward score: its own FP4 forward must not
    # be read as a BF16 baseline's loss (the recipe says what it ran)
    runs = runs_by_arm([receipt("fprop-seed0", "fprop", 0, 3.05), receipt("fprop-seed1", "fprop", 1, 3.06),
                        receipt("fprop_dgrad-seed0", "fprop_dgrad", 0, 3.08, served=3.03),
                        receipt("fprop_dgrad-seed1", "fprop_dgrad", 1, 3.09, served=3.04)])
    assert served_lines(runs, {"fprop_dgrad": "fprop"}) == []  # no split, and no BF16 score to pair with


def test_a_switch_at_the_very_end_is_still_an_fp4_forward():
    # the final evaluation runs at the last step's progress, (steps - 1) / steps: bf16_after = 1.0
    # never switches, so its final loss is an FP4-forward score, not a BF16 one
    r = receipt_dict("late-seed0", "nvfp4", 0, 3.2)
    r["recipe"].update(bf16_after=1.0, bf16_scope="all")
    assert served_bf16(Receipt.from_dict(r)) is None
    r["recipe"].update(bf16_after=0.95)  # step 19 of 20 (progress 0.95) ran in BF16
    assert served_bf16(Receipt.from_dict(r)) == 3.2
    r["status"] = "diverged"
    assert served_bf16(Receipt.from_dict(r)) is None
