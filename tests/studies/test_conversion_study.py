"""The conversion study runs, pins its inputs, and its table is rebuilt from the receipt alone."""

import json

from fp4lab.cli import main
from fp4lab.studies import conversion


def test_smoke_run_writes_receipt_and_table(tmp_path):
    receipt = conversion.run(tmp_path, names=["gaussian", "spread_18", "single_outlier"])
    saved = json.loads((tmp_path / "receipt.json").read_text())
    assert saved == receipt and (tmp_path / "table.md").read_text() == conversion.report(saved)
    rows = {r["scenario"]: r for r in saved["rows"]}
    assert rows["gaussian"]["mse"]["hybrid"] == 0 and rows["spread_18"]["spread"] == 18
    assert rows["single_outlier"]["best_chose"] == "requant"  # the dominant-outlier case
    assert len(rows["gaussian"]["sha256"]) == 64


def test_inputs_are_pinned():
    assert len(conversion.SCENARIOS) == 27
    a, b = conversion.scenario_input("pareto"), conversion.scenario_input("pareto")
    assert conversion._sha256(a) == conversion._sha256(b)


def test_cli_lists_the_study(capsys):
    assert main(["study", "--list"]) == 0
    assert "conversion" in capsys.readouterr().out
