"""How a run spreads over ranks: DDP replicates the model, FSDP2 shards it.

    ddp   torch.nn.parallel.DistributedDataParallel: every rank holds the whole model and its
          optimizer state; gradients are all-reduced (averaged) during backward.
    fsdp  torch.distributed.fsdp.fully_shard (FSDP2), per transformer block, then the root (the
          embedding, LM head and what is left): every parameter becomes a DTensor sharded on dim 0
          over the ranks (an expert stack [E, out, in] by experts), and so does its optimizer state.
          Before a block's forward (and again for its backward) FSDP all-gathers the block's
          parameters, so the FP4 layers quantize the whole weight: tensor scales (amax) are taken
          over the full tensor, as on one GPU. Gradients are reduce-scattered (averaged); each rank
          keeps its shard's.

Under both, each rank reads its share of every global batch (data.TokenStream), so the global
batch is one GPU's. Under FSDP, what needs whole tensors gathers them:
    - Muon orthogonalises whole matrices (optim.Muon);
    - checkpoints hold full tensors (``model_state`` / ``optimizer_state`` gather them to the CPU;
      ``load_model_state`` / ``load_optimizer_state`` shard them back): the files are the same as
      one rank's, keys, shapes and optimizer indices;
    - the stiction meter quantizes whole weights (nn.diagnostics);
    - every forward is a collective, so evaluation runs idle forwards on a rank whose share of
      the last validation batch is empty (loop._evaluate).
One process has nothing to shard: ``parallel = "fsdp"`` asks for torchrun with 2 or more.
MoE load counts and balancing biases are buffers, never sharded: the loop sums the counts
over ranks in both modes.

Public: ``PARALLEL``, ``check``, ``wrap``, ``is_sharded``, ``is_dtensor``, ``model_state``, ``load_model_state``,
``optimizer_state``, ``load_optimizer_state``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed's FSDP, DTensor and checkpoint modules take ~1 s to import (and some builds of
# torch lack them): they are imported where a process group is up, the only time they are needed

PARALLEL = ("ddp", "fsdp")
"""What TrainConfig.parallel takes."""


def check(parallel: str, world: int) -> None:
    """ValueError unless ``parallel`` can spread a run over ``world`` ranks (before any data is read)."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if parallel == "fsdp" and world == 1:
        raise ValueError("parallel=fsdp shards the model over ranks: run it under torchrun with 2 or more "
                         "processes (one process trains the whole model: leave parallel at ddp)")


def wrap(model: nn.Module, parallel: str, *, world: int, device: torch.device) -> nn.Module:
    """The model as trained over ``world`` ranks -> the module to call (``model`` itself under
    FSDP, sharded in place: build the optimizers after this, over its DTensor parameters)."""
    check(parallel, world)
    if world == 1:
        return model
    if parallel == "ddp":
        # buffers stay per rank: the MoE load counts are summed over ranks explicitly, once a step
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by FSDP2."""
    if not dist.is_initialized():
        return False
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter, its gradient or optimizer state)."""
    if not dist.is_initialized():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def model_state(model: nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict on the CPU (contiguous): parameters and persistent buffers. A
    collective under FSDP (every rank calls it; rank 0 gets the tensors, the others {}); {}
    where ``keep`` is False."""
    if not keep and not is_sharded(model):
        return {}
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def load_model_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (every rank holds all of it; FSDP keeps each rank's shards)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(tensors, strict=True)


# The optimizer state is gathered by hand rather than by torch.distributed.checkpoint's
# get/set_optimizer_state_dict: those key it by parameter name (and set_ runs a zero-lr step to
# create the state of an empty optimizer first); gathering each DTensor keeps optim.pt exactly
# one rank's optimizer.state_dict(), indices and all, so a checkpoint does not depend on how
# the run was spread.

def optimizer_state(opt: torch.optim.Optimizer, *, keep: bool = True) -> dict[str, Any] | None:
    """``opt.state_dict()`` with every sharded tensor gathered whole (a collective under FSDP:
    every rank calls it; ranks with ``keep`` False get None)."""
    saved = opt.state_dict()
    state = {i: {k: _whole(v, keep) for k, v in s.items()} for i, s in saved["state"].items()}
    return {**saved, "state": state} if keep else None


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a full optimizer state dict (``optimizer_state``'s), sharding each tensor as its
    parameter is sharded (every rank holds all of it and keeps its shard)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {i: {k: _shard_like(v, params[i]) if i < len(params) else v for k, v in s.items()}
             for i, s in saved["state"].items()}
    opt.load_state_dict({**saved, "state": state})


def _whole(value: Any, keep: bool) -> Any:
    if is_dtensor(value):
        value = value.full_tensor()
        return value.cpu() if keep else None
    return value


def _shard_like(value: Any, param: torch.Tensor) -> Any:
    """A full tensor of ``param``'s shape -> the DTensor sharded as ``param`` (the rank's own
    chunk, no communication: every rank holds the full tensor); anything else as it is."""
    if is_dtensor(param) and isinstance(value, torch.Tensor) and value.shape == param.shape:
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value
