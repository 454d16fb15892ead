"""fp4lab.nn: FP4 training layers: recipes, the FP4 linear, MoE, GPT models, diagnostics.

Files: recipe.py (what is quantized and how, presets), quant.py (one operand, one GEMM),
gemms.py (the one three-GEMM autograd.Function, dense and grouped), linear.py (fp4_linear,
grouped_fp4_linear, FP4Linear), swap.py (quantize_model), moe.py
(routed and shared experts, balancing), model.py (GPT and its MoE variant), diagnostics.py
(operand statistics, stiction). Uses fp4lab.kernels, so CUDA tensors take the Triton path and
CPU tensors the reference, with the same bytes.
"""

from .diagnostics import StictionMeter, code_flip_rate, operand_stats, weight_codes
from .linear import FP4Linear, QuantContext, fp4_linear, fprop_weight, grouped_fp4_linear
from .model import GPT, MODEL_PRESETS, ModelConfig, gpt_config, model_config
from .moe import MoE, MoEConfig, RouterKind
from .recipe import (PRESETS, Bf16Scope, GemmSpec, HadamardMode, Operand, Recipe, load_recipe,
                     preset)
from .swap import fp4_modules, quant_context, quantize_model

__all__ = [
    "PRESETS", "Bf16Scope", "FP4Linear", "GPT", "GemmSpec", "HadamardMode", "MODEL_PRESETS", "MoE",
    "MoEConfig", "ModelConfig", "Operand", "QuantContext", "Recipe", "RouterKind",
    "StictionMeter", "code_flip_rate", "fp4_linear", "fp4_modules", "fprop_weight", "gpt_config",
    "grouped_fp4_linear",
    "load_recipe", "model_config", "operand_stats", "preset", "quant_context", "quantize_model",
    "weight_codes",
]
