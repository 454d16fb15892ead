"""fp4lab without Triton: only fp4lab.kernels' fast paths need it, and they import it lazily, so
the formats, the FP4 layers (dense and grouped) and the trainer import and run on the reference."""

import subprocess
import sys

SCRIPT = r'''
import importlib.util, sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError("triton is not installed here")

sys.meta_path.insert(0, NoTriton())
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "triton" else real_find_spec(name, *a)

import torch
import fp4lab.cli, fp4lab.nn, fp4lab.studies.catalog, fp4lab.train.loop
from fp4lab.nn import QuantContext, fp4_linear, grouped_fp4_linear, preset

x = torch.randn(32, 64, requires_grad=True)
fp4_linear(x, torch.randn(48, 64), None, preset("nvfp4")).sum().backward()
grouped_fp4_linear(x, torch.randn(2, 48, 64), [10, 22], preset("mxfp4"), name="e",
                   context=QuantContext()).sum().backward()
for command in (["generate", "--help"], ["demo", "--help"]):
    try:
        fp4lab.cli.main(command)
    except SystemExit as done:
        assert done.code == 0, command

import numpy as np
from fp4lab.train.data import write_bin
from fp4lab.train.loop import TrainConfig, train

write_bin(sys.argv[1], np.arange(20_000) % 97)
receipt = train(TrainConfig(out=sys.argv[2], model="tiny", data=sys.argv[1], recipe="nvfp4_plain", steps=2,
                            batch_size=2, seq_len=32, eval_every=2, eval_batches=1, progress=False))
assert receipt["status"] == "ok" if isinstance(receipt, dict) else receipt.status == "ok"
assert "triton" not in sys.modules
print("ok")
'''


def test_layers_cli_and_trainer_work_without_triton(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tokens.bin"), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
