"""The errors a user's action or install causes (a run folder's, a missing optional dependency),
kept apart from the modules that raise them (checkpoint.py, lock.py, hub/hf.py) so the command
line can name them without importing torch.

Public: ``CheckpointError``, ``RunLockedError``, ``MissingDependency``.
"""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or from another run."""


class RunLockedError(RuntimeError):
    """Another live process is writing this run directory."""


class MissingDependency(ImportError):
    """An optional dependency a command needs is not installed."""
