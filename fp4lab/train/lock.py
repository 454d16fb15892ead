"""One writer per run directory: an exclusive lock taken when a run starts.

Two runs writing one folder (a second terminal, a re-run script, ``--resume`` racing a live run,
study jobs sharing a folder) would interleave metrics lines and overwrite each other's receipt
and checkpoint. ``RunLock`` holds ``<run_dir>/.lock`` for the life of the run:

    - the lock is an OS file lock (``fcntl.flock``), so the kernel releases it when the holder
      dies, however it dies (``kill -9`` included): a dead holder never blocks a new run;
    - the file records the holder (pid, host, start time); a second writer is refused with a
      ``RunLockedError`` that names it;
    - a lock file left by a process that no longer holds it is taken over with a notice naming
      the dead holder.
Where ``fcntl`` is missing (Windows) the holder's pid is checked instead (same host only).

Public: ``RunLock``, ``RunLockedError``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .errors import RunLockedError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(text: str) -> dict:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "an unknown process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} (since {started})"


class RunLock:
    """``with RunLock(run_dir):`` the only writer of ``run_dir`` (created if missing)."""

    def __init__(self, run_dir: str | Path, *, notice=print):
        self.path = Path(run_dir) / LOCK_NAME
        self.notice = notice
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        previous = _holder(os.read(fd, 4096).decode(errors="replace"))
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise RunLockedError(f"{self.path.parent} is being written by {_describe(previous)}; "
                                     "wait for it to finish, or write this run to another folder") from None
        elif previous.get("host") == socket.gethostname() and previous.get("pid") and _alive(previous["pid"]) \
                and previous["pid"] != os.getpid():
            os.close(fd)
            raise RunLockedError(f"{self.path.parent} is being written by {_describe(previous)}")
        if previous:
            self.notice(f"note: {self.path.parent} held a lock of {_describe(previous)}, which is no longer "
                        "running; taking it over")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # an empty lock file is no holder: the next run takes it silently
        finally:
            os.close(fd)  # closing releases the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
