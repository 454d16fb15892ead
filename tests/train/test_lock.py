"""train.lock: one writer per run directory; a second live writer is refused by name; a lock a
killed process left behind is taken over with a notice."""

import json
import os
import signal
import subprocess
import sys

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
