"""The run record: ``Receipt``, a typed, versioned, validated receipt.json; and what it pins
about the machine and the code (``environment``, ``peak_flops``, ``kernels_backend``).

A receipt is what ran and what came out of one training run (train.loop writes it; report,
studies, generate and the CLI read it). On disk it is JSON, one object:

    schema        5 (RECEIPT_SCHEMA)
    name, status, message        the run directory's name; "ok" / "stopped" / "diverged"; why
    config, recipe, recipe_text, model     TrainConfig, Recipe and ModelConfig as dicts
    params, active_params        parameter counts (all; those a token meets)
    data          ``Data``: corpus source, path, tokens, identity, tokenizer, document split, epochs
    seed, world   the run's seed; ranks
    coverage      which linears ran in FP4 (nn.swap.coverage)
    git, device, versions        ``Git`` (sha, dirty, diff hash), the device's name, package versions
    backend       the kernels backend the FP4 GEMMs dispatch to on this device: "triton" or
                  "reference" (they sum in different orders); "unknown" where it was not recorded
    evals         ``Eval`` per evaluation (step, tokens, val_loss)
    train_curve   [step, train loss] pairs (at most about 500)
    final         ``Final``: last and best val loss, last train loss, steps done, and for a run
                  whose forward runs FP4 the last val loss of its weights with a BF16 forward; for
                  one that switched its forward to BF16 late, the same with its FP4 forward
    wall_s, tokens_per_s, mfu    wall seconds over all sessions; throughput past the first steps
    flip_rate     [step, fraction of FP4 weight codes one optimizer step flipped]

Reading (``Receipt.from_dict``, ``Receipt.load``) validates: a missing key or a value of the
wrong type is a ValueError naming the file and the key. Older schemas are upgraded on read:
schema 1 (no ``backend``: read as "unknown"; its early receipts also lack ``coverage``, read as
None, and ``data.eot_id`` / ``split`` / ``epochs``, read as None); schema 2 (no
``final.bf16_forward_val_loss``: read as None); schema 3 (no ``final.fp4_forward_val_loss``:
read as None); schema 4 (``git.dirty`` a bool: read as it is). A newer schema is refused.
Unknown top-level keys (a newer writer's, or notes added by hand) are kept in ``extra`` and
written back by ``to_dict``; unknown keys inside final, evals, data and git are ignored.
``receipt[key]`` reads the JSON form, for scripts written against the dict receipts.

``environment(device)`` -> {"git": {"sha", "dirty", "diff_sha256"}, "versions": {...},
"device": name}. The device machine gets the tree without .git, so FP4LAB_GIT_SHA (set by
whoever launches the run) takes precedence. ``peak_flops`` gives dense BF16 tensor-core peaks
for MFU (None where unknown, e.g. CPUs).

Public: ``Receipt``, ``Eval``, ``Final``, ``Data``, ``Git``, ``RECEIPT_SCHEMA``, ``STATUSES``,
``environment``, ``peak_flops``, ``kernels_backend``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

RECEIPT_SCHEMA = 5
STATUSES = ("ok", "stopped", "diverged")


@dataclass(frozen=True, kw_only=True)
class Eval:
    step: int
    """Optimizer steps done when the evaluation ran."""
    tokens: int
    """Training tokens seen by then (step x batch_size x seq_len)."""
    val_loss: float
    """Mean validation loss per token, nats (the run's last evaluation covers the whole split)."""


@dataclass(frozen=True, kw_only=True)
class Final:
    val_loss: float | None
    """The last evaluation's loss (None: the run never evaluated)."""
    min_val_loss: float | None
    """The lowest evaluation loss."""
    train_loss: float | None
    """The last step's training loss."""
    steps: int
    """Optimizer steps done (less than config steps when stopped or diverged)."""
    bf16_forward_val_loss: float | None
    """The last evaluation again, the same weights with every GEMM in BF16: what an FP4-trained
    model loses to its FP4 forward at inference (val_loss - this) against what training in FP4
    did to its weights (this - BF16's val_loss). None where the forward runs no FP4 GEMM."""
    fp4_forward_val_loss: float | None
    """For a run that switched its forward to BF16 late (``bf16_after``): the last evaluation
    again with the FP4 forward it trained with before the switch, the model as served in FP4.
    None for every other run (its val_loss is already scored through its own forward)."""


@dataclass(frozen=True, kw_only=True)
class Data:
    source: str
    """What the config named: a built-in corpus or a path."""
    path: str
    """The token shards (a built-in corpus's cache directory, with its tokenizer.json)."""
    tokens: int
    """Tokens in the shards (training and validation)."""
    identity: dict
    """data.dataset_meta's identity, {"sha256": ...} (the hash None where the shards carry no meta)."""
    vocab_size: int | None
    """The tokenizer's size (None: bare shards; the model then sizes by the largest id)."""
    tokenizer_sha256: str | None
    """sha256 of tokenizer.json (None: bare shards)."""
    eot_id: int | None
    """The end-of-text id the document split cuts at (None: fixed-size chunks)."""
    split: dict | None
    """data.TokenStream.split_info: train/val documents and tokens."""
    epochs: float | None
    """steps x batch_size over the training tokens."""


@dataclass(frozen=True, kw_only=True)
class Git:
    sha: str
    """The commit (FP4LAB_GIT_SHA where the tree came without .git; "unknown" if neither)."""
    dirty: bool | None
    """Whether the tree differed from the commit; None where that cannot be told: the tree came
    without the commit's .git (FP4LAB_GIT_SHA names a commit the tree's git does not have), or
    there is neither git nor FP4LAB_GIT_SHA."""
    diff_sha256: str | None
    """sha256 of ``git diff HEAD`` when dirty."""


@dataclass(frozen=True, kw_only=True)
class Receipt:
    schema: ClassVar[int] = RECEIPT_SCHEMA
    name: str
    """The run directory's name (arms are named ARM-seedK)."""
    status: str
    """One of STATUSES."""
    message: str
    """Why a run stopped or diverged ("" when ok)."""
    config: dict
    """TrainConfig.to_dict() (older receipts lack later fields, e.g. val_fraction)."""
    recipe: dict
    """Recipe.to_dict()."""
    recipe_text: str
    """Recipe.describe(): the recipe per GEMM, in words."""
    model: dict
    """ModelConfig.to_dict()."""
    params: int
    """Parameters in all."""
    active_params: int
    """Parameters one token meets (MoE: the routed experts only)."""
    data: Data
    """The corpus, its identity and its split."""
    seed: int
    """Initial weights, data order and the recipe's random bits."""
    world: int
    """Ranks (torchrun WORLD_SIZE)."""
    coverage: dict | None
    """nn.swap.coverage (None in early schema-1 receipts)."""
    git: Git
    """The code that ran."""
    device: str
    """The device's name (CPUs: architecture and cores)."""
    versions: dict
    """python, torch, triton, fp4lab versions."""
    backend: str
    """"triton", "reference", or "unknown" (schema 1, or the check failed)."""
    evals: tuple[Eval, ...]
    """Every evaluation, in step order."""
    train_curve: tuple[tuple[int, float], ...]
    """(step, train loss), thinned to about 500 points."""
    final: Final
    """Where the run ended."""
    wall_s: float
    """Wall seconds of the training steps, over every session of the run."""
    tokens_per_s: float | None
    """Past the first two steps of each session (they compile kernels); None when none were timed."""
    mfu: float | None
    """Model FLOP utilisation (None where the device's peak is unknown, e.g. CPUs)."""
    flip_rate: tuple[tuple[int, float], ...]
    """(step, fraction of FP4 weight codes the optimizer step flipped): stiction samples."""
    extra: dict = field(default_factory=dict)
    """Top-level keys this schema does not know, kept as read and written back."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"receipt status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to receipt.json (lists where the fields hold tuples)."""
        out = {"schema": RECEIPT_SCHEMA}
        out.update({f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        return {**out, **self.extra}

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "receipt") -> "Receipt":
        """A receipt's JSON object -> Receipt, upgraded and validated (see the module doc).
        ``source`` names it in errors (the file)."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a receipt is a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema is None:
            what = f"a {data['study']} study's receipt" if "study" in data else "no 'schema' key"
            raise ValueError(f"{source}: not a training receipt ({what})")
        if type(schema) is not int or not 1 <= schema <= RECEIPT_SCHEMA:
            newer = type(schema) is int and schema > RECEIPT_SCHEMA
            raise ValueError(f"{source}: receipt schema {schema!r}: this fp4lab reads schemas 1 to {RECEIPT_SCHEMA}"
                             + (" (written by a newer fp4lab?)" if newer else ""))
        for version in range(schema, RECEIPT_SCHEMA):
            data = _UPGRADES[version](data)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = {k: v for k, v in data.items() if k not in known and k != "schema"}
        return _record(cls, {**data, "extra": extra}, "", source)

    @classmethod
    def load(cls, path: str | Path) -> "Receipt":
        """Read and validate ``path``: a receipt.json, or the run directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "receipt.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no receipt.json (did the run finish?)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a readable receipt ({err})") from None
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | Path) -> Path:
        """Write receipt.json to ``path`` atomically (a reader never sees half a receipt)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path


def _upgrade_1(data: dict) -> dict:
    """Schema 1 -> 2: the backend was not recorded; early receipts lack coverage and the
    document split's data keys."""
    data = {**data, "backend": data.get("backend", "unknown"), "coverage": data.get("coverage")}
    if isinstance(data.get("data"), dict):
        data["data"] = {"eot_id": None, "split": None, "epochs": None, **data["data"]}
    return data


def _upgrade_2(data: dict) -> dict:
    """Schema 2 -> 3: the BF16-forward evaluation of the final weights was not made."""
    if isinstance(data.get("final"), dict):
        data = {**data, "final": {"bf16_forward_val_loss": None, **data["final"]}}
    return data


def _upgrade_3(data: dict) -> dict:
    """Schema 3 -> 4: a late switch's final weights were not evaluated with the FP4 forward."""
    if isinstance(data.get("final"), dict):
        data = {**data, "final": {"fp4_forward_val_loss": None, **data["final"]}}
    return data


def _upgrade_4(data: dict) -> dict:
    """Schema 4 -> 5: ``git.dirty`` may now be null (unknown: a tree without its commit's .git);
    a schema-4 receipt's bool reads as it is."""
    return data


_UPGRADES = {1: _upgrade_1, 2: _upgrade_2, 3: _upgrade_3, 4: _upgrade_4}
"""{schema: the function that lifts a receipt of that schema to the next}."""


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _name(hint: Any) -> str:
    """A type as the error messages say it (JSON's words for lists and null)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("null" if a is type(None) else _name(a) for a in args)
    if origin is tuple:
        return f"a list of {_name(args[0])}" if args[1:] == (Ellipsis,) else f"a list [{', '.join(map(_name, args))}]"
    return "an object" if dataclasses.is_dataclass(hint) else hint.__name__


def _record(cls: type, value: Any, where: str, source: str):
    """A JSON object -> dataclass ``cls``, every field checked (``where``: its key path)."""
    if not isinstance(value, dict):
        raise ValueError(f"{source}: receipt key {where.rstrip('.')!r} must be an object, got {type(value).__name__}")
    hints, kwargs = _hints(cls), {}
    for f in dataclasses.fields(cls):
        if f.name not in value:
            raise ValueError(f"{source}: receipt lacks key {where + f.name!r}")
        kwargs[f.name] = _check(value[f.name], hints[f.name], where + f.name, source)
    try:
        return cls(**kwargs)
    except ValueError as err:  # the record's own checks (a receipt's status)
        raise ValueError(f"{source}: {err}") from None


def _check(value: Any, hint: Any, where: str, source: str) -> Any:
    """``value`` against a field's type -> the value as the field holds it (JSON lists become
    tuples, JSON objects become the typed parts, ints become floats where floats are due)."""
    declared, origin, args = hint, typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _record(hint, value, where + ".", source)
    if origin is tuple and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(v, args[0], f"{where}[{i}]", source) for i, v in enumerate(value))
        if len(value) == len(args):
            return tuple(_check(v, a, f"{where}[{i}]", source) for i, (v, a) in enumerate(zip(value, args)))
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (str, bool, dict) and isinstance(value, hint):
        return value
    raise ValueError(f"{source}: receipt key {where!r} must be {_name(declared)}, got {type(value).__name__} "
                     f"{value!r:.60}")


# ---- the machine and the code ----------------------------------------------------------------

# dense BF16 peak, FLOP/s (vendor datasheets, SXM parts)
_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAKS.items() if key in name), None)


def kernels_backend(device: torch.device) -> str:
    """"triton" or "reference": where the FP4 kernels run for tensors on ``device`` (the GEMMs
    sum in a different order on each); "unknown" if the check fails (e.g. a bad FP4LAB_BACKEND)."""
    try:
        from ..kernels import uses_triton
        return "triton" if uses_triton(torch.empty(0, device=device)) else "reference"
    except Exception:  # noqa: BLE001 -- a record, never the reason a finished run fails
        return "unknown"


def _git() -> dict:
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    head = git("rev-parse", "--verify", "--quiet", "HEAD").strip().lower()  # empty: no git, or no commit
    named = os.environ.get("FP4LAB_GIT_SHA", "").strip().lower()
    if not head and not named:  # no git and no commit named: nothing to tell
        return {"sha": "unknown", "dirty": None, "diff_sha256": None}
    if named and not (head and head.startswith(named)):
        # a copied tree (the device machine's): whatever git finds there is not the named commit,
        # so its diff says nothing about the code that ran
        return {"sha": named, "dirty": None, "diff_sha256": None}
    diff = git("diff", "HEAD")
    return {"sha": head, "dirty": bool(diff),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"git": _git(), "device": name,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": _version("triton"), "fp4lab": _version("fp4lab")}}
