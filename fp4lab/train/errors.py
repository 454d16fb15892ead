"""The errors of a run folder that a user's action causes, kept apart from the modules that raise
them (checkpoint.py, lock.py) so the command line can name them without importing torch.

Public: ``CheckpointError``, ``RunLockedError``.
"""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or from another run."""


class RunLockedError(RuntimeError):
    """Another live process is writing this run directory."""
