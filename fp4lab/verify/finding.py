"""One deviation the checkpoint doctor found: ``Finding(level, code, where, message)``.

``level`` is "error" (an engine would fail to load, or load wrong numbers) or "warning" (loads,
but looks unintended); ``code`` is a short stable name for tests and scripts; ``where`` is the
file, tensor or module; printed, a finding is one line.

Public: ``Finding``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    level: str
    code: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():<7} {self.where}: {self.message} [{self.code}]"

    def as_dict(self) -> dict:
        return asdict(self)
