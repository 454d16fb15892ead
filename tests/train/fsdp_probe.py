"""What the FP4 layers quantize under FSDP2, caught inside their forward: test_fsdp runs this on
2 ranks (``python -m torch.distributed.run --standalone --nproc_per_node 2 -m
tests.train.fsdp_probe OUT``) and on one (``probe``) and compares the two.

Every rank feeds the same batch to the MoE tiny model under NVFP4, so every operand of every
GEMM, forward and backward, is one rank's exactly when the layers see whole weights (tensor
scales over the full tensor). Each rank writes OUT/rank<r>.safetensors (the fprop weight
operand's codes, block scales and tensor scale of every layer and expert, as the forward
pre-hook found the weight) and OUT/rank<r>.json (nn.operand_stats of all operands).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from fp4lab.nn import GPT, FP4Linear, fprop_weight, load_recipe, model_config, operand_stats, quantize_model
from fp4lab.nn.moe import GroupedExperts
from fp4lab.train.parallel import wrap


def _capture(seen: dict[str, torch.Tensor]):
    def hook(module, args):
        if isinstance(module, FP4Linear):
            weights = {module.name: module.weight}
        else:
            weights = {f"{module.name}.{e}.{label}": w[e] for label, w in
                       (("gate", module.w_gate), ("up", module.w_up), ("down", module.w_down)) for e in range(len(w))}
        for name, w in weights.items():
            q = fprop_weight(w.detach(), module.recipe, name=name, context=module.context)
            seen.update({f"{name}.shape": torch.tensor(w.shape), f"{name}.codes": q.codes,
                         f"{name}.scales": q.scales, f"{name}.tensor_scale": q.tensor_scale})
    return hook


def probe(world: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]:
    """-> (fprop weight operands as the layers saw them, operand statistics) on this rank."""
    torch.manual_seed(0)
    model = GPT(model_config("moe-tiny", vocab_size=256, seq_len=32))
    quantize_model(model, load_recipe("nvfp4"))
    seen: dict[str, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, FP4Linear) or (isinstance(module, GroupedExperts) and module.recipe is not None):
            module.register_forward_pre_hook(_capture(seen))
    wrap(model, "fsdp" if world > 1 else "ddp", world=world, device=torch.device("cpu"))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    stats = operand_stats(model, lambda: model(x, x.roll(-1, 1)).backward())
    return {k: v.contiguous() for k, v in seen.items()}, stats


if __name__ == "__main__":
    dist.init_process_group("gloo")
    out, rank = Path(sys.argv[1]), dist.get_rank()
    seen, stats = probe(dist.get_world_size())
    save_file(seen, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(stats))
    dist.destroy_process_group()
