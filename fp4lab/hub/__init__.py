"""Published FP4 checkpoints: read ModelOpt / compressed-tensors NVFP4 and gpt-oss MXFP4 model
directories into FP4Tensors, write NVFP4 ones, and quantize a Hugging Face model (PTQ)."""

from .checkpoint import MXFP4, Checkpoint, read_checkpoint, write_checkpoint
from .ptq import is_quantizable, quantize_model_dir

__all__ = ["MXFP4", "Checkpoint", "read_checkpoint", "write_checkpoint", "is_quantizable", "quantize_model_dir"]
