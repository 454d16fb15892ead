"""The typed receipt: round trips, refuses corrupt files by file and key, reads every committed receipt."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp4lab.train.receipt import RECEIPT_SCHEMA, Eval, Receipt, kernels_backend
from tests.train.receipts import receipt_dict

RESULTS = Path(__file__).resolve().parents[2] / "results"


def test_a_receipt_round_trips_through_its_json():
    data = receipt_dict("nvfp4-seed1", "nvfp4", 1, 3.2, flip_rate=[(5, 0.01)])
    receipt = Receipt.from_dict(data)
    assert receipt.to_dict() == data and Receipt.from_dict(receipt.to_dict()) == receipt
    assert receipt.evals[-1] == Eval(step=20, tokens=2000, val_loss=3.2) and receipt.final.steps == 20
    assert receipt.flip_rate == ((5, 0.01),) and receipt.data.identity == {"sha256": None}
    assert receipt["final"]["val_loss"] == 3.2  # the JSON form, for scripts written against dicts


def test_save_and_load_keep_unknown_top_level_keys(tmp_path):
    data = {**receipt_dict(), "note": "rerun on the new node"}
    receipt = Receipt.from_dict(data)
    assert receipt.extra == {"note": "rerun on the new node"}
    receipt.save(tmp_path / "receipt.json")
    assert Receipt.load(tmp_path) == receipt and json.loads((tmp_path / "receipt.json").read_text()) == data
    assert not list(tmp_path.glob(".receipt.json.tmp-*"))


def _corrupt(tmp_path, change) -> Path:
    data = copy.deepcopy(receipt_dict())
    change(data)
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("final"), "lacks key 'final'"),
    (lambda d: d["final"].pop("steps"), "lacks key 'final.steps'"),
    (lambda d: d["final"].update(steps="20"), "key 'final.steps' must be int, got str"),
    (lambda d: d["evals"][1].update(val_loss=None), r"key 'evals\[1\].val_loss' must be float, got NoneType"),
    (lambda d: d.update(train_curve=[[10, 4.1, 0]]), r"key 'train_curve\[0\]' must be a list \[int, float\], got list"),
    (lambda d: d.update(seed=True), "key 'seed' must be int, got bool"),
    (lambda d: d.update(tokens_per_s="fast"), "key 'tokens_per_s' must be float or null, got str"),
    (lambda d: d.update(data="synthetic"), "key 'data' must be an object, got str"),
    (lambda d: d.update(status="crashed"), "status must be one of"),
    (lambda d: d.update(schema=RECEIPT_SCHEMA + 1), "newer fp4lab"),
    (lambda d: d.pop("schema"), "not a training receipt"),
])
def test_a_corrupt_receipt_is_refused_naming_the_file_and_key(tmp_path, change, message):
    path = _corrupt(tmp_path, change)
    with pytest.raises(ValueError, match=message) as err:
        Receipt.load(path)
    assert str(path) in str(err.value)


def test_unreadable_or_missing_receipts_are_clear_errors(tmp_path):
    (tmp_path / "receipt.json").write_text('{"schema": 2, "name": ')
    with pytest.raises(ValueError, match="not a readable receipt"):
        Receipt.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="did the run finish"):
        Receipt.load(tmp_path / "elsewhere")


def test_a_schema_1_receipt_is_upgraded_on_read():
    old = receipt_dict()
    old["schema"] = 1
    del old["backend"], old["coverage"], old["final"]["bf16_forward_val_loss"], old["final"]["fp4_forward_val_loss"]
    for key in ("eot_id", "split", "epochs"):  # the receipts before the document split
        del old["data"][key]
    receipt = Receipt.from_dict(old)
    assert receipt.backend == "unknown" and receipt.coverage is None
    assert (receipt.data.eot_id, receipt.data.split, receipt.data.epochs) == (None, None, None)
    assert receipt.final.bf16_forward_val_loss is None and receipt.final.fp4_forward_val_loss is None
    assert receipt.to_dict()["schema"] == RECEIPT_SCHEMA == 5


def test_a_schema_2_receipt_is_upgraded_on_read():
    old = receipt_dict(final=2.5)
    old["schema"] = 2
    del old["final"]["bf16_forward_val_loss"], old["final"]["fp4_forward_val_loss"]  # schema 2 evaluated neither
    with pytest.raises(ValueError, match="bf16_forward_val_loss"):  # a schema-3 receipt must have it
        Receipt.from_dict({**old, "schema": 3})
    receipt = Receipt.from_dict(old)
    assert receipt.final.bf16_forward_val_loss is None and receipt.final.val_loss == 2.5
    assert receipt.to_dict()["final"]["bf16_forward_val_loss"] is None


def test_a_schema_3_receipt_is_upgraded_on_read():
    old = receipt_dict(final=2.5, served=2.4)
    old["schema"] = 3
    del old["final"]["fp4_forward_val_loss"]  # schema 3 did not evaluate a late switch's FP4 forward
    with pytest.raises(ValueError, match="fp4_forward_val_loss"):  # a schema-4 receipt must have it
        Receipt.from_dict({**old, "schema": 4})
    receipt = Receipt.from_dict(old)
    assert receipt.final.fp4_forward_val_loss is None and receipt.final.bf16_forward_val_loss == 2.4
    assert receipt.to_dict()["schema"] == 5 and receipt.to_dict()["final"]["fp4_forward_val_loss"] is None


def test_a_schema_4_receipt_reads_as_it_is():
    # schema 5 lets git.dirty be null (unknown); a schema-4 receipt's bool is read unchanged
    old = {**receipt_dict(), "schema": 4}
    old["git"] = {**old["git"], "dirty": True, "diff_sha256": "ab" * 32}
    receipt = Receipt.from_dict(old)
    assert receipt.git.dirty is True and receipt.to_dict()["schema"] == 5


def test_every_committed_receipt_loads():
    paths = sorted(RESULTS.glob("**/receipt.json"))
    training = [p for p in paths if "study" not in json.loads(p.read_text())]  # not the conversion table's
    assert len(training) >= 90 and len(paths) - len(training) == 1
    receipts = [Receipt.load(p) for p in training]
    for path, receipt in zip(training, receipts):
        assert receipt.status == "ok" and receipt.final.val_loss is not None, path
        assert receipt.evals[-1].val_loss == receipt.final.val_loss, path
        assert receipt.backend in ("unknown", "triton", "reference"), path
    with pytest.raises(ValueError, match="conversion study's receipt"):
        Receipt.load(RESULTS / "conversion" / "receipt.json")


def test_the_backend_is_recorded_and_never_raises(monkeypatch):
    cpu = torch.device("cpu")
    assert kernels_backend(cpu) == "reference"  # AUTO runs the reference on CPU tensors
    monkeypatch.setenv("FP4LAB_BACKEND", "no-such-backend")
    assert kernels_backend(cpu) == "unknown"


def test_a_tree_without_its_commit_records_the_named_sha_and_no_dirty_flag(monkeypatch):
    # the device machine gets the tree without our .git: FP4LAB_GIT_SHA names the commit, and a
    # diff against whatever git finds there would say nothing about the code that ran
    from fp4lab.train import receipt as receipt_module
    monkeypatch.setenv("FP4LAB_GIT_SHA", "0123abc")
    monkeypatch.setattr(receipt_module.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout="f" * 40 + "\n"))
    assert receipt_module._git() == {"sha": "0123abc", "dirty": None, "diff_sha256": None}
    # the named commit is the tree's own: its diff is read as usual
    outputs = iter(["0123abcdef" + "0" * 30 + "\n", "diff --git a/x b/x\n"])
    monkeypatch.setattr(receipt_module.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=next(outputs)))
    git = receipt_module._git()
    assert git["sha"] == "0123abcdef" + "0" * 30 and git["dirty"] is True and len(git["diff_sha256"]) == 64
    loaded = Receipt.from_dict({**receipt_dict(), "git": {"sha": "0123abc", "dirty": None, "diff_sha256": None}})
    assert loaded.git.dirty is None
    # neither git nor a named commit: the sha and the flag are unknown, not "clean"
    monkeypatch.delenv("FP4LAB_GIT_SHA")
    monkeypatch.setattr(receipt_module.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=""))
    assert receipt_module._git() == {"sha": "unknown", "dirty": None, "diff_sha256": None}
    monkeypatch.setenv("FP4LAB_GIT_SHA", "0123ABC")  # named in capitals: the same commit
    outputs = iter(["0123abcdef" + "0" * 30 + "\n", ""])
    monkeypatch.setattr(receipt_module.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=next(outputs)))
    assert receipt_module._git()["dirty"] is False
