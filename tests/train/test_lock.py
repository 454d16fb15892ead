"""train.lock: one writer per run directory; a second live writer is refused by name; a lock a
killed process left behind is taken over with a notice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fp4lab.train.lock import RunLock, RunLockedError

HOLD = """
import sys, time
from fp4lab.train.lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_and_named(tmp_path):
    proc = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunLockedError, match=f"being written by pid {proc.pid} on "):
            RunLock(tmp_path / "run").acquire()
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_notice(tmp_path):
    proc = _holder(tmp_path / "run")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    notices = []
    with RunLock(tmp_path / "run", notice=notices.append):
        held = json.loads((tmp_path / "run" / ".lock").read_text())
        assert held["pid"] == os.getpid()
    assert len(notices) == 1 and f"pid {proc.pid}" in notices[0] and "no longer running" in notices[0]


def test_release_lets_the_next_run_in_quietly(tmp_path):
    notices = []
    with RunLock(tmp_path / "run", notice=notices.append):
        pass
    with RunLock(tmp_path / "run", notice=notices.append):
        pass
    assert notices == [] and (tmp_path / "run" / ".lock").read_text() == ""


def test_two_train_processes_into_one_folder_one_is_refused_and_the_run_stays_whole(tmp_path, token_file):
    """The issue's case: a second `fp4lab train` into a live run's folder (a second terminal)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fp4lab", "train", "--model", "tiny", "--data", str(token_file), "--out", str(run),
           "--set", "batch_size=4", "--set", "seq_len=16", "--set", "eval_every=0", "--set", "eval_batches=1",
           "--set", "log_every=1", "--set", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([*cmd, "--steps", "600"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()):  # the first writer is training
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        second = subprocess.run([*cmd, "--steps", "600", "--overwrite"], env=env, capture_output=True, text=True,
                                timeout=120)
        assert first.poll() is None  # the refusal came while the first run was writing
        assert second.returncode == 2 and f"being written by pid {first.pid}" in second.stderr
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "train_loss" in line]
    assert steps == list(range(1, 601))  # one writer: every line whole, each step once, in order
    assert json.loads((run / "receipt.json").read_text())["status"] == "ok"
