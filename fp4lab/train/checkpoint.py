"""Checkpoints that resume exactly and fail loudly.

A checkpoint is a directory:
    model.safetensors   the model's state dict (parameters and persistent buffers: MoE biases)
    optim.pt            optimizer state dicts and the torch RNG states (CPU and CUDA)
    state.json          step, the run's identity (model config, recipe, data identity, seed,
                        world size), the metrics so far, and the sha256 of the two files above
Writes are atomic: everything goes to a sibling temporary directory, is flushed, and then
renamed over the old checkpoint, so an interrupted save leaves the previous checkpoint intact
(moved aside for an instant: ``recover_interrupted_save`` puts it back if the save died there).
Loading checks, before touching the model: that the files exist and their hashes match (a
truncated or corrupt file is an error, never a partial load), that the identity equals the
current run's (a checkpoint of another recipe or model is refused with the differing keys),
and that the state dict's keys and shapes match exactly.
Under FSDP2 the files hold the full tensors, the same as one rank's: saving gathers them (every
rank calls ``save_checkpoint``, rank 0 writes), loading shards them back (train.parallel).

Public: ``save_checkpoint``, ``load_checkpoint``, ``recover_interrupted_save``, ``CheckpointError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .errors import CheckpointError
from .parallel import load_model_state, load_optimizer_state, model_state, optimizer_state

FILES = ("model.safetensors", "optim.pt")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())


def _as_umask_allows(path: Path) -> None:
    """Give ``path`` the permissions a plain new file gets (0666 less the umask), like its siblings."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_checkpoint(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], *, step: int,
                    identity: dict[str, Any], extra: dict[str, Any], write: bool = True) -> Path | None:
    """Write the checkpoint directory ``path`` atomically (see the module doc). Under FSDP every
    rank calls it (the full tensors are gathered) and only the one with ``write`` writes."""
    tensors = model_state(model, keep=write)
    optim_states = [optimizer_state(o, keep=write) for o in optimizers]
    if not write:
        return None
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    _as_umask_allows(tmp / "model.safetensors")  # safetensors writes through a private (0600) temp file
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"optimizers": optim_states, "rng": rng}, tmp / "optim.pt")
    state = {"step": step, "identity": identity, **extra,
             "sha256": {name: _sha256(tmp / name) for name in FILES}}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    _fsync_dir(tmp)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def recover_interrupted_save(path: Path) -> bool:
    """If a save was cut off between its two renames (the previous checkpoint moved aside to
    ``.NAME.old-PID``, the new one not yet in place), put the previous checkpoint back -> whether
    one was restored. Safe to call from several ranks at once."""
    path = Path(path)
    if path.exists():
        return False
    for old in sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            old.rename(path)
            return True
        except OSError:  # another rank restored it first
            return path.exists()
    return False


def _diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += _diff(saved.get(key), current.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == current else [f"{prefix[:-1]}: checkpoint {saved!r}, run {current!r}"]


def read_state(path: Path) -> dict[str, Any]:
    """state.json of a checkpoint, after checking that its files are whole."""
    path = Path(path)
    state_path = path / "state.json"
    if not state_path.is_file():
        raise CheckpointError(f"{path}: no state.json: not a checkpoint (or an interrupted first save)")
    try:
        state = json.loads(state_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{state_path}: corrupt JSON ({err})") from None
    for name in FILES:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if _sha256(file) != state.get("sha256", {}).get(name):
            raise CheckpointError(f"{file}: sha256 does not match state.json: the file is corrupt or truncated")
    return state


def load_checkpoint(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], *,
                    identity: dict[str, Any]) -> dict[str, Any]:
    """Restore model, optimizers and RNG from ``path`` -> its state.json (step, metrics, ...)."""
    state = read_state(path)
    differences = _diff(state.get("identity"), identity)
    if differences:
        raise CheckpointError(f"{path} belongs to another run:\n  " + "\n  ".join(differences))
    tensors = load_file(str(Path(path) / "model.safetensors"))
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad_shape = [k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape]
    if missing or unexpected or bad_shape:
        raise CheckpointError(f"{path}: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                              f"shape differs {bad_shape[:5]}")
    blob = torch.load(Path(path) / "optim.pt", map_location="cpu", weights_only=False)
    if len(blob["optimizers"]) != len(optimizers):
        raise CheckpointError(f"{path}: {len(blob['optimizers'])} optimizers saved, run has {len(optimizers)}")
    load_model_state(model, tensors)
    for opt, saved in zip(optimizers, blob["optimizers"]):
        load_optimizer_state(opt, saved)
    torch.set_rng_state(blob["rng"]["cpu"])
    if torch.cuda.is_available() and blob["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(blob["rng"]["cuda"])
    return state
