"""scripts/gpu_campaign.sh: what a device call's fresh shell can get wrong before anything runs."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_study_campaign_without_a_scale_is_refused_before_it_starts(tmp_path):
    """Each device call is a fresh shell: a study phase started without SCALE would run at the
    default gpu-medium unnoticed, so `start` refuses it and starts nothing."""
    (tmp_path / "scripts").mkdir()
    for name in ("gpu_campaign.sh", "quiet.sh"):
        shutil.copy(SCRIPTS / name, tmp_path / "scripts" / name)
    stub = tmp_path / "bin"  # a python3 that does nothing: a regressed guard starts no real study
    stub.mkdir()
    (stub / "python3").write_text("#!/bin/sh\nexit 0\n")
    (stub / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SCALE"} | {
        "OUT": str(tmp_path / "out"), "PATH": f"{stub}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "scripts/gpu_campaign.sh", "start", "m", "receipts", "study:gains@2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SCALE" in done.stdout
    assert not (tmp_path / "runs" / "gpu" / "m.log").exists()  # no campaign for `wait` to wait on
