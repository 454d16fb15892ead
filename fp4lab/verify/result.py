"""The verdict of a verifier: ``CheckResult(ok, rung, message, details)``, printable.

``rung`` names the first case that failed (``None`` when every case passed); ``message`` is one
or two sentences a person can act on; ``details`` holds the numbers behind it (positions,
offsets, expected and actual values, error statistics) as plain Python values, so a result can
be printed, compared in a test, or dumped as JSON.

Public: ``CheckResult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    ok: bool
    """True when every rung passed."""
    rung: str | None
    """The first failing rung, None when ok."""
    message: str
    """What failed and why (or a summary of what passed)."""
    details: dict[str, Any] = field(default_factory=dict)
    """The evidence: positions, offsets, expected / actual values, statistics."""
    subject: str = ""
    """What was checked, e.g. 'check_gemm nvfp4/swizzled'."""

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = f"{self.subject}: " if self.subject else ""
        head += "PASS" if self.ok else f"FAIL at rung '{self.rung}'"
        lines = [head, f"  {self.message}"]
        for key, value in self.details.items():
            lines.append(f"  {key}: {_fmt(value)}")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], dict):
        return "".join(f"\n    {_fmt(v)}" for v in value)
    return str(value)
